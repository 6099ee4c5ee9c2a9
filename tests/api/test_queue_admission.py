"""QueueAdmission: what a depth read may miss (enqueues in flight or just finished) still counts."""

from __future__ import annotations

import asyncio

import pytest

from api.errors import QueueFullError
from api.queue_admission import QueueAdmission

pytestmark = pytest.mark.anyio


class FakeQueue:
    """A queue depth that reads take `delay_s` to return."""

    def __init__(self, depth: int = 0, delay_s: float = 0.0) -> None:
        self.depth = depth
        self.delay_s = delay_s

    async def read(self) -> int:
        depth = self.depth  # what Redis answered when the command ran
        await asyncio.sleep(self.delay_s)
        return depth


async def test_refuses_at_the_limit_with_retry_after() -> None:
    admission = QueueAdmission(3, 5, FakeQueue(depth=3).read)
    with pytest.raises(QueueFullError) as caught:
        async with admission.admit():
            pass
    assert caught.value.message == ("The job queue is full (3 jobs waiting, the limit is 3); "
                                    "retry later")
    assert caught.value.headers == {"Retry-After": "5"}


async def test_enqueues_in_flight_count() -> None:
    queue = FakeQueue()
    admission = QueueAdmission(2, 1, queue.read)
    release = asyncio.Event()

    async def submit() -> bool:
        try:
            async with admission.admit():
                await release.wait()  # the enqueue is slow; the depth read saw none of these
                queue.depth += 1
        except QueueFullError:
            return False
        return True

    tasks = [asyncio.create_task(submit()) for _ in range(5)]
    await asyncio.sleep(0.01)
    release.set()
    assert sorted(await asyncio.gather(*tasks)) == [False, False, False, True, True]
    assert queue.depth == 2


async def test_an_enqueue_that_finished_during_the_read_counts() -> None:
    queue = FakeQueue(delay_s=0.05)
    admission = QueueAdmission(1, 1, queue.read)

    async def late_reader() -> None:
        await asyncio.sleep(0.01)  # reads depth 0, then the first enqueue finishes meanwhile
        async with admission.admit():
            raise AssertionError("admitted past the limit")

    reader = asyncio.create_task(late_reader())
    async with admission.admit():
        queue.depth += 1
    with pytest.raises(QueueFullError):
        await reader


async def test_a_failed_enqueue_gives_its_place_back() -> None:
    admission = QueueAdmission(1, 1, FakeQueue().read)
    with pytest.raises(ConnectionError):
        async with admission.admit():
            raise ConnectionError("Redis went away")
    async with admission.admit():
        pass
