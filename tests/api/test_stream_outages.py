"""follow_through_outages: a reader failed by Redis resumes after its last event, waits with
keep-alive Nones while Redis stays out, and gives up once the outage lasts the grace; readers
waiting for Redis share one PING at a time (RedisRecovery).

The JobStream and its server here are scripted (each `follow` call replays one script: events,
then an error or the end; the server answers PING or not), so the retry logic is checked exactly
and fast; tests/reliability/test_stream_outage.py runs the same through the real API process and
a restarted redis-server.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from types import SimpleNamespace
from typing import cast

import pytest
import redis.exceptions

from api import stream_outages
from api.job_stream import JobStream, StreamEvent
from api.stream_outages import RedisRecovery, follow_through_outages
from protocol import FinishReason, StreamEntry, stream_ids

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _token(index: int) -> StreamEvent:
    return StreamEvent(stream_ids.token_entry_id(index),
                       StreamEntry(kind=StreamEntry.TOKEN, index=index, token_id=index, text="x"))


def _done(num_tokens: int) -> StreamEvent:
    return StreamEvent(stream_ids.done_entry_id(num_tokens),
                       StreamEntry(kind=StreamEntry.DONE, finish_reason=FinishReason.STOP))


DOWN = redis.exceptions.ConnectionError("Error 111 connecting to 127.0.0.1:6379.")


class ScriptedServer:
    """A Redis client's PING: answered while `up`, refused (after a moment) while not; counted,
    and the most in flight at once."""

    connection_pool = SimpleNamespace(connection_kwargs={"host": "scripted", "port": 6379})

    def __init__(self, up: bool = True) -> None:
        self.up = up
        self.pings = 0
        self.in_flight = 0
        self.most_in_flight = 0

    async def ping(self) -> bool:
        self.pings += 1
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0.001)
            if not self.up:
                raise DOWN
            return True
        finally:
            self.in_flight -= 1


class ScriptedStream:
    """One script per `follow` call: what it yields (a float: seconds it takes first, as a
    connection attempt may), then the error it raises (None: it ends). Records each call's
    (after_id, fresh_since)."""

    job_id = "job-1"

    def __init__(self, scripts: list[tuple[list[StreamEvent | None | float], Exception | None]],
                 server: ScriptedServer | None = None) -> None:
        self.scripts = scripts
        self.calls: list[tuple[str, float | None]] = []
        self.server = server or ScriptedServer()

    def redis_clients(self) -> list[ScriptedServer]:
        return [self.server]

    async def follow(self, after_id: str, fresh_since: float | None = None,
                     ) -> AsyncGenerator[StreamEvent | None, None]:
        self.calls.append((after_id, fresh_since))
        events, error = self.scripts[len(self.calls) - 1]
        for event in events:
            if isinstance(event, float):
                await asyncio.sleep(event)
            else:
                yield event
        if error is not None:
            raise error


async def _collect(stream: ScriptedStream, grace_s: float, fresh_since: float | None = None,
                   recovery: RedisRecovery | None = None) -> list[str | None]:
    items = []
    async for event in follow_through_outages(cast(JobStream, stream), grace_s,
                                              recovery or RedisRecovery(),
                                              fresh_since=fresh_since):
        items.append(event.entry_id if event is not None else None)
    return items


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stream_outages, "_FIRST_RETRY_S", 0.01)
    monkeypatch.setattr(stream_outages, "_MAX_RETRY_S", 0.02)


async def test_a_reader_failed_mid_stream_resumes_after_its_last_event() -> None:
    stream = ScriptedStream([
        ([_token(0), _token(1)], DOWN),  # Redis lost after two tokens
        ([], DOWN),  # still down at the first retry
        ([_token(2), _done(3)], None),
    ])
    items = await _collect(stream, grace_s=5, fresh_since=12.5)
    # Each wait yields a None (the route's keep-alive), then the stream goes on, each event once.
    assert items == ["0-1", "0-2", None, None, "0-3", "0-4"]
    # Resumed after the last event handed out; no longer taken as fresh.
    assert stream.calls == [("0-0", 12.5), ("0-2", None), ("0-2", None)]


async def test_the_grace_restarts_once_redis_answered() -> None:
    # Two outages of about 0.3 s each, under the grace of 0.8, with a served wait (a None) between
    # them: counted from the first failure, the last try (at about 0.9 s) would end it.
    stream = ScriptedStream([
        ([_token(0)], DOWN), ([0.3], DOWN), ([None, 0.3], DOWN), ([0.3], DOWN),
        ([_done(1)], None),
    ])
    assert await _collect(stream, grace_s=0.8) == ["0-1", None, None, None, None, None, "0-2"]
    assert [after for after, _ in stream.calls] == ["0-0", "0-1", "0-1", "0-1", "0-1"]


async def test_an_outage_past_the_grace_raises_its_last_error() -> None:
    stream = ScriptedStream([([_token(0)], DOWN)] + [([], DOWN)] * 1000)
    started = time.monotonic()
    with pytest.raises(redis.exceptions.ConnectionError):
        await _collect(stream, grace_s=0.2)
    assert 0.2 <= time.monotonic() - started < 2
    assert all(after == "0-1" for after, _ in stream.calls[1:])


async def test_no_grace_raises_at_the_first_failure() -> None:
    stream = ScriptedStream([([_token(0)], redis.exceptions.TimeoutError("Timeout reading"))])
    with pytest.raises(redis.exceptions.TimeoutError):
        await _collect(stream, grace_s=0)
    assert len(stream.calls) == 1


async def test_other_errors_are_not_retried() -> None:
    stream = ScriptedStream([([], ValueError("not Redis"))])
    with pytest.raises(ValueError, match="not Redis"):
        await _collect(stream, grace_s=5)
    assert len(stream.calls) == 1


async def test_a_reader_closed_during_a_wait_stops_retrying() -> None:
    stream = ScriptedStream([([_token(0)], DOWN)] + [([], DOWN)] * 1000)
    reader = follow_through_outages(cast(JobStream, stream), 5, RedisRecovery())
    assert (await anext(reader)).entry_id == "0-1"  # type: ignore[union-attr]
    assert await anext(reader) is None  # waiting for Redis
    await reader.aclose()  # the client left
    calls = len(stream.calls)
    await asyncio.sleep(0.1)
    assert len(stream.calls) == calls


async def test_readers_waiting_for_redis_share_one_ping_at_a_time(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="api.stream_outages")
    server = ScriptedServer(up=False)
    streams = [ScriptedStream([([_token(0)], DOWN), ([_token(1), _done(2)], None)], server)
               for _ in range(200)]
    recovery = RedisRecovery()
    readers = [asyncio.create_task(_collect(stream, grace_s=10, recovery=recovery))
               for stream in streams]
    # Redis out: every reader has failed and waits. (Until the probe has pinged a few times,
    # however long a loaded machine takes: CI once saw no PING within a fixed 0.5 s.)
    deadline = time.monotonic() + 20
    while server.pings < 3:
        assert time.monotonic() < deadline, "no probe pinged"
        await asyncio.sleep(0.01)
    assert all(len(stream.calls) == 1 for stream in streams)
    # One probe, one PING at a time (backing off: 10-20 ms apart here), not 200 readers each.
    assert server.most_in_flight == 1
    assert 1 <= server.pings < len(streams), server.pings
    server.up = True
    results = await asyncio.wait_for(asyncio.gather(*readers), 10)
    assert all(items[0] == "0-1" and items[-2:] == ["0-2", "0-3"] for items in results)
    assert all(stream.calls[1][0] == "0-1" for stream in streams)  # each resumed after its token
    # One line when the outage began and one when it ended, not one per reader.
    assert [record.getMessage() for record in caplog.records
            if record.name == "api.stream_outages"] == [
        "Redis at scripted:6379 unreachable under open streams: they wait for it to answer "
        "(CARPOOL_STREAM_OUTAGE_S)",
        "Redis at scripted:6379 answers again: 200 open streams resume"]


async def test_a_redis_that_never_answers_ends_the_reader_at_the_grace() -> None:
    server = ScriptedServer(up=False)
    stream = ScriptedStream([([_token(0)], DOWN)], server)
    started = time.monotonic()
    with pytest.raises(redis.exceptions.ConnectionError):
        await _collect(stream, grace_s=0.3)
    assert 0.3 <= time.monotonic() - started < 2
    assert len(stream.calls) == 1  # never tried again: Redis never answered
    await asyncio.sleep(0.05)  # (the reader's cancel reaches the probe at the loop's next turn)
    pings = server.pings
    await asyncio.sleep(0.3)
    assert server.pings == pings  # the probe stopped with its last waiter
