"""QueueAdmission: the queue depth limit, kept under a burst of concurrent submissions."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from api.errors import QueueFullError


class QueueAdmission:
    """Admits a submission only while the queues hold fewer than `max_queue_depth` jobs, counting
    the ones this process is still enqueueing.

    Checked naively (read the depth, then enqueue), a burst reads the same depth everywhere and
    all of it gets in. Serializing check and enqueue under a lock holds, but makes every
    submission wait for all the round trips before it. Here each submission reads the depth
    concurrently and then, with no await in between, adds what that read may have missed:
    enqueues still in flight (reserved) and those that completed after the read began
    (conservatively: they may be in it). So the queue never passes the limit, and at worst a
    submission at the very edge is refused one job early. The count is per process: N API
    processes may overshoot by what the other N - 1 have in flight.
    """

    def __init__(self, max_queue_depth: int, retry_after_s: int,
                 read_depth: Callable[[], Awaitable[int]]) -> None:
        self.max_queue_depth = max_queue_depth
        self._retry_after_s = retry_after_s
        self._read_depth = read_depth
        self._num_reserved = 0  # admitted, enqueue not finished
        self._num_enqueued = 0  # admitted and enqueued, ever

    @asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        """Enqueue inside this block; raises QueueFullError (429) instead when the queue is full."""
        enqueued_before = self._num_enqueued
        depth = await self._read_depth()
        pending = self._num_reserved + self._num_enqueued - enqueued_before
        if depth + pending >= self.max_queue_depth:
            raise QueueFullError(
                f"The job queue is full ({depth + pending} jobs waiting, the limit is "
                f"{self.max_queue_depth}); retry later", self._retry_after_s)
        self._num_reserved += 1
        try:
            yield
            self._num_enqueued += 1
        finally:
            self._num_reserved -= 1
