"""Submitting and canceling jobs: the two writes the API makes (sync, redis-py + rq; no torch).

A Carpool job is an RQ job on the queue of its model and priority (`Keys.queue_name`), serialized with
rq's JSONSerializer (never pickle), whose single argument is the JobSpec as a JSON object, plus
Carpool's JobState hash. `submit_job` writes both in one MULTI/EXEC; `cancel_job` is one Lua
script, so a worker taking the job at the same moment sees either the job or the cancellation.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

from redis import Redis
from redis.asyncio import Redis as AsyncRedis
from redis.commands.core import Script
from redis.exceptions import NoScriptError
from redis.typing import EncodableT, FieldT
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer

from protocol.keys import RQ_JOB_FUNCTION, Keys
from protocol.messages import JobSpec, JobState, JobStatus, Priority
from protocol.rq_keys import KeyTemplate, RQKeys
from protocol.stream_steps import notify_steps
from protocol.webhook_events import EMIT_JOB_EVENT_LUA

# How long a finished job's RQ hash, result, JobState and token stream stay readable.
DEFAULT_RESULT_TTL = 24 * 3600
# Failed jobs are kept longer, for inspection in rq-dashboard (rq's own default is a year).
DEFAULT_FAILURE_TTL = 7 * 24 * 3600
# Only a plain `rq worker` enforces this (it runs jobs one by one through worker.rq_entry);
# Carpool workers bound a job by max_tokens instead.
DEFAULT_JOB_TIMEOUT = 600


@dataclass(frozen=True, slots=True)
class Idempotency:
    """A submission that must happen once per key (`Keys.idempotency`) within `ttl_s`."""

    key: str
    ttl_s: int


class DuplicateSubmission(Exception):
    """The idempotency key already names a job: nothing was enqueued."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"already submitted as job {job_id}")
        self.job_id = job_id


# How many of an owner's oldest indexed jobs each submission checks (and drops when their state
# has expired): the index loses entries faster than submissions add them, so it stays about
# the size of what retention keeps, without a sweeper. Only jobs created longer ago than the
# submission's own retention are checked: a younger one cannot have expired yet (a state's TTL
# starts at the job's end), so in the steady state the check reads nothing. [redis-cost] It
# read 16 live states a submission, about 6 % of a 50-token job's Redis CPU.
TRIM_OLDEST = 16


def queue_for(redis: Redis, model: str, priority: Priority, keys: Keys = Keys()) -> Queue:
    """The RQ queue that holds `model`'s jobs of `priority` (JSON serializer, like every Carpool
    queue)."""
    return Queue(keys.queue_name(model, priority), connection=redis, serializer=JSONSerializer)


def submit_job(
    redis: Redis,
    spec: JobSpec,
    keys: Keys = Keys(),
    *,
    result_ttl: int = DEFAULT_RESULT_TTL,
    failure_ttl: int = DEFAULT_FAILURE_TTL,
    timeout: int = DEFAULT_JOB_TIMEOUT,
    check: SubmissionCheck | None = None,
    idempotency: Idempotency | None = None,
) -> Job:
    """Enqueue `spec` as an RQ job on its model's queue of its priority and record its JobState
    (queued).

    One Lua script writes the RQ job hash, the queue entry and its wake-up (`Keys.wakeups`),
    the JobState hash and the owner's index (`Keys.jobs_by_owner`: a sorted set
    job_id -> created_at; owner "" when the API runs open).
    `spec.job_id` becomes the RQ job id; it must be new (letters, digits, '_' and '-'), since an
    existing job with that id would be overwritten. The result and the token stream are kept
    `result_ttl` seconds after the job ends (`failure_ttl` when it failed).

    Read it back with `Job.fetch(job_id, redis, serializer=JSONSerializer)` or `JobReader`.
    """
    (job,) = submit_jobs(redis, [spec], keys, result_ttl=result_ttl, failure_ttl=failure_ttl,
                         timeout=timeout, check=check, idempotency=idempotency)
    return job


