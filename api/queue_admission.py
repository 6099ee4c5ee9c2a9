"""QueueAdmission: the queue depth limit of each model and each API key's own limits (queued jobs,
tokens per minute), exact over every API process."""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass

from api.errors import KeyLimitError, QueueFullError
from api.key_policies import KeyPolicy
from protocol import Keys, Priority
from protocol.job_submission import SubmissionCheck
from protocol.rq_keys import RQKeys

# The check submit_jobs runs in its own script before it writes the jobs (protocol.SubmissionCheck).
# KEYS: the fair-share weights, the owner's token log, then the P RQ queues counted (the
#       background tier alone, or all the others), then the owner's P lists of those queues
#       (Keys.queue_owner_jobs).
# ARGV: max depth, owner, the owner's weight, its max queued jobs (0: none), its tokens per minute
#       (0: none), the tokens asked, the token log member, the number of jobs.
# Returns {1 admitted | 0 queue full | -1 the owner's queued jobs limit | -2 its tokens per
#          minute, depth counted (0) / the owner's jobs waiting (-1) / tokens used this minute (-2),
#          ms until the asked tokens fit (-2)}.
# All the jobs of one request (its n choices) get in together or not at all; admitted, they are
# queued in the same script, so no burst can pass a limit between the check and the enqueue.
_ADMIT_LUA = """
local num_jobs = tonumber(ARGV[8])
local P = (#KEYS - 2) / 2
local depth = 0
for i = 3, 2 + P do depth = depth + redis.call('LLEN', KEYS[i]) end
if depth + num_jobs > tonumber(ARGV[1]) then return {0, depth, 0} end
local owner = ARGV[2]
local max_queued = tonumber(ARGV[4])
if max_queued > 0 then
  -- The owner's jobs in the queues: the lengths of its lists in the fair-share index
  -- (worker/jobs/fair_share.py), no scan of the queues.
  local mine = 0
  for i = 3 + P, #KEYS do mine = mine + redis.call('LLEN', KEYS[i]) end
  if mine + num_jobs > max_queued then return {-1, mine, 0} end
end
local tpm = tonumber(ARGV[5])
if tpm > 0 then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local asked = tonumber(ARGV[6])
  -- The tokens-per-minute window: the last 60,000 ms.
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - 60000)
  local log = redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES')
  local used = 0
  for i = 1, #log, 2 do used = used + tonumber(string.match(log[i], ':(%d+)$')) end
  if used + asked > tpm then
    -- The wait: until enough of the oldest submissions have left the minute.
    local freed, wait = 0, 60000
    for i = 1, #log, 2 do
      freed = freed + tonumber(string.match(log[i], ':(%d+)$'))
      if used - freed + asked <= tpm then
        wait = tonumber(log[i + 1]) + 60000 - now
        break
      end
    end
    return {-2, used, wait}
  end
  redis.call('ZADD', KEYS[2], now, ARGV[7])
  redis.call('PEXPIRE', KEYS[2], 60000)
end
redis.call('HSET', KEYS[1], owner, ARGV[3])
return {1, depth, 0}
"""


@dataclass(frozen=True, slots=True)
class Admission:
    """One request's admission: the check its submission runs (`check`), and the error a
    refusal of it means (`refusal`)."""

    check: SubmissionCheck
    model: str
    num_jobs: int
    limit: int
    is_background: bool
    policy: KeyPolicy
    tokens: int
    retry_after_s: int

    def refusal(self, verdict: list[int]) -> QueueFullError | KeyLimitError:
        """The 429 for the check's verdict (SubmissionRefused.verdict)."""
        outcome, count, wait_ms = verdict
        wanted = "" if self.num_jobs == 1 else f" for {self.num_jobs} more jobs"
        if outcome == 0:
            queue = "batch queue" if self.is_background else "job queue"
            return QueueFullError(
                f"The {queue} of model '{self.model}' is full ({count} jobs waiting, the limit "
                f"is {self.limit}){wanted}; retry later", self.retry_after_s)
        if outcome == -1:
            return KeyLimitError(
                f"This API key has {count} jobs waiting for model '{self.model}', its limit is "
                f"{self.policy.max_queued_jobs} (max_queued_jobs_per_key){wanted}; retry once "
                f"some have started", "queued_jobs_per_key_exceeded", self.retry_after_s)
        retry_after_s = max(1, math.ceil(wait_ms / 1000))
        return KeyLimitError(
            f"This API key's limit is {self.policy.tokens_per_minute} tokens per minute "
            f"(tokens_per_minute_per_key: prompt + max_tokens of each job); it submitted "
            f"{count} in the last minute and this request needs {self.tokens}; retry after "
            f"{retry_after_s} s", "tokens_per_minute_exceeded", retry_after_s)


class QueueAdmission:
    """Admits a submission only while its model's queues hold fewer than `max_queue_depth` jobs
    (per model: a model whose workers are gone fills its own queues, not the others'), and while
    its API key is within its own limits (`KeyPolicy`): jobs waiting in the model's queues, and
    tokens (prompt + max_tokens) submitted over the last minute (`Keys.owner_token_log`).

    Checked naively (read the depth, then enqueue), a burst reads the same depth everywhere and all
    of it gets in, and a per-process count of enqueues in flight cannot see the other API
    processes. Here the check is Lua that the submission's own script runs before it writes the
    jobs (protocol.SubmissionCheck): the depth it counts is the queues', every job of the
    fleet is counted once, in every process, so the queues never pass the limit; and the
    submission costs Redis one request. The same check writes the key's fair-share weight
    (`Keys.fair_weights`) for the workers' claims.

    The background tier (`batch`) has a depth of its own and does not count toward the others'
    (nor they toward it), and a key's queued jobs are counted per side the same way: batch lines
    wait their turn in their input file, never crowding interactive requests out. Batch lines do
    not count toward tokens per minute (as with OpenAI, whose batches have a queue limit of their
    own instead): the batch runner submits them as seats allow.
    """

    def __init__(self, keys: Keys, max_queue_depth: int, retry_after_s: int,
                 max_background_depth: int | None = None) -> None:
        self.max_queue_depth = max_queue_depth
        self.max_background_depth = max_background_depth or max_queue_depth
        self._keys = keys
        self._retry_after_s = retry_after_s

    def admission(self, model: str, num_jobs: int = 1, owner: str = "",
                  policy: KeyPolicy = KeyPolicy(), tokens: int = 0,
                  priority: Priority = Priority.NORMAL) -> Admission:
        """The admission of `num_jobs` jobs of `model` for `owner` (asking for `tokens` in all):
        pass its `check` to submit_jobs, and raise its `refusal(verdict)` when the submission
        is refused (a 429: they would not all fit)."""
        # The tiers counted: the background one alone, or all the others.
        queue_names = [self._keys.queue_name(model, p) for p in Priority.ordered()
                       if p.is_background == priority.is_background]
        limit = self.max_background_depth if priority.is_background else self.max_queue_depth
        tokens_per_minute = 0 if priority.is_background else policy.tokens_per_minute
        check = SubmissionCheck(_ADMIT_LUA, keys=(
            self._keys.fair_weights(), self._keys.owner_token_log(owner),
            *(RQKeys.queue(name) for name in queue_names),
            *(self._keys.queue_owner_jobs(name, owner) for name in queue_names)), args=(
            limit, owner, repr(policy.weight), policy.max_queued_jobs, tokens_per_minute, tokens,
            f"{uuid.uuid4().hex}:{tokens}", num_jobs))
        return Admission(check, model, num_jobs, limit, priority.is_background, policy, tokens,
                         self._retry_after_s)
