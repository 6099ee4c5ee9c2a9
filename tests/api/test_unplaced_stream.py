"""Following a job not started yet over two stream shards (two fakeredis servers, each with
its hub): the worker that starts it picks the shard (protocol/stream_shards.py), so the reader
waits on both and stays on the one its stream shows on."""

from __future__ import annotations

import asyncio
import time

import fakeredis
import pytest
import redis.exceptions

from api.job_stream import JobStream, StreamEvent, StreamShard
from api.state_reads import SharedStateReads
from api.stream_hub import StreamHub
from api.stream_outages import RedisRecovery, follow_through_outages
from protocol import FinishReason, JobState, JobStatus, Keys, StreamEntry, stream_ids
from protocol.stream_steps import encode_tokens

pytestmark = pytest.mark.anyio
KEYS = Keys()
JOB = "job-1"
BLOCK_MS = 400


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Fleet:
    """The main Redis and two stream shards, each shard with the API's client and hub."""

    def __init__(self, with_hubs: bool = True) -> None:
        self.main = fakeredis.aioredis.FakeRedis(server=fakeredis.FakeServer(),
                                                 decode_responses=True)
        self.shards = [fakeredis.aioredis.FakeRedis(server=fakeredis.FakeServer(),
                                                    decode_responses=True) for _ in range(2)]
        self.hubs = [StreamHub(fakeredis.aioredis.FakeRedis(
            server=shard.connection_pool.connection_kwargs["server"], decode_responses=True),
            BLOCK_MS, keys=KEYS) if with_hubs else None for shard in self.shards]

    def stream(self) -> JobStream:
        return JobStream(self.main, KEYS, JOB, BLOCK_MS,
                         state_reads=SharedStateReads(self.main, 0.0),
                         unplaced=[StreamShard(shard, hub)
                                   for shard, hub in zip(self.shards, self.hubs)])

    async def queue(self) -> None:
        await self.main.hset(KEYS.state(JOB), mapping=JobState(JOB, JobStatus.QUEUED).to_fields())

    async def follow_queued(self, through_outages: bool = False
                            ) -> tuple[JobStream, asyncio.Task[list[tuple[str, str, int]]]]:
        """The job queued, and a reader following it from before its start (every hub watching
        its stream once there are hubs); `through_outages`: riding outages out, as the routes'
        readers do (api/stream_outages.py)."""
        await self.queue()
        stream = self.stream()
        reader = asyncio.create_task(
            _collect_through_outages(stream) if through_outages else _collect(stream))
        await _until(lambda: all(hub.num_streams == 1 for hub in self.hubs if hub))
        return stream, reader

    async def claim_onto(self, shard: int) -> None:
        """The claim's record: the job started, its stream on `shard`."""
        await self.main.hset(KEYS.state(JOB), mapping={
            "status": "running", "started_at": "1000.0", "stream_shard": str(shard)})

    async def start(self, shard: int, start: int, stop: int) -> None:
        """The claim's record, then tokens start..stop-1 on `shard` with their notification."""
        await self.claim_onto(shard)
        values = []
        for index in range(start, stop):
            await self.shards[shard].xadd(KEYS.stream(JOB), _token(index),
                                          id=stream_ids.token_entry_id(index))
            values += [str(index), str(100 + index), f"t{index}", ""]
        await self.shards[shard].publish(
            KEYS.stream_steps(), "e" + encode_tokens([(KEYS.stream(JOB), values)]))

    async def finish(self, shard: int, num_tokens: int) -> None:
        done = StreamEntry(kind=StreamEntry.DONE, finish_reason=FinishReason.STOP,
                           prompt_tokens=2, completion_tokens=num_tokens)
        await self.shards[shard].xadd(KEYS.stream(JOB), done.to_fields(),
                                      id=stream_ids.done_entry_id(num_tokens))
        await self.main.hset(KEYS.state(JOB), mapping={"status": "finished",
                                                       "finish_reason": "stop"})
        await self.shards[shard].publish(KEYS.stream_steps(), "k" + KEYS.stream(JOB))

    async def close(self) -> None:
        for hub in self.hubs:
            if hub is not None:
                await hub.close()