def submit_jobs(
    redis: Redis,
    specs: list[JobSpec],
    keys: Keys = Keys(),
    *,
    result_ttl: int = DEFAULT_RESULT_TTL,
    failure_ttl: int = DEFAULT_FAILURE_TTL,
    timeout: int = DEFAULT_JOB_TIMEOUT,
    check: SubmissionCheck | None = None,
    idempotency: Idempotency | None = None,
) -> list[Job]:
    """`submit_job` for several specs in ONE Lua script: all are queued, or none.

    `check`: Lua run first in the same script (the API's queue depth and per-key limits:
    api/queue_admission.py); when it refuses, nothing is written and SubmissionRefused carries
    its verdict. Checked and written in one step, a burst over many API processes cannot
    overshoot a limit, and the submission costs Redis one request.
    `idempotency`: the script also records the first spec's job id under its key, and writes
    only while that key is unset: raises DuplicateSubmission, enqueueing nothing, when it names a
    job already, however many submissions race."""
    prepared = prepare_submission(redis, specs, keys, result_ttl=result_ttl,
                                  failure_ttl=failure_ttl, timeout=timeout, check=check,
                                  idempotency=idempotency)
    reply = prepared.script(keys=prepared.keys, args=prepared.args, client=redis)
    return submission_outcome(prepared, reply)


