"""QueueAdmission: the queue depth limit of each model and each API key's own limits (queued jobs,
tokens per minute), exact over every API process."""

from __future__ import annotations

import math
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import cast

import anyio
import redis.asyncio as aioredis

from api.errors import KeyLimitError, QueueFullError
from api.key_policies import KeyPolicy
from protocol import Keys, Priority
from protocol.rq_keys import RQKeys

# An admission whose submission never enqueued (its process died) stops counting after this long:
# far beyond a submission's few Redis round trips and its socket timeout.
ADMISSION_TTL_MS = 60_000
# The tokens-per-minute window.
MINUTE_MS = 60_000

# KEYS: the model's admissions, the fair-share weights, the owner's token log, then the P RQ
#       queues counted (the background tier alone, or all the others), then the owner's P lists of
#       those queues (Keys.queue_owner_jobs).
# ARGV: max depth, ttl_ms, owner, the owner's weight, its max queued jobs (0: none), its tokens
#       per minute (0: none), the tokens asked, (unused 8, 9), the token log member, then one
#       admission id per job ("<owner>/<random>").
# Returns {1 admitted | 0 queue full | -1 the owner's queued jobs limit | -2 its tokens per
#          minute, depth counted (0) / the owner's jobs waiting (-1) / tokens used this minute (-2),
#          ms until the asked tokens fit (-2)}.
# All the jobs of one request (its n choices) get in together or not at all. Admitted, they count
# toward every limit before they are enqueued (the admissions), so bursts cannot overshoot.
_ADMIT_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local num_jobs = #ARGV - 10
local P = (#KEYS - 3) / 2
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local depth = redis.call('ZCARD', KEYS[1])
for i = 4, 3 + P do depth = depth + redis.call('LLEN', KEYS[i]) end
if depth + num_jobs > tonumber(ARGV[1]) then return {0, depth, 0} end
local owner = ARGV[3]
local max_queued = tonumber(ARGV[5])
if max_queued > 0 then
  -- The owner's admissions not enqueued yet, and its jobs in the queues: the lengths of its
  -- lists in the fair-share index (worker/jobs/fair_share.py), no scan of the queues.
  local prefix = owner .. '/'
  local mine = 0
  for _, admission in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
    if string.sub(admission, 1, #prefix) == prefix then mine = mine + 1 end
  end
  for i = 4 + P, #KEYS do mine = mine + redis.call('LLEN', KEYS[i]) end
  if mine + num_jobs > max_queued then return {-1, mine, 0} end
end
local tpm = tonumber(ARGV[6])
if tpm > 0 then
  local asked = tonumber(ARGV[7])
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - 60000)
  local log = redis.call('ZRANGE', KEYS[3], 0, -1, 'WITHSCORES')
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
  redis.call('ZADD', KEYS[3], now, ARGV[10])
  redis.call('PEXPIRE', KEYS[3], 60000)
end
redis.call('HSET', KEYS[2], owner, ARGV[4])
for i = 11, #ARGV do redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[i]) end
return {1, depth, 0}
"""


class QueueAdmission:
    """Admits a submission only while its model's queues hold fewer than `max_queue_depth` jobs
    (per model: a model whose workers are gone fills its own queues, not the others'), and while
    its API key is within its own limits (`KeyPolicy`): jobs waiting in the model's queues, and
    tokens (prompt + max_tokens) submitted over the last minute (`Keys.owner_token_log`).

    Checked naively (read the depth, then enqueue), a burst reads the same depth everywhere and all
    of it gets in, and a per-process count of enqueues in flight cannot see the other API
    processes. Here one script counts the queued jobs plus the admissions not enqueued yet and,
    below the limits, records one more (`Keys.admissions`); the enqueue transaction removes it
    (submit_job's `admission`). Every job counts once, as an admission or queued, in every process,
    so the queues never pass the limit, and no lock is held over the enqueue. The same script
    writes the key's fair-share weight (`Keys.fair_weights`) for the workers' claims.

    The background tier (`batch`) has a depth of its own and does not count toward the others'
    (nor they toward it), and a key's queued jobs are counted per side the same way: batch lines
    wait their turn in their input file, never crowding interactive requests out. Batch lines do
    not count toward tokens per minute (as with OpenAI, whose batches have a queue limit of their
    own instead): the batch runner submits them as seats allow.
    """

    def __init__(self, redis: aioredis.Redis, keys: Keys, max_queue_depth: int,
                 retry_after_s: int, ttl_ms: int = ADMISSION_TTL_MS,
                 max_background_depth: int | None = None) -> None:
        self.max_queue_depth = max_queue_depth
        self.max_background_depth = max_background_depth or max_queue_depth
        self._redis = redis
        self._keys = keys
        self._retry_after_s = retry_after_s
        self._ttl_ms = ttl_ms
        self._script = redis.register_script(_ADMIT_LUA)

    @asynccontextmanager
    async def admit(self, model: str, num_jobs: int = 1, owner: str = "",
                    policy: KeyPolicy = KeyPolicy(), tokens: int = 0,
                    priority: Priority = Priority.NORMAL) -> AsyncIterator[list[str]]:
        """Enqueue `num_jobs` jobs of `model` for `owner` (asking for `tokens` in all) inside
        this block, passing the admission ids it gives to submit_jobs; raises QueueFullError or
        KeyLimitError (429) instead when they would not all fit."""
        admissions = [f"{owner}/{uuid.uuid4().hex}" for _ in range(num_jobs)]
        token_log_entry = f"{uuid.uuid4().hex}:{tokens}"
        # The tiers counted: the background one alone, or all the others. (Admissions not
        # enqueued yet count for both: a few jobs for a moment.)
        queue_names = [self._keys.queue_name(model, p) for p in Priority.ordered()
                       if p.is_background == priority.is_background]
        limit = self.max_background_depth if priority.is_background else self.max_queue_depth
        tokens_per_minute = 0 if priority.is_background else policy.tokens_per_minute
        script_keys = [self._keys.admissions(model), self._keys.fair_weights(),
                       self._keys.owner_token_log(owner),
                       *(RQKeys.queue(name) for name in queue_names),
                       *(self._keys.queue_owner_jobs(name, owner) for name in queue_names)]
        reply = await self._script(keys=script_keys, args=[
            limit, self._ttl_ms, owner, repr(policy.weight),
            policy.max_queued_jobs, tokens_per_minute, tokens, "", "",
            token_log_entry, *admissions])
        outcome, count, wait_ms = (int(value) for value in cast("list[int]", reply))
        wanted = "" if num_jobs == 1 else f" for {num_jobs} more jobs"
        if outcome == 0:
            queue = "batch queue" if priority.is_background else "job queue"
            raise QueueFullError(
                f"The {queue} of model '{model}' is full ({count} jobs waiting, the limit is "
                f"{limit}){wanted}; retry later", self._retry_after_s)
        if outcome == -1:
            raise KeyLimitError(
                f"This API key has {count} jobs waiting for model '{model}', its limit is "
                f"{policy.max_queued_jobs} (max_queued_jobs_per_key){wanted}; retry once some "
                f"have started", "queued_jobs_per_key_exceeded", self._retry_after_s)
        if outcome == -2:
            retry_after_s = max(1, math.ceil(wait_ms / 1000))
            raise KeyLimitError(
                f"This API key's limit is {policy.tokens_per_minute} tokens per minute "
                f"(tokens_per_minute_per_key: prompt + max_tokens of each job); it submitted "
                f"{count} in the last minute and this request needs {tokens}; retry after "
                f"{retry_after_s} s", "tokens_per_minute_exceeded", retry_after_s)
        try:
            yield admissions
        except BaseException:
            # No enqueue (or none we know of): give the place back now rather than at its expiry.
            # If the enqueue did land, it already removed the admission and this is a no-op.
            with anyio.CancelScope(shield=True):
                try:
                    await self._redis.zrem(self._keys.admissions(model), *admissions)
                    if tokens_per_minute:
                        await self._redis.zrem(self._keys.owner_token_log(owner),
                                               token_log_entry)
                except Exception:  # Redis gone: the admission lapses by itself
                    pass
            raise