def _token(index: int) -> dict[str, str | int | float]:
    return StreamEntry(kind=StreamEntry.TOKEN, index=index, token_id=100 + index,
                       text=f"t{index}").to_fields()


async def _collect(stream: JobStream, fresh: bool = True) -> list[tuple[str, str, int]]:
    events: list[tuple[str, str, int]] = []
    async for event in stream.follow(fresh_since=time.monotonic() if fresh else None):
        if isinstance(event, StreamEvent):
            events.append((event.entry_id, event.entry.kind, event.entry.token_id))
    return events


async def _until(condition, timeout_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("shard", [0, 1])
async def test_a_queued_jobs_reader_follows_the_shard_its_stream_shows_on(shard: int) -> None:
    fleet = Fleet()
    try:
        stream, reader = await fleet.follow_queued()
        await asyncio.sleep(0.1)  # past the hubs' first reads of a fresh stream: nothing there
        await fleet.start(shard, 0, 2)
        # Its first entries came from `shard`: the other hub no longer follows the stream.
        await _until(lambda: fleet.hubs[1 - shard].num_streams == 0)  # type: ignore[union-attr]
        assert fleet.hubs[shard].num_streams == 1  # type: ignore[union-attr]
        await fleet.start(shard, 2, 3)
        await fleet.finish(shard, 3)
        assert await asyncio.wait_for(reader, 5) == [
            ("0-1", "token", 100), ("0-2", "token", 101), ("0-3", "token", 102),
            ("0-4", "done", -1)]
        assert [e.entry_id for e in await stream.read_all()] == ["0-1", "0-2", "0-3", "0-4"]
    finally:
        await fleet.close()


async def test_a_started_jobs_state_places_its_reader_before_any_token() -> None:
    fleet = Fleet()
    try:
        _, reader = await fleet.follow_queued()
        # Claimed on shard 1, no token yet: the reader's state check (after a block interval
        # with nothing) places it there.
        await fleet.claim_onto(1)
        await _until(lambda: fleet.hubs[0].num_streams == 0)  # type: ignore[union-attr]
        await fleet.start(1, 0, 1)
        await fleet.finish(1, 1)
        assert await asyncio.wait_for(reader, 5) == [("0-1", "token", 100), ("0-2", "done", -1)]
    finally:
        await fleet.close()


async def test_without_hubs_the_reader_looks_for_the_shard_in_the_state() -> None:
    fleet = Fleet(with_hubs=False)
    _, reader = await fleet.follow_queued()
    await asyncio.sleep(0.1)
    await fleet.start(1, 0, 2)
    await fleet.finish(1, 2)
    assert await asyncio.wait_for(reader, 5) == [
        ("0-1", "token", 100), ("0-2", "token", 101), ("0-3", "done", -1)]


async def test_a_job_canceled_before_any_start_ends_its_reader_canceled() -> None:
    fleet = Fleet()
    try:
        _, reader = await fleet.follow_queued()
        await fleet.main.hset(KEYS.state(JOB), mapping={"status": "canceled",
                                                        "finish_reason": "canceled"})
        assert await asyncio.wait_for(reader, 5) == [("0-1", "done", -1)]
        assert [hub.num_streams for hub in fleet.hubs if hub] == [0, 0]
    finally:
        await fleet.close()


async def test_an_unplaced_stream_has_nothing_to_replay() -> None:
    fleet = Fleet()
    try:
        stream = fleet.stream()
        assert await stream.last_event() is None
        assert await stream.read_all() == []
    finally:
        await fleet.close()


async def test_a_shard_that_fails_before_the_start_is_left_out_of_the_wait() -> None:
    # Shard 0 goes out while the job is queued: the job starts on shard 1, and its reader,
    # which waited on both, follows it there to its end instead of failing with shard 0.
    fleet = Fleet()
    try:
        stream, reader = await fleet.follow_queued()
        assert len(stream.redis_clients()) == 3
        _connected(fleet.shards[0], False)
        await _until(lambda: fleet.hubs[0].num_streams == 0)  # type: ignore[union-attr]
        await _until(lambda: len(stream.redis_clients()) == 2)
        assert stream.redis_clients() == [fleet.main, fleet.shards[1]]  # what an outage waits on
        await fleet.start(1, 0, 2)
        await fleet.finish(1, 2)
        assert await asyncio.wait_for(reader, 5) == [
            ("0-1", "token", 100), ("0-2", "token", 101), ("0-3", "done", -1)]
    finally:
        await fleet.close()


async def _collect_through_outages(stream: JobStream) -> list[tuple[str, str, int]]:
    events: list[tuple[str, str, int]] = []
    async for event in follow_through_outages(stream, 5.0, RedisRecovery(),
                                              fresh_since=time.monotonic(), tick_s=0.1):
        if isinstance(event, StreamEvent):
            events.append((event.entry_id, event.entry.kind, event.entry.token_id))
    return events


def _connected(client, up: bool) -> None:  # type: ignore[no-untyped-def]
    client.connection_pool.connection_kwargs["server"].connected = up


async def test_a_job_placed_on_a_shard_that_failed_is_followed_there_once_it_answers() -> None:
    # Shard 1 fails while the job is queued, and a worker starts it there: the reader fails on
    # it as a placed one would, rides the outage out, and follows it there once shard 1 is back.
    fleet = Fleet()
    try:
        _, reader = await fleet.follow_queued(through_outages=True)
        _connected(fleet.shards[1], False)
        await _until(lambda: fleet.hubs[1].num_streams == 0)  # type: ignore[union-attr]
        await fleet.claim_onto(1)
        await asyncio.sleep(BLOCK_MS / 1000 * 1.5)  # the reader has read the state
        assert not reader.done()
        _connected(fleet.shards[1], True)
        await _until(lambda: fleet.hubs[1].num_streams == 1)  # type: ignore[union-attr]
        await fleet.start(1, 0, 1)
        await fleet.finish(1, 1)
        assert await asyncio.wait_for(reader, 5) == [("0-1", "token", 100), ("0-2", "done", -1)]
        assert fleet.hubs[0].num_streams == 0  # type: ignore[union-attr]
    finally:
        await fleet.close()


async def test_a_job_put_back_unplaced_after_its_shard_failed_is_followed_where_it_starts() -> None:
    # The worker claimed the job onto shard 1 as shard 1 went, and puts it back unplaced (its
    # state as before any start); another worker starts it on shard 0.
    fleet = Fleet()
    try:
        _, reader = await fleet.follow_queued(through_outages=True)
        _connected(fleet.shards[1], False)
        await fleet.claim_onto(1)
        await asyncio.sleep(BLOCK_MS / 1000 * 1.5)
        await fleet.main.hset(KEYS.state(JOB), "status", "queued")
        await fleet.main.hdel(KEYS.state(JOB), "stream_shard", "started_at")
        await asyncio.sleep(0.2)
        await fleet.start(0, 0, 2)
        await fleet.finish(0, 2)
        assert await asyncio.wait_for(reader, 5) == [
            ("0-1", "token", 100), ("0-2", "token", 101), ("0-3", "done", -1)]
    finally:
        await fleet.close()


async def test_with_every_shard_out_the_reader_fails() -> None:
    fleet = Fleet()
    try:
        _, reader = await fleet.follow_queued()
        for shard in fleet.shards:
            _connected(shard, False)
        with pytest.raises(redis.exceptions.ConnectionError):
            await asyncio.wait_for(reader, 5)
    finally:
        await fleet.close()
