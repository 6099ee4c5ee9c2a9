"""QueueAdmission: the queue depth limit of each model, exact over every API process."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import cast

import anyio
import redis.asyncio as aioredis

from api.errors import QueueFullError
from protocol import Keys, Priority
from protocol.rq_keys import RQKeys

# An admission whose submission never enqueued (its process died) stops counting after this long:
# far beyond a submission's few Redis round trips and its socket timeout.
ADMISSION_TTL_MS = 60_000

# KEYS: the model's admissions, then its RQ queues. ARGV: max depth, ttl_ms, then one admission
# id per job.
# Returns {1 admitted | 0 refused, depth counted (queued jobs + admissions not enqueued yet)}.
# All the jobs of one request (its n choices) get in together or not at all.
_ADMIT_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local depth = redis.call('ZCARD', KEYS[1])
for i = 2, #KEYS do depth = depth + redis.call('LLEN', KEYS[i]) end
if depth + #ARGV - 2 > tonumber(ARGV[1]) then return {0, depth} end
for i = 3, #ARGV do redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[i]) end
return {1, depth}
"""


class QueueAdmission:
    """Admits a submission only while its model's queues hold fewer than `max_queue_depth` jobs
    (per model: a model whose workers are gone fills its own queues, not the others').
    The background tier (`batch`) has a depth of its own and does not count toward the others':
    batch lines wait their turn in their input file, never crowding interactive requests out.

    Checked naively (read the depth, then enqueue), a burst reads the same depth everywhere and all
    of it gets in, and a per-process count of enqueues in flight cannot see the other API
    processes. Here one script counts the queued jobs plus the admissions not enqueued yet and,
    below the limit, records one more (`Keys.admissions`); the enqueue transaction removes it
    (submit_job's `admission`). Every job counts once, as an admission or queued, in every process,
    so the queues never pass the limit, and no lock is held over the enqueue.
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
    async def admit(self, model: str, num_jobs: int = 1,
                    priority: Priority = Priority.NORMAL) -> AsyncIterator[list[str]]:
        """Enqueue `num_jobs` jobs of `model` inside this block, passing the admission ids it
        gives to submit_jobs; raises QueueFullError (429) instead when they would not all fit."""
        admissions = [uuid.uuid4().hex for _ in range(num_jobs)]
        # The tiers counted: the background one alone, or all the others. (Admissions not
        # enqueued yet count for both: a few jobs for a moment.)
        tiers = [p for p in Priority.ordered() if p.is_background == priority.is_background]
        limit = self.max_background_depth if priority.is_background else self.max_queue_depth
        script_keys = [self._keys.admissions(model),
                       *(RQKeys.queue(self._keys.queue_name(model, p)) for p in tiers)]
        reply = await self._script(keys=script_keys, args=[limit, self._ttl_ms, *admissions])
        is_admitted, depth = (int(value) for value in cast("list[int]", reply))
        if not is_admitted:
            wanted = "" if num_jobs == 1 else f" for {num_jobs} more jobs"
            queue = "batch queue" if priority.is_background else "job queue"
            raise QueueFullError(
                f"The {queue} of model '{model}' is full ({depth} jobs waiting, the limit is "
                f"{limit}){wanted}; retry later", self._retry_after_s)
        try:
            yield admissions
        except BaseException:
            # No enqueue (or none we know of): give the place back now rather than at its expiry.
            # If the enqueue did land, it already removed the admission and this is a no-op.
            with anyio.CancelScope(shield=True):
                try:
                    await self._redis.zrem(self._keys.admissions(model), *admissions)
                except Exception:  # Redis gone: the admission lapses by itself
                    pass
            raise
