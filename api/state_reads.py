"""One HGETALL of a job's state at a time for all the readers of that job in this process.

A reader whose stream brought nothing for a block interval reads the job's state (did it end
without a final entry? did it expire?). With 100 subscribers to a job that is 100 reads a second of
the same hash; with 10,000 subscribers, 10,000 commands a second queueing for the API's pool.
Readers that ask while a read is in flight, or within `max_age_s` of the last one, share it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import redis.asyncio as aioredis


class SharedStateReads:
    def __init__(self, redis: aioredis.Redis, max_age_s: float) -> None:
        self._redis = redis
        self._max_age_s = max_age_s
        # key -> (the read, when it started); a failed read is not kept
        self._reads: dict[str, tuple[asyncio.Task[dict[Any, Any]], float]] = {}

    async def hgetall(self, key: str) -> dict[Any, Any]:
        now = time.monotonic()
        cached = self._reads.get(key)
        if cached is None or (cached[0].done() and now - cached[1] >= self._max_age_s):
            self._drop_stale(now)
            task = asyncio.ensure_future(self._read(key))
            cached = self._reads[key] = (task, now)
        return dict(await asyncio.shield(cached[0]))  # one reader's cancel spares the others'

    async def _read(self, key: str) -> dict[Any, Any]:
        try:
            return dict(await self._redis.hgetall(key))
        except BaseException:
            self._reads.pop(key, None)
            raise

    def _drop_stale(self, now: float) -> None:
        if len(self._reads) > 1024:
            for key, (task, started) in list(self._reads.items()):
                if task.done() and now - started >= self._max_age_s:
                    del self._reads[key]