def _merge_hsets(commands: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Consecutive HSETs of one key as one (a later field still wins): rq's enqueue writes a
    job's status, then the whole job hash. [redis-cost] One command a job fewer in the script."""
    merged: list[tuple[Any, ...]] = []
    for command in commands:
        previous = merged[-1] if merged else None
        if (previous is not None and str(command[0]).upper() == "HSET"
                and str(previous[0]).upper() == "HSET" and command[1] == previous[1]):
            merged[-1] = (*previous, *command[2:])
        else:
            merged.append(command)
    return merged


@dataclass(frozen=True, slots=True)
class PreparedSubmission:
    """A submission built and not sent yet: its script's call, and the rq jobs it writes."""

    script: Script
    keys: list[str]
    args: list[EncodableT]
    jobs: list[Job]


def prepare_submission(
    redis: Redis,
    specs: list[JobSpec],
    keys: Keys = Keys(),
    *,
    result_ttl: int = DEFAULT_RESULT_TTL,
    failure_ttl: int = DEFAULT_FAILURE_TTL,
    timeout: int = DEFAULT_JOB_TIMEOUT,
    check: SubmissionCheck | None = None,
    idempotency: Idempotency | None = None,
) -> PreparedSubmission:
    """`submit_jobs`' script call, built (rq's records included) but not sent: for
    `send_submissions`, which sends several in one request. Reads nothing from Redis."""
    jobs = []
    queues = {(spec.model, spec.priority): queue_for(redis, spec.model, spec.priority, keys)
              for spec in specs}
    # rq builds its own records (the job hash, the queue entry, the queues set) into a pipeline
    # that is never executed: its commands are what the script runs, so `rq info` and
    # rq-dashboard see exactly what rq's own enqueue writes.
    with redis.pipeline(transaction=True) as pipe:
        for spec in specs:
            queue = queues[spec.model, spec.priority]
            state = JobState(job_id=spec.job_id, status=JobStatus.QUEUED, owner=spec.owner,
                             model=spec.model, created_at=spec.created_at,
                             queue_deadline_at=spec.queue_deadline_at,
                             deadline_at=spec.deadline_at,
                             logprobs=-1 if spec.sampling.logprobs is None else spec.sampling.logprobs,
                             prompt_logprobs_asked=(-1 if spec.sampling.prompt_logprobs is None
                                                    else spec.sampling.prompt_logprobs),
                             webhook_url=spec.webhook_url,
                             max_tokens=spec.sampling.max_tokens)
            jobs.append(queue.enqueue_call(
                RQ_JOB_FUNCTION,
                args=[spec.to_dict()],
                job_id=spec.job_id,
                result_ttl=result_ttl,
                failure_ttl=failure_ttl,
                timeout=timeout,
                description=f"generate {spec.sampling.max_tokens} tokens with {spec.model}",
                pipeline=pipe,
            ))
            pipe.lpush(keys.wakeups(queue.name), 1)
            # The fair-share index (worker/jobs/fair_share.py): the job in its owner's list too.
            pipe.rpush(keys.queue_owner_jobs(queue.name, spec.owner), spec.job_id)
            pipe.sadd(keys.queue_owners(queue.name), spec.owner)
            # A dict[str, str] is a valid mapping; redis-py's Mapping key type is invariant.
            pipe.hset(keys.state(spec.job_id),
                      mapping=cast("Mapping[FieldT, EncodableT]", state.to_fields()))
            # Every owner, "" (an open API) too: GET /v1/jobs lists from it.
            pipe.zadd(keys.jobs_by_owner(spec.owner), {spec.job_id: spec.created_at})
        writes = _merge_hsets([args for args, _ in pipe.command_stack])
        pipe.reset()
    state_template = KeyTemplate.of(keys.state("\x00"))
    owners = sorted({spec.owner for spec in specs})
    args: list[EncodableT] = [
        len(check.args) if check else 0, *(check.args if check else ()),
        idempotency.key if idempotency else "",
        ",".join(spec.job_id for spec in specs),  # every job id of the submission (its n choices)
        idempotency.ttl_s if idempotency else 0,
        state_template.prefix, state_template.suffix, TRIM_OLDEST,
        repr(time.time() - min(result_ttl, failure_ttl)), len(owners),
        *(keys.jobs_by_owner(owner) for owner in owners),
        len(writes), *(part for command in writes for part in (len(command), *command)),
    ]
    return PreparedSubmission(_submit_script(redis, check.lua if check else ""),
                              list(check.keys) if check else [], args, jobs)


def submission_outcome(prepared: PreparedSubmission, reply: Any) -> list[Job]:
    """The jobs a submission queued, from its script's reply; raises DuplicateSubmission or
    SubmissionRefused when it queued none."""
    outcome = _text(reply[0])
    if outcome == "duplicate":
        raise DuplicateSubmission(_text(reply[1]))
    if outcome == "refused":
        raise SubmissionRefused([int(value) for value in reply[1]])
    return prepared.jobs


def send_submissions(redis: Redis,
                     prepared: list[PreparedSubmission]) -> list[list[Job] | Exception]:
    """[redis-cost] Several submissions in one request: a pipeline, not a transaction (each
    script is atomic on its own and none depends on another's outcome, so each is queued,
    refused or a duplicate exactly as if sent alone, in this order). Per submission, its jobs or
    the exception it ended in (DuplicateSubmission, SubmissionRefused, a script's error). A
    connection error raises: none, some or all of them may have run (as for one submission
    whose reply was lost). Scripts Redis no longer has (a restart, SCRIPT FLUSH) are loaded and
    those submissions sent again (after the others: none of them had run)."""
    replies = _evalsha_all(redis, prepared)
    missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
    if missing:
        for script in {prepared[i].script.sha: prepared[i].script for i in missing}.values():
            redis.script_load(script.script)
        for i, reply in zip(missing, _evalsha_all(redis, [prepared[i] for i in missing])):
            replies[i] = reply
    outcomes: list[list[Job] | Exception] = []
    for submission, reply in zip(prepared, replies):
        if isinstance(reply, Exception):
            outcomes.append(reply)
            continue
        try:
            outcomes.append(submission_outcome(submission, reply))
        except (DuplicateSubmission, SubmissionRefused) as exc:
            outcomes.append(exc)
    return outcomes


def _evalsha_all(redis: Redis, prepared: list[PreparedSubmission]) -> list[Any]:
    # Plain EVALSHA: redis-py's Script objects would add a SCRIPT EXISTS round trip to the
    # pipeline (a missing script comes back as NoScriptError, handled by the caller).
    pipe = redis.pipeline(transaction=False)
    for submission in prepared:
        pipe.evalsha(submission.script.sha, len(submission.keys), *submission.keys,
                     *submission.args)
    return pipe.execute(raise_on_error=False)


@dataclass(frozen=True, slots=True)
class SubmissionCheck:
    """Lua that decides, in the submission's own script and before it writes anything, whether
    the jobs get in. Its body runs as a function whose KEYS are `keys` and whose ARGV are `args`;
    it returns a list of integers whose first is 1 to admit the jobs (then they are written), any
    other to refuse them (then nothing is, and submit_jobs raises SubmissionRefused with it)."""

    lua: str
    keys: tuple[str, ...]
    args: tuple[EncodableT, ...]


class SubmissionRefused(Exception):
    """The submission's check refused its jobs: nothing was enqueued. `verdict` is what the
    check returned."""

    def __init__(self, verdict: list[int]) -> None:
        super().__init__(f"the submission's check refused it: {verdict}")
        self.verdict = verdict


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# The submission: the idempotency key, the check, then the writes, one atomic step.
# KEYS: the check's. ARGV: the number of the check's arguments, the check's arguments, then the
#       idempotency key ('' for none), what it records (the job ids), its TTL in seconds; then the
#       owner index trim: prefix and suffix of a JobState key around a job id, how many of the
#       oldest entries to check, the created_at before which they may have expired, the number
#       of owner indexes and their keys; then the number of writes and, per write, its number of
#       words and the words (a Redis command as rq and submit_jobs built it).
# Returns {'queued'}, {'duplicate', the job ids the key names} or {'refused', the check's verdict}.
# The writes and the trim name keys that are not declared (rq's, the JobState's): fine on a
# standalone Redis, as the worker's scripts (worker/jobs/job_scripts.py).
_SUBMIT_LUA = """
local num_check_args = tonumber(ARGV[1])
local at = 2 + num_check_args
local idempotency_key = ARGV[at]
if idempotency_key ~= '' then
  local recorded = redis.call('GET', idempotency_key)
  if recorded then return {'duplicate', recorded} end
end
if check then
  local verdict = check(KEYS, {unpack(ARGV, 2, 1 + num_check_args)})
  if tonumber(verdict[1]) ~= 1 then return {'refused', verdict} end
end
local writes_at = at + 8 + tonumber(ARGV[at + 7])
local i = writes_at + 1
for _ = 1, tonumber(ARGV[writes_at]) do
  local n = tonumber(ARGV[i])
  redis.call(unpack(ARGV, i + 1, i + n))
  i = i + n + 1
end
if idempotency_key ~= '' then
  redis.call('SET', idempotency_key, ARGV[at + 1], 'EX', tonumber(ARGV[at + 2]))
end
-- The jobs whose retention ended leave their owner's index with them: only those created before
-- ARGV[at + 6] can have (a state's TTL starts at its job's end).
for o = 1, tonumber(ARGV[at + 7]) do
  local index = ARGV[at + 7 + o]
  local gone = {}
  for _, job_id in ipairs(redis.call('ZRANGEBYSCORE', index, '-inf', '(' .. ARGV[at + 6],
                                     'LIMIT', 0, tonumber(ARGV[at + 5]))) do
    if redis.call('EXISTS', ARGV[at + 3] .. job_id .. ARGV[at + 4]) == 0 then
      gone[#gone + 1] = job_id
    end
  end
  if #gone > 0 then redis.call('ZREM', index, unpack(gone)) end
end
return {'queued'}
"""

# One registered script per check (a few at most: the API has one).
_SCRIPTS: dict[str, Script] = {}


def _submit_script(redis: Redis, check_lua: str) -> Script:
    script = _SCRIPTS.get(check_lua)
    if script is None:
        prelude = (f"local function check(KEYS, ARGV)\n{check_lua}\nend\n" if check_lua
                   else "local check = nil\n")
        script = _SCRIPTS.setdefault(check_lua, redis.register_script(prelude + _SUBMIT_LUA))
    return script


# KEYS: canceled set, JobState hash, token stream, RQ job hash, fence counter, webhook events.
# ARGV: job_id, fallback TTL for the ended job's keys, then the (prefix, suffix) templates
# around a queue name of the RQ queue key (3), its CanceledJobRegistry key (5) and its owners
# set (7, Keys.queue_owners), and around a model name of its fair-share counters (9). The job's
# queue is its RQ `origin`, known only in-script (see worker/jobs/job_scripts.py on templates).
# The final entry's fields mirror StreamEntry.to_fields (kind "done"); tests parse it back.
_CANCEL_LUA = EMIT_JOB_EVENT_LUA + """
local job_id = ARGV[1]
local status = redis.call('HGET', KEYS[2], 'status')
if not status then
  return false
end
if status == 'finished' or status == 'failed' or status == 'canceled' then
  return status
end
if status == 'running' then
  -- The owning worker ends it at its next iteration boundary (it checks this set every step).
  redis.call('SADD', KEYS[1], job_id)
  return status
end
-- queued or preempted: take it off its queue if it is still there.
local rq_job = redis.call('HMGET', KEYS[4], 'status', 'origin')
local rq_status, origin = rq_job[1], rq_job[2]
local removed = 0
if origin then
  removed = redis.call('LREM', ARGV[3] .. origin .. ARGV[4], 1, job_id)
end
if removed == 0 and rq_status and rq_status ~= 'canceled' then
  -- A worker popped it and is claiming it right now (an rq worker, before it adopts it): its
  -- claim sees the flag and ends it.
  redis.call('SADD', KEYS[1], job_id)
  return status
end
-- Off its queue, or rq itself took it away and nobody will claim it: `rq empty` or
-- Job.delete (its RQ job gone), rq's Job.cancel (RQ status canceled). It ends here.
if origin then
  -- The fair-share index (worker/jobs/fair_share.py): out of its owner's list too.
  redis.call('LREM', ARGV[7] .. origin .. ARGV[8] .. ':' .. (redis.call('HGET', KEYS[2], 'owner') or ''),
             1, job_id)
end
local now = redis.call('TIME')
local now_s = string.format('%d.%06d', now[1], now[2])
-- A preempted job already has tokens: keep them as the job's partial result.
local entries = redis.call('XRANGE', KEYS[3], '-', '+')
local text = {}
local token_ids = {}
for _, entry in ipairs(entries) do
  local fields = entry[2]
  local kind, piece, token_id, run_ids = nil, '', nil, ''
  for j = 1, #fields, 2 do
    if fields[j] == 'kind' then kind = fields[j + 1]
    elseif fields[j] == 'text' then piece = fields[j + 1]
    elseif fields[j] == 'token_id' then token_id = tonumber(fields[j + 1])
    elseif fields[j] == 'token_ids' then run_ids = fields[j + 1] end
  end
  if kind == 'token' then
    text[#text + 1] = piece
    token_ids[#token_ids + 1] = token_id
  elseif kind == 'tokens' then  -- a run: several tokens in one entry (protocol/token_runs.py)
    for _, run_text in ipairs(cjson.decode(piece)) do text[#text + 1] = run_text end
    for run_id in string.gmatch(run_ids, '%d+') do token_ids[#token_ids + 1] = tonumber(run_id) end
  end
end
local num_tokens = #token_ids
-- The fair-share index (worker/jobs/fair_share.py): a job charged at an earlier claim (preempted,
-- then canceled while queued) settles its owner's counter to the tokens it did generate.
local fair = redis.call('HMGET', KEYS[2], 'fair_charge', 'fair_weight', 'owner', 'model')
if fair[1] then
  redis.call('HINCRBYFLOAT', ARGV[9] .. (fair[4] or '') .. ARGV[10], fair[3] or '',
             string.format('%.17g', (num_tokens - tonumber(fair[1])) / (tonumber(fair[2]) or 1)))
end
local prompt_tokens = redis.call('HGET', KEYS[2], 'prompt_tokens') or '0'
redis.call('XADD', KEYS[3], '0-' .. (num_tokens + 1), 'kind', 'done', 'finish_reason', 'canceled',
           'prompt_tokens', prompt_tokens, 'completion_tokens', num_tokens, 'error', '')
local ttl = tonumber(redis.call('HGET', KEYS[4], 'result_ttl') or ARGV[2]) or tonumber(ARGV[2])
local token_json = '[]'
if num_tokens > 0 then token_json = cjson.encode(token_ids) end
redis.call('HSET', KEYS[2], 'status', 'canceled', 'finish_reason', 'canceled',
           'finished_at', now_s, 'completion_tokens', num_tokens,
           'text', table.concat(text), 'token_ids', token_json)
if rq_status then  -- a deleted RQ job stays deleted
  redis.call('HSET', KEYS[4], 'status', 'canceled')
  redis.call('ZADD', ARGV[5] .. origin .. ARGV[6], now[1], job_id)
end
redis.call('SREM', KEYS[1], job_id)
-- Webhooks: the job.canceled event, with the status it reports (a running job's comes from FINISH).
emit_job_event(KEYS[6], KEYS[2], job_id, 'canceled', 'canceled', prompt_tokens, num_tokens, '')
if ttl > 0 then
  for i = 2, 5 do redis.call('EXPIRE', KEYS[i], ttl) end
end
return 'canceled'
"""


def cancel_job(redis: Redis, job_id: str, keys: Keys = Keys()) -> JobStatus | None:
    """Cancel a job atomically; returns its status after the call, None for an unknown job.

    - queued/preempted and still on its queue: removed from it, its stream ends with a final
      `canceled` entry (after any tokens a preempted run produced), JobState and RQ status
      become canceled (RQ's CanceledJobRegistry lists it). Returns CANCELED.
    - queued/preempted and taken off its queue by rq itself (`rq empty`, `Job.delete`, rq's
      `Job.cancel`), so no worker will ever claim it: ended the same way (a deleted RQ job
      stays deleted). Returns CANCELED.
    - running (or being claimed right now): flagged in `Keys.canceled()`; the owning worker stops
      it at its next iteration boundary, publishes the final `canceled` entry and frees its KV
      blocks. Returns the current status (RUNNING, or QUEUED/PREEMPTED mid-claim); poll the
      JobState or read the stream to see it end.
    - already finished/failed/canceled: nothing changes; returns that status.
    """
    script_keys, args = _cancel_call(job_id, keys)
    result = _cancel_result(redis.register_script(_CANCEL_LUA)(keys=script_keys, args=args))
    if result == JobStatus.CANCELED:
        # The final entry a queued job's cancel wrote (or an earlier cancel did: a spare
        # notification costs a stream hub one empty read).
        notify_steps(redis, keys, [job_id])
    return result


async def cancel_job_async(redis: AsyncRedis, job_id: str, keys: Keys = Keys()) -> JobStatus | None:
    """`cancel_job` from an event loop."""
    script_keys, args = _cancel_call(job_id, keys)
    result = _cancel_result(await redis.register_script(_CANCEL_LUA)(keys=script_keys, args=args))
    if result == JobStatus.CANCELED:
        async with redis.pipeline(transaction=False) as pipe:
            notify_steps(pipe, keys, [job_id])
            await pipe.execute()
    return result


def _cancel_call(job_id: str, keys: Keys) -> tuple[list[str], list[EncodableT]]:
    script_keys = [keys.canceled(), keys.state(job_id), keys.stream(job_id), RQKeys.job(job_id),
                   keys.fence(job_id), keys.webhook_events()]
    templates = [KeyTemplate.of(RQKeys.queue("\x00")), KeyTemplate.of(RQKeys.canceled("\x00")),
                 KeyTemplate.of(keys.queue_owners("\x00")), KeyTemplate.of(keys.fair_vtimes("\x00"))]
    args: list[EncodableT] = [job_id, DEFAULT_RESULT_TTL,
                              *(part for t in templates for part in (t.prefix, t.suffix))]
    return script_keys, args


def _cancel_result(status: Any) -> JobStatus | None:
    if status is None:
        return None
    return JobStatus(status.decode() if isinstance(status, bytes) else status)
