"""Submitting and canceling jobs: the two writes the API makes (sync, redis-py + rq; no torch).

A Carpool job is an RQ job on the queue of its priority (`Keys.queue_name`), serialized with
rq's JSONSerializer (never pickle), whose single argument is the JobSpec as a JSON object, plus
Carpool's JobState hash. `submit_job` writes both in one MULTI/EXEC; `cancel_job` is one Lua
script, so a worker taking the job at the same moment sees either the job or the cancellation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

from redis import Redis
from redis.typing import EncodableT, FieldT
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer

from protocol.keys import RQ_JOB_FUNCTION, Keys
from protocol.messages import JobSpec, JobState, JobStatus, Priority
from protocol.rq_keys import RQKeys

# How long a finished job's RQ hash, result, JobState and token stream stay readable.
DEFAULT_RESULT_TTL = 24 * 3600
# Failed jobs are kept longer, for inspection in rq-dashboard (rq's own default is a year).
DEFAULT_FAILURE_TTL = 7 * 24 * 3600
# Only a plain `rq worker` enforces this (it runs jobs one by one through worker.rq_entry);
# Carpool workers bound a job by max_tokens instead.
DEFAULT_JOB_TIMEOUT = 600


def queue_for(redis: Redis, priority: Priority, keys: Keys = Keys()) -> Queue:
    """The RQ queue that holds jobs of `priority` (JSON serializer, like every Carpool queue)."""
    return Queue(keys.queue_name(priority), connection=redis, serializer=JSONSerializer)


def submit_job(
    redis: Redis,
    spec: JobSpec,
    keys: Keys = Keys(),
    *,
    result_ttl: int = DEFAULT_RESULT_TTL,
    failure_ttl: int = DEFAULT_FAILURE_TTL,
    timeout: int = DEFAULT_JOB_TIMEOUT,
    admission: str | None = None,
) -> Job:
    """Enqueue `spec` as an RQ job on its priority's queue and record its JobState (queued).

    One MULTI/EXEC writes the RQ job hash, the queue entry, the JobState hash and, when the spec
    has an owner, the owner's index (`Keys.jobs_by_owner`: a sorted set job_id -> created_at).
    `spec.job_id` becomes the RQ job id; it must be new (letters, digits, '_' and '-'), since an
    existing job with that id would be overwritten. The result and the token stream are kept
    `result_ttl` seconds after the job ends (`failure_ttl` when it failed).

    Read it back with `Job.fetch(job_id, redis, serializer=JSONSerializer)` or `JobReader`.
    """
    (job,) = submit_jobs(redis, [spec], keys, result_ttl=result_ttl, failure_ttl=failure_ttl,
                         timeout=timeout, admission=admission)
    return job


def submit_jobs(
    redis: Redis,
    specs: list[JobSpec],
    keys: Keys = Keys(),
    *,
    result_ttl: int = DEFAULT_RESULT_TTL,
    failure_ttl: int = DEFAULT_FAILURE_TTL,
    timeout: int = DEFAULT_JOB_TIMEOUT,
    admission: str | None = None,
) -> list[Job]:
    """`submit_job` for several specs in ONE MULTI/EXEC: all are queued, or none.

    `admission`: a reservation in `Keys.admissions` that admitted them; it ends in the same
    transaction, so the jobs count toward the queue depth once, as a reservation or queued."""
    jobs = []
    queues = {p: queue_for(redis, p, keys) for p in {spec.priority for spec in specs}}
    with redis.pipeline(transaction=True) as pipe:
        for spec in specs:
            queue = queues[spec.priority]
            state = JobState(job_id=spec.job_id, status=JobStatus.QUEUED, owner=spec.owner,
                             model=spec.model, created_at=spec.created_at,
                             logprobs=-1 if spec.sampling.logprobs is None else spec.sampling.logprobs)
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
            # A dict[str, str] is a valid mapping; redis-py's Mapping key type is invariant.
            pipe.hset(keys.state(spec.job_id),
                      mapping=cast("Mapping[FieldT, EncodableT]", state.to_fields()))
            if spec.owner:
                pipe.zadd(keys.jobs_by_owner(spec.owner), {spec.job_id: spec.created_at})
        if admission is not None:
            pipe.zrem(keys.admissions(), admission)
        pipe.execute()
    return jobs


# KEYS: canceled set, JobState hash, token stream, RQ job hash, fence counter, then per
# priority (highest first) the RQ queue key and its CanceledJobRegistry key.
# ARGV: job_id, fallback TTL for the ended job's keys, then the queue names in KEYS' order.
# The final entry's fields mirror StreamEntry.to_fields (kind "done"); tests parse it back.
_CANCEL_LUA = """
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
local origin = redis.call('HGET', KEYS[4], 'origin')
local num_queues = #ARGV - 2
local queue_index = nil
for i = 1, num_queues do
  if ARGV[2 + i] == origin then queue_index = i end
