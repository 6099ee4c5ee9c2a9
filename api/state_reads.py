"""One read of a job's state at a time for all the readers of that job in this process.

A reader whose stream brought nothing for a block interval reads the job's state (did it end
without a final entry? did it expire? did rq itself take it off its queue?). With 100
subscribers to a job that is 100 reads a second of the same hash; with 10,000 subscribers,
10,000 requests a second queueing for the API's pool. Readers that ask while a read is in
flight, or within `max_age_s` of the last one, share it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import redis.asyncio as aioredis

from protocol import JobStatus, Keys
from protocol.job_submission import cancel_job_async

# A job's state hash, and its RQ job's status (None: the RQ job is gone).
StateRead = tuple[dict[Any, Any], bytes | None]


async def read_state(redis: aioredis.Redis, state_key: str, rq_job_key: str) -> StateRead:
    """The state and the RQ status in one request (the status: one small field, read with it)."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hgetall(state_key)
        pipe.hget(rq_job_key, "status")
        fields, rq_status = await pipe.execute()
    return dict(fields), rq_status


async def end_if_taken_away_by_rq(redis: aioredis.Redis, keys: Keys, job_id: str,
                                  status: JobStatus, rq_status: bytes | str | None) -> bool:
    """A job waiting for a worker whose RQ job rq itself removed (`rq empty`, Job.delete: gone)
    or canceled (rq's Job.cancel) is one no worker will claim: it is ended canceled here (True)."""
    if status not in (JobStatus.QUEUED, JobStatus.PREEMPTED):
        return False
    if rq_status is not None and (
            rq_status.decode() if isinstance(rq_status, bytes) else rq_status) != "canceled":
        return False
    await cancel_job_async(redis, job_id, keys)
    return True


class SharedStateReads:
    def __init__(self, redis: aioredis.Redis, max_age_s: float) -> None:
        self._redis = redis
        self._max_age_s = max_age_s
        # key -> (the read, when it started); a failed read is not kept
        self._reads: dict[str, tuple[asyncio.Task[StateRead], float]] = {}

    async def read(self, state_key: str, rq_job_key: str) -> StateRead:
        now = time.monotonic()
        cached = self._reads.get(state_key)
        if cached is None or (cached[0].done() and now - cached[1] >= self._max_age_s):
            self._drop_stale(now)
            task = asyncio.ensure_future(self._read(state_key, rq_job_key))
            cached = self._reads[state_key] = (task, now)
        fields, rq_status = await asyncio.shield(cached[0])  # one reader's cancel spares the others'
        return dict(fields), rq_status

    async def _read(self, state_key: str, rq_job_key: str) -> StateRead:
        try:
            return await read_state(self._redis, state_key, rq_job_key)
        except BaseException:
            self._reads.pop(state_key, None)
            raise

    def _drop_stale(self, now: float) -> None:
        if len(self._reads) > 1024:
            for key, (task, started) in list(self._reads.items()):
                if task.done() and now - started >= self._max_age_s:
                    del self._reads[key]
