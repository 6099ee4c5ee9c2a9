"""SharedStateReads: the readers of one job share a state read in flight or fresh enough."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import fakeredis
import pytest

from api import state_reads
from api.state_reads import SharedStateReads

pytestmark = pytest.mark.anyio


async def test_concurrent_and_recent_reads_of_a_key_share_one_request(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The reads' own clock, moved by the test: a loaded machine's pauses must not age them.
    clock = [1000.0]
    monkeypatch.setattr(state_reads, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    requests: list[str] = []
    real_read = state_reads.read_state

    async def counting_read(redis: Any, state_key: str, rq_job_key: str) -> Any:
        requests.append(state_key)
        await asyncio.sleep(0.01)  # in flight while the other readers ask
        return await real_read(redis, state_key, rq_job_key)

    monkeypatch.setattr(state_reads, "read_state", counting_read)
    redis = fakeredis.FakeAsyncRedis(decode_responses=True)
    await redis.hset("job:1", mapping={"status": "running"})
    await redis.hset("rq:job:1", mapping={"status": "started", "data": "x"})
    reads = SharedStateReads(redis, max_age_s=0.2)
    results = await asyncio.gather(*(reads.read("job:1", "rq:job:1") for _ in range(100)))
    assert results == [({"status": "running"}, "started")] * 100
    assert requests == ["job:1"]
    await redis.hset("job:1", mapping={"status": "finished"})
    assert await reads.read("job:1", "rq:job:1") == ({"status": "running"}, "started")  # shared
    assert await reads.read("job:2", "rq:job:2") == ({}, None)  # neither hash: the job is gone
    assert requests == ["job:1", "job:2"]
    clock[0] += 0.25
    assert await reads.read("job:1", "rq:job:1") == ({"status": "finished"}, "started")
    assert requests == ["job:1", "job:2", "job:1"]