end
local removed = 0
if queue_index then
  removed = redis.call('LREM', KEYS[5 + 2 * queue_index - 1], 1, job_id)
end
if removed == 0 then
  -- A worker popped it and is claiming it right now: its claim sees the flag and ends it.
  redis.call('SADD', KEYS[1], job_id)
  return status
end
local now = redis.call('TIME')
local now_s = string.format('%d.%06d', now[1], now[2])
-- A preempted job already has tokens: keep them as the job's partial result.
local entries = redis.call('XRANGE', KEYS[3], '-', '+')
local text = {}
local token_ids = {}
for _, entry in ipairs(entries) do
  local fields = entry[2]
  local kind, piece, token_id = nil, '', nil
  for j = 1, #fields, 2 do
    if fields[j] == 'kind' then kind = fields[j + 1]
    elseif fields[j] == 'text' then piece = fields[j + 1]
    elseif fields[j] == 'token_id' then token_id = tonumber(fields[j + 1]) end
  end
  if kind == 'token' then
    text[#text + 1] = piece
    token_ids[#token_ids + 1] = token_id
  end
end
local num_tokens = #token_ids
local prompt_tokens = redis.call('HGET', KEYS[2], 'prompt_tokens') or '0'
redis.call('XADD', KEYS[3], '0-' .. (num_tokens + 1), 'kind', 'done', 'finish_reason', 'canceled',
           'prompt_tokens', prompt_tokens, 'completion_tokens', num_tokens, 'error', '')
local ttl = tonumber(redis.call('HGET', KEYS[4], 'result_ttl') or ARGV[2]) or tonumber(ARGV[2])
local token_json = '[]'
if num_tokens > 0 then token_json = cjson.encode(token_ids) end
redis.call('HSET', KEYS[2], 'status', 'canceled', 'finish_reason', 'canceled',
           'finished_at', now_s, 'completion_tokens', num_tokens,
           'text', table.concat(text), 'token_ids', token_json)
redis.call('HSET', KEYS[4], 'status', 'canceled')
redis.call('ZADD', KEYS[5 + 2 * queue_index], now[1], job_id)
redis.call('SREM', KEYS[1], job_id)
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
    - running (or being claimed right now): flagged in `Keys.canceled()`; the owning worker stops
      it at its next iteration boundary, publishes the final `canceled` entry and frees its KV
      blocks. Returns the current status (RUNNING, or QUEUED/PREEMPTED mid-claim); poll the
      JobState or read the stream to see it end.
    - already finished/failed/canceled: nothing changes; returns that status.
    """
    script = redis.register_script(_CANCEL_LUA)
    priorities = Priority.ordered()
    script_keys = [keys.canceled(), keys.state(job_id), keys.stream(job_id), RQKeys.job(job_id),
                   keys.fence(job_id)]
    for priority in priorities:
        name = keys.queue_name(priority)
        script_keys += [RQKeys.queue(name), RQKeys.canceled(name)]
    args: list[EncodableT] = [job_id, DEFAULT_RESULT_TTL, *(keys.queue_name(p) for p in priorities)]
    status = script(keys=script_keys, args=args, client=redis)
    if status is None:
        return None
    return JobStatus(status.decode() if isinstance(status, bytes) else status)
