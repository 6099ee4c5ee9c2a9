"""SharedStateReads: the readers of one job share a state read in flight or fresh enough."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import fakeredis
import pytest

from api import state_reads
from api.state_reads import SharedStateReads

pytestmark = pytest.mark.anyio


class CountingRedis(fakeredis.FakeAsyncRedis):
    calls = 0

    async def hgetall(self, name):  # type: ignore[no-untyped-def, override]
        CountingRedis.calls += 1
        await asyncio.sleep(0.01)  # in flight while the other readers ask
        return await super().hgetall(name)


async def test_concurrent_and_recent_reads_of_a_key_share_one_hgetall(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The reads' own clock, moved by the test: a loaded machine's pauses must not age them.
    clock = [1000.0]
    monkeypatch.setattr(state_reads, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    CountingRedis.calls = 0
    redis = CountingRedis(decode_responses=True)
    await redis.hset("job:1", mapping={"status": "running"})
    reads = SharedStateReads(redis, max_age_s=0.2)
    results = await asyncio.gather(*(reads.hgetall("job:1") for _ in range(100)))
    assert results == [{"status": "running"}] * 100
    assert CountingRedis.calls == 1
    await redis.hset("job:1", mapping={"status": "finished"})
    assert await reads.hgetall("job:1") == {"status": "running"}  # fresh enough: shared
    assert await reads.hgetall("job:2") == {}
    assert CountingRedis.calls == 2
    clock[0] += 0.25
    assert await reads.hgetall("job:1") == {"status": "finished"}
    assert CountingRedis.calls == 3
