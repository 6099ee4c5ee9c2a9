"""StreamHub: one XREAD per API process for all its subscribers, on a real redis-server.

The SSE tests here run the app under uvicorn on a free port and read it with httpx over TCP, so
that each stream is live while the next subscriber joins, and count the API's Redis connections
with CLIENT LIST.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator

import httpx
import openai
import pytest
import redis
import redis.asyncio as aioredis
import uvicorn
from api_support import MODEL, word_tokenizer

from api import stream_hub
from api.app import create_app
from api.job_service import JobService
from api.settings import ApiSettings
from api.stream_hub import StreamHub, Subscription
from protocol import (
    FinishReason,
    JobSpec,
    JobState,
    Keys,
    ModelCard,
    SamplingParams,
    StreamEntry,
    stream_ids,
    submit_job,
)
from protocol.stream_steps import encode_tokens, notify_steps
from protocol.token_runs import run_entry_id, run_fields

pytestmark = pytest.mark.anyio
KEYS = Keys()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def sync(redis_url: str) -> Iterator[redis.Redis]:
    """A plain client on the test's Redis: the tests write through it as a worker would."""
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def _token(index: int) -> dict[str, str | int | float]:
    return StreamEntry(kind=StreamEntry.TOKEN, index=index, token_id=100 + index,
                       text=f"t{index}").to_fields()


def _publish(sync: redis.Redis, job_id: str, start: int, stop: int, notify: bool = True) -> None:
    """Tokens start..stop-1 as one worker step writes them: the entries, then (in the same
    transaction) the step notification naming the job."""
    pipe = sync.pipeline(transaction=True)
    for index in range(start, stop):
        pipe.xadd(KEYS.stream(job_id), _token(index), id=stream_ids.token_entry_id(index))
    if notify:
        notify_steps(pipe, KEYS, [job_id])
    pipe.execute()


def _publish_step(sync: redis.Redis, job_id: str, start: int, stop: int) -> None:
    """Tokens start..stop-1 as the append script writes them: the entries, then the notification
    carrying them."""
    _publish(sync, job_id, start, stop, notify=False)
    _notify_live(sync, job_id, start, stop)


def _notify_live(sync: redis.Redis, job_id: str, start: int, stop: int) -> None:
    """Tokens start..stop-1 in a step notification only (as live tokens are, protocol/
    stream_steps.py, "Live tokens", until the stream gets them)."""
    values = [str(v) for i in range(start, stop) for v in (i, 100 + i, f"t{i}", "")]
    sync.publish(KEYS.stream_steps(), "e" + encode_tokens([(KEYS.stream(job_id), values)]))


def _publish_done(sync: redis.Redis, job_id: str, num_tokens: int) -> None:
    entry = StreamEntry(kind=StreamEntry.DONE, finish_reason=FinishReason.STOP, prompt_tokens=2,
                        completion_tokens=num_tokens)
    pipe = sync.pipeline(transaction=True)
    pipe.xadd(KEYS.stream(job_id), entry.to_fields(), id=stream_ids.done_entry_id(num_tokens))
    pipe.hset(KEYS.state(job_id), mapping={"status": "finished", "finish_reason": "stop",
                                           "completion_tokens": num_tokens})
    notify_steps(pipe, KEYS, [job_id])
    pipe.execute()


def _register_model(sync: redis.Redis) -> None:
    card = ModelCard(name=MODEL, max_model_len=32, eos_token="<|im_end|>", created_at=1.0)
    sync.hset(KEYS.models(), MODEL, card.to_json())
    sync.set(KEYS.model_tokenizer(MODEL), word_tokenizer().to_str())


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _serve(settings: ApiSettings) -> AsyncIterator[str]:
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1",
                                           port=settings.port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{settings.port}"
    finally:
        server.should_exit = True
        await task


_STREAM_DEADLINE_S = 30
# A fresh-read delay that tells "read at once" from "read after the delay" however loaded the
# machine (the hub's 50 ms is less than a busy test process' start of the hub can take).
_UNMISTAKABLE_DELAY_S = 2.0


class Reader:
    """One SSE subscriber: its events as (id, event, text) until the stream ends."""

    def __init__(self, client: httpx.AsyncClient, job_id: str, last_event_id: str | None = None):
        self.events: list[tuple[str, str, str | None]] = []
        self.arrived = asyncio.Event()
        headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
        self.task = asyncio.create_task(self._read(client, job_id, headers))

    async def _read(self, client: httpx.AsyncClient, job_id: str, headers: dict[str, str]) -> None:
        async with client.stream("GET", f"/v1/jobs/{job_id}/stream", headers=headers) as response:
            assert response.status_code == 200
            event: dict[str, str] = {}
            async for line in response.aiter_lines():
                if line.startswith(":"):
                    continue
                if line:
                    name, _, value = line.partition(": ")
                    event[name] = value
                    continue
                self.events.append((event["id"], event["event"],
                                    json.loads(event["data"]).get("text")))
                self.arrived.set()
                event = {}

    async def wait_for(self, num_events: int) -> None:
        while len(self.events) < num_events:
            self.arrived.clear()
            await asyncio.wait_for(self.arrived.wait(), 5)


async def _all_ended(readers: list[Reader]) -> None:
    """Every reader's stream ended, within a deadline: a hub that stopped delivering (or a Redis
    that went away) fails the test instead of hanging the suite on keep-alive comments."""
    await asyncio.wait_for(asyncio.gather(*(reader.task for reader in readers)), _STREAM_DEADLINE_S)


def _expected(num_tokens: int, after: int = 0) -> list[tuple[str, str, str | None]]:
    tokens = [(stream_ids.token_entry_id(i), "token", f"t{i}") for i in range(after, num_tokens)]
    return [*tokens, (stream_ids.done_entry_id(num_tokens), "done", None)]


def _num_clients(sync: redis.Redis) -> int:
    return len(sync.client_list())


@pytest.mark.parametrize("stream_hub", [True, False])
async def test_many_subscribers_share_a_bounded_number_of_connections(
        redis_url: str, sync: redis.Redis, stream_hub: bool) -> None:
    num_jobs, readers_per_job = 12, 3
    _register_model(sync)
    # No batch runner: its tick (every second) would borrow a pooled connection of its own
    # whenever it met a request, which a slow machine makes likely; this counts the SSE path's.
    settings = ApiSettings(redis_url=redis_url, port=_free_port(), stream_hub=stream_hub,
                           stream_block_ms=5000, sse_keepalive_s=60, batch_runner=False)
    baseline = _num_clients(sync)
    async for base_url in _serve(settings):
        async with httpx.AsyncClient(base_url=base_url, timeout=10) as client:
            job_ids = []
            for _ in range(num_jobs):
                response = await client.post("/v1/jobs", json={"prompt": "hello world"})
                assert response.status_code == 202
                job_ids.append(response.json()["job_id"])
            readers: list[tuple[str, Reader]] = []
            # One at a time, each live (it got token 0) before the next joins.
            for job_id in job_ids:
                for number in range(readers_per_job):
                    if number == 0:
                        _publish(sync, job_id, 0, 1)
                    reader = Reader(client, job_id)
                    await reader.wait_for(1)
                    readers.append((job_id, reader))
            api_connections = _num_clients(sync) - baseline
            for job_id in job_ids:
                _publish(sync, job_id, 1, 5)
                _publish_done(sync, job_id, 5)
            await _all_ended([reader for _, reader in readers])
    for _, reader in readers:
        assert reader.events == _expected(5)
    if stream_hub:
        # The pool's one (requests came one at a time), the hub's two (its subscription to the
        # step notifications, its reads of the streams), RQ's sync client.
        assert api_connections == 4
    else:
        # One blocked XREAD each, give or take the few readers between two reads at the count
        # (their connection back in the pool for a moment): it grows with the subscribers.
        assert api_connections >= num_jobs * readers_per_job - readers_per_job


async def _served_job(redis_url: str, sync: redis.Redis
                      ) -> AsyncIterator[tuple[httpx.AsyncClient, str]]:
    """The app served (5 s block interval), a client of it and a job submitted through it."""
    _register_model(sync)
    settings = ApiSettings(redis_url=redis_url, port=_free_port(), stream_block_ms=5000)
    async for base_url in _serve(settings):
        async with httpx.AsyncClient(base_url=base_url, timeout=10) as client:
            job_id = (await client.post("/v1/jobs", json={"prompt": "hello"})).json()["job_id"]
            yield client, job_id


async def test_resume_joins_a_watched_stream_without_gap_or_duplicate(
        redis_url: str, sync: redis.Redis) -> None:
    async for client, job_id in _served_job(redis_url, sync):
        first = Reader(client, job_id)
        _publish(sync, job_id, 0, 6)
        await first.wait_for(6)  # the hub's cursor for this stream is now 0-6
        resumed = Reader(client, job_id, last_event_id="0-2")
        await resumed.wait_for(4)  # 0-3..0-6: behind the hub, read by the resumer itself
        _publish(sync, job_id, 6, 8)
        _publish_done(sync, job_id, 8)
        await _all_ended([first, resumed])
    assert first.events == _expected(8)
    assert resumed.events == _expected(8, after=2)


def _hub(url: str, block_ms: int, max_pending: int = 4096,
         min_interval_ms: float = 0.0) -> tuple[StreamHub, aioredis.Redis]:
    control = aioredis.Redis.from_url(url, decode_responses=True)
    reader = aioredis.Redis(connection_pool=control.connection_pool, single_connection_client=True)
    return StreamHub(reader, block_ms, max_pending=max_pending,
                     min_interval_ms=min_interval_ms), control


OpenHub = Callable[..., StreamHub]


@pytest.fixture
async def open_hub(redis_url: str) -> AsyncIterator[OpenHub]:
    """Opens hubs as _hub does (its arguments but the URL) and closes each, and its control
    client, after the test, whether the test passed or not."""
    opened: list[tuple[StreamHub, aioredis.Redis]] = []

    def open_(block_ms: int, max_pending: int = 4096, min_interval_ms: float = 0.0) -> StreamHub:
        hub, control = _hub(redis_url, block_ms, max_pending, min_interval_ms)
        opened.append((hub, control))
        return hub

    yield open_
    for hub, control in opened:
        await hub.close()
        await control.aclose()


async def _ids(subscription: Subscription) -> list[str]:
    return [entry_id for entry_id, _ in await subscription.next(5.0)]


async def test_a_new_stream_is_read_without_waiting_for_the_block_to_end(
        open_hub: OpenHub, sync: redis.Redis) -> None:
    hub = open_hub(block_ms=10_000)
    first = await hub.subscribe(KEYS.stream("a"), "0-0")
    await asyncio.sleep(0.1)  # the hub is blocked on stream a alone
    second = await hub.subscribe(KEYS.stream("b"), "0-0")
    started = time.monotonic()
    _publish(sync, "b", 0, 2)
    assert await _ids(second) == ["0-1", "0-2"]
    assert time.monotonic() - started < 2.0  # far less than the 10 s block
    assert hub.num_streams == 2
    hub.unsubscribe(first)
    hub.unsubscribe(second)
    assert hub.num_streams == 0


async def test_notifications_come_by_pub_sub_and_a_new_stream_costs_one_read(
        open_hub: OpenHub, sync: redis.Redis) -> None:
    """[redis-cost] The hub sends Redis no request per step (the notifications are pushed to its
    subscribed connection) and none to be woken for a newly watched stream: it reads that stream
    once, between two waits of _WAIT_SLICE_S, well before its block interval ends."""
    hub = open_hub(block_ms=10_000)
    read = _record_reads(hub)
    busy = await hub.subscribe(KEYS.stream("busy"), "0-0")
    await _first_reads_done(read)  # the hub waits for notifications now
    sync.config_resetstat()
    for index in range(4):
        _publish_step(sync, "busy", index, index + 1)
        await asyncio.sleep(0.01)
    received: list[str] = []
    while len(received) < 4:
        received += await _ids(busy)
    assert received == ["0-1", "0-2", "0-3", "0-4"]
    assert read == []  # four steps delivered, no read
    _publish(sync, "b", 0, 2, notify=False)  # written before anyone here watched it
    started = time.monotonic()
    joined = await hub.subscribe(KEYS.stream("b"), "0-0")
    assert await _ids(joined) == ["0-1", "0-2"]
    assert time.monotonic() - started < 1.0  # far less than the 10 s block
    assert read == [[KEYS.stream("b")]]
    assert "cmdstat_client|unblock" not in sync.info("commandstats")


async def test_a_subscriber_behind_the_hub_catches_up_then_follows(
        open_hub: OpenHub, sync: redis.Redis) -> None:
    hub = open_hub(block_ms=100)
    key = KEYS.stream("a")
    leader = await hub.subscribe(key, "0-0")
    _publish(sync, "a", 0, 3)
    assert await _ids(leader) == ["0-1", "0-2", "0-3"]
    late = await hub.subscribe(key, "0-1")
    assert late.take_catch_up() == "0-3"  # 0-2..0-3 are the late one's to read
    _publish(sync, "a", 3, 4)
    assert await _ids(late) == ["0-4"]
    assert await _ids(leader) == ["0-4"]


async def test_a_subscriber_too_far_behind_drops_its_backlog_and_rereads(
        open_hub: OpenHub, sync: redis.Redis) -> None:
    hub = open_hub(block_ms=100, max_pending=2)
    subscription = await hub.subscribe(KEYS.stream("a"), "0-0")
    await asyncio.sleep(0.05)
    _publish(sync, "a", 0, 5)
    deadline = time.monotonic() + 5
    while subscription.catch_up_to is None and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    # 0-3 overflowed two pending entries: all three went (Redis holds them), the rest came after.
    assert subscription.take_catch_up() == "0-3"
    assert await _ids(subscription) == ["0-4", "0-5"]


async def test_redis_lost_fails_every_subscriber(redis_url: str) -> None:
    control = aioredis.Redis.from_url(redis_url, decode_responses=True)
    reader = aioredis.Redis.from_url(redis_url, decode_responses=True)
    hub = StreamHub(reader, block_ms=5000)
    subscriptions = [await hub.subscribe(KEYS.stream(name), "0-0") for name in ("a", "b")]
    await asyncio.sleep(0.1)
    await control.client_kill_filter(_type="normal", skipme=True)
    await control.client_kill_filter(_type="pubsub", skipme=True)
    for subscription in subscriptions:
        with pytest.raises(redis.exceptions.ConnectionError):
            await subscription.next(5.0)
    assert hub.num_streams == 0
    await hub.close()
    await control.aclose()


@pytest.mark.parametrize(("min_interval_ms", "num_turns"), [(0, 5), (1000, 2)])
async def test_a_least_interval_gathers_several_steps_in_one_turn(
        open_hub: OpenHub, sync: redis.Redis, min_interval_ms: float, num_turns: int) -> None:
    hub = open_hub(block_ms=5000, min_interval_ms=min_interval_ms)
    subscription = await hub.subscribe(KEYS.stream("a"), "0-0")
    await asyncio.sleep(0.1)
    delivered_at: list[float] = []  # one time per notification's delivery
    deliver = hub._deliver_notified

    def timed_deliver(key: str, entries: list) -> None:
        delivered_at.append(time.monotonic())
        deliver(key, entries)

    hub._deliver_notified = timed_deliver  # type: ignore[method-assign]
    seen: list[str] = []
    for index in range(5):  # five worker steps, 40 ms apart, their tokens in their notifications
        _publish_step(sync, "a", index, index + 1)
        await asyncio.sleep(0.04)
    while len(seen) < 5:
        seen += await _ids(subscription)
    assert seen == ["0-1", "0-2", "0-3", "0-4", "0-5"]
    # Without an interval, a turn for each step; with it, the first step's turn, then one for
    # the other four (the hub waits out the interval). A turn delivers within a millisecond.
    turns = [at for number, at in enumerate(delivered_at)
             if number == 0 or at - delivered_at[number - 1] > 0.01]
    assert len(turns) == num_turns


async def test_a_closed_hub_refuses_new_subscribers(redis_url: str) -> None:
    hub, control = _hub(redis_url, block_ms=100)
    await hub.close()
    with pytest.raises(redis.exceptions.ConnectionError, match="the stream hub is closed"):
        await hub.subscribe(KEYS.stream("a"), "0-0")
    assert hub.num_streams == 0
    await control.aclose()


async def _first_reads_done(read: list[list[str]]) -> None:
    """Once the hub has read its new streams (`read` recorded since before they were
    subscribed) and read nothing more for a while: forget those reads. A fixed sleep was not
    always enough on a loaded machine, and a first read counted later failed a test."""
    deadline = time.monotonic() + 5.0
    while not read and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert read, "the hub never read its new streams"
    seen = -1
    while len(read) != seen:
        seen = len(read)
        await asyncio.sleep(0.1)
    read.clear()


def _record_reads(hub: StreamHub) -> list[list[str]]:
    """From now on, the keys of each XREAD the hub's reader sends (to the real Redis)."""
    read: list[list[str]] = []
    xread = hub._reader.xread

    async def recording_xread(streams: dict[str, str], **kwargs: object) -> object:
        read.append(sorted(streams))
        return await xread(streams, **kwargs)  # type: ignore[arg-type]

    hub._reader.xread = recording_xread  # type: ignore[method-assign]
    return read


async def test_a_step_reads_only_the_streams_its_notification_names(
        open_hub: OpenHub, sync: redis.Redis) -> None:
    hub = open_hub(block_ms=10_000)
    read = _record_reads(hub)
    subscriptions = {job_id: await hub.subscribe(KEYS.stream(job_id), "0-0")
                     for job_id in ("a", "b", "c", "d")}
    await _first_reads_done(read)  # the hub waits for notifications now
    _publish(sync, "b", 0, 2)
    assert await _ids(subscriptions["b"]) == ["0-1", "0-2"]
    _publish(sync, "other-process-job", 0, 1)  # a stream nobody here follows: no read
    _publish(sync, "d", 0, 1)
    assert await _ids(subscriptions["d"]) == ["0-1"]
    await asyncio.sleep(0.05)
    # Only the stream each notification names (the notifications come by Pub/Sub).
    assert read == [[KEYS.stream("b")], [KEYS.stream("d")]]
    assert not subscriptions["a"]._pending and not subscriptions["c"]._pending


async def test_an_entry_no_notification_announced_comes_with_the_next_full_read(
        open_hub: OpenHub, sync: redis.Redis) -> None:
    hub = open_hub(block_ms=300)
    subscription = await hub.subscribe(KEYS.stream("a"), "0-0")
    await asyncio.sleep(0.1)
    started = time.monotonic()
    _publish(sync, "a", 0, 2, notify=False)  # a writer that sends no notification
    assert await _ids(subscription) == ["0-1", "0-2"]
    assert time.monotonic() - started < 1.0  # within a block interval, not at a timeout of 5 s
    _publish(sync, "a", 2, 3)
    assert await _ids(subscription) == ["0-3"]


async def test_tokens_a_notification_carries_are_handed_out_without_reading_the_stream(
        open_hub: OpenHub, sync: redis.Redis) -> None:
    hub = open_hub(block_ms=10_000)
    read = _record_reads(hub)
    subscription = await hub.subscribe(KEYS.stream("a"), "0-0")
    await _first_reads_done(read)

    _publish_step(sync, "a", 0, 2)
    assert [(i, f) for i, f in await subscription.next(5.0)] == [
        ("0-1", {"kind": "token", "index": "0", "token_id": "100", "text": "t0"}),
        ("0-2", {"kind": "token", "index": "1", "token_id": "101", "text": "t1"})]
    assert KEYS.stream("a") not in sum(read, [])
    # A gap (token 2 written without a notification): the stream is read from the hub's cursor.
    _publish(sync, "a", 2, 3, notify=False)
    _publish_step(sync, "a", 3, 4)
    assert await _ids(subscription) == ["0-3", "0-4"]
    assert [KEYS.stream("a")] in read


def _write_run(sync: redis.Redis, job_id: str, start: int, stop: int) -> None:
    """Live tokens start..stop-1 into the stream once due: one run entry, no notification."""
    sync.xadd(KEYS.stream(job_id), run_fields(start, [100 + i for i in range(start, stop)],
                                              [f"t{i}" for i in range(start, stop)]),
              id=run_entry_id(start, stop - start))


async def test_a_resume_behind_live_tokens_waits_for_the_stream_without_gap_or_duplicate(
        redis_url: str, sync: redis.Redis) -> None:
    async for client, job_id in _served_job(redis_url, sync):
        first = Reader(client, job_id)
        await asyncio.sleep(0.2)  # the hub follows the stream
        _publish_step(sync, job_id, 0, 3)
        _notify_live(sync, job_id, 3, 4)
        _notify_live(sync, job_id, 4, 6)
        await first.wait_for(6)  # the hub's cursor is 0-6; the stream holds up to 0-3
        resumed = Reader(client, job_id, last_event_id="0-1")
        await resumed.wait_for(2)  # 0-2, 0-3 from the stream; 0-4.. not there yet
        await asyncio.sleep(0.3)
        assert len(resumed.events) == 2  # it waits for the stream, not for the hub's next
        _notify_live(sync, job_id, 6, 7)
        _write_run(sync, job_id, 3, 7)  # the live tokens' run, at 0-7
        _publish_step(sync, job_id, 7, 8)
        _publish_done(sync, job_id, 8)
        await _all_ended([first, resumed])
    assert first.events == _expected(8)
    assert resumed.events == _expected(8, after=1)


async def _collect(subscription: Subscription, count: int,
                   within_s: float = 2.0) -> list[tuple[str, dict[str, str]]]:
    """The subscription's entries until `count` came or `within_s` passed."""
    received: list[tuple[str, dict[str, str]]] = []
    deadline = time.monotonic() + within_s
    while len(received) < count and time.monotonic() < deadline:
        received += await subscription.next(0.5)
    return received


def _publish_final(sync: redis.Redis, job_id: str, num_tokens: int) -> None:
    """The final entry as the worker's finish script writes it: into the stream, then whole in
    its notification (`f`, protocol/stream_steps.py)."""
    entry_id = stream_ids.done_entry_id(num_tokens)
    fields = {"kind": "done", "finish_reason": "stop", "prompt_tokens": "2",
              "completion_tokens": str(num_tokens), "error": "", "cached_tokens": "0"}
    sync.xadd(KEYS.stream(job_id), fields, id=entry_id)  # type: ignore[arg-type]
    flat = [part for pair in fields.items() for part in pair]
    sync.publish(KEYS.stream_steps(), "f" + json.dumps([KEYS.stream(job_id), entry_id, *flat]))


async def test_a_final_entry_a_notification_carries_ends_the_stream_without_a_read(
        open_hub: OpenHub, sync: redis.Redis) -> None:
    """[redis-cost] A job's end costs the hub no XREAD: the finish script's notification holds
    the entry. One that does not follow the hub's cursor (a gap) has the stream read instead."""
    hub = open_hub(block_ms=10_000)
    read = _record_reads(hub)
    ended = await hub.subscribe(KEYS.stream("a"), "0-0")
    gapped = await hub.subscribe(KEYS.stream("b"), "0-0")
    await _first_reads_done(read)
    _publish_step(sync, "a", 0, 2)
    _publish_final(sync, "a", 2)
    received = await _collect(ended, 3)  # a hub that needs a read for the end waits 10 s
    assert received[2] == ("0-3", {"kind": "done", "finish_reason": "stop", "prompt_tokens": "2",
                                   "completion_tokens": "2", "error": "", "cached_tokens": "0"})
    assert [entry_id for entry_id, _ in received] == ["0-1", "0-2", "0-3"]
    assert read == []
    _publish(sync, "b", 0, 1, notify=False)  # a token no notification announced
    _publish_final(sync, "b", 1)
    assert await _ids(gapped) == ["0-1", "0-2"]
    assert read == [[KEYS.stream("b")]]


async def test_a_fresh_stream_is_read_only_when_its_notifications_cannot_show_it_complete(
        open_hub: OpenHub, sync: redis.Redis) -> None:
    """[redis-cost] A stream whose job had nothing generated when its subscriber saw it
    (`fresh_since`) costs the hub no first read when its first notification follows the
    subscriber's position, or when the hub heard its entries from the first on just before. A
    gap has it read at once; seen fresh before the hub listened and with no notification, it is
    read after _FRESH_READ_DELAY_S, far less than the block interval."""
    before_listening = time.monotonic()
    hub = open_hub(block_ms=10_000)
    read = _record_reads(hub)
    listening = await hub.subscribe(KEYS.stream("busy"), "0-0")
    await _first_reads_done(read)  # the hub listens to the notifications now

    fresh = await hub.subscribe(KEYS.stream("a"), "0-0", fresh_since=time.monotonic())
    _publish_step(sync, "a", 0, 2)
    _publish_final(sync, "a", 2)
    assert [entry_id for entry_id, _ in await _collect(fresh, 3)] == ["0-1", "0-2", "0-3"]
    await asyncio.sleep(stream_hub._FRESH_READ_DELAY_S + 0.1)
    assert read == []  # neither a first read nor one after the notifications

    seen_b = time.monotonic()
    _publish(sync, "b", 0, 2, notify=False)  # its first tokens: no notification heard
    gapped = await hub.subscribe(KEYS.stream("b"), "0-0", fresh_since=seen_b)
    _publish_step(sync, "b", 2, 3)
    assert await _ids(gapped) == ["0-1", "0-2", "0-3"]
    assert read == [[KEYS.stream("b")]]

    # c ran whole before anyone here followed it (its first token raced the subscription): the
    # hub kept its notified entries from the first on, so they come at once, with no read.
    seen_c = time.monotonic()
    _publish_step(sync, "c", 0, 1)
    _publish_final(sync, "c", 1)
    await asyncio.sleep(0.1)
    raced = await hub.subscribe(KEYS.stream("c"), "0-0", fresh_since=seen_c)
    assert await _ids(raced) == ["0-1", "0-2"]
    assert read == [[KEYS.stream("b")]]

    # d, seen fresh before the hub listened, was written with no notification: read once
    # _FRESH_READ_DELAY_S passed.
    _publish(sync, "d", 0, 1, notify=False)
    started = time.monotonic()
    unheard = await hub.subscribe(KEYS.stream("d"), "0-0", fresh_since=before_listening)
    assert await _ids(unheard) == ["0-1"]
    assert stream_hub._FRESH_READ_DELAY_S - 0.01 <= time.monotonic() - started < 1.0
    assert read == [[KEYS.stream("b")], [KEYS.stream("d")]]
    assert listening.key == KEYS.stream("busy")


async def test_a_stream_seen_fresh_since_the_hub_listened_is_never_read_first(
        open_hub: OpenHub, sync: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """[redis-cost] A job seen with nothing generated after the hub's subscription was
    confirmed: every entry it gets is notified to this hub, so however long its first token
    takes (a queued job's wait is often past _FRESH_READ_DELAY_S), its stream is not read. What
    the hub heard of it before the subscriber came and did not keep (a `k` naming it, more
    entries than _RECENT_MAX_ENTRIES) has it read at once."""
    hub = open_hub(block_ms=10_000)
    read = _record_reads(hub)
    await hub.subscribe(KEYS.stream("busy"), "0-0")
    await _first_reads_done(read)

    queued = await hub.subscribe(KEYS.stream("q"), "0-0", fresh_since=time.monotonic())
    await asyncio.sleep(stream_hub._FRESH_READ_DELAY_S * 3)  # waits for a worker
    _publish_step(sync, "q", 0, 2)
    _publish_final(sync, "q", 2)
    assert [entry_id for entry_id, _ in await _collect(queued, 3)] == ["0-1", "0-2", "0-3"]
    await asyncio.sleep(stream_hub._FRESH_READ_DELAY_S + 0.1)
    assert read == []

    seen = time.monotonic()
    _publish_step(sync, "k", 0, 1)
    _publish(sync, "k", 1, 2)  # written, then named by a `k`: the hub keeps no entries of it
    _publish_step(sync, "long", 0, stream_hub._RECENT_MAX_ENTRIES + 1)
    await asyncio.sleep(0.1)
    monkeypatch.setattr(stream_hub, "_FRESH_READ_DELAY_S", _UNMISTAKABLE_DELAY_S)
    started = time.monotonic()
    named = await hub.subscribe(KEYS.stream("k"), "0-0", fresh_since=seen)
    long = await hub.subscribe(KEYS.stream("long"), "0-0", fresh_since=seen)
    assert [entry_id for entry_id, _ in await _collect(named, 2)] == ["0-1", "0-2"]
    assert len(await _collect(long, stream_hub._RECENT_MAX_ENTRIES + 1)) \
        == stream_hub._RECENT_MAX_ENTRIES + 1
    assert time.monotonic() - started < _UNMISTAKABLE_DELAY_S  # not after the delay
    assert sorted(key for keys in read for key in keys) == [KEYS.stream("k"), KEYS.stream("long")]


async def test_a_fresh_stream_is_read_at_once_while_the_hub_is_not_listening_yet(
        open_hub: OpenHub, sync: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first subscriber starts the hub: notifications before its subscription was confirmed
    are lost to it, so even a fresh stream is read first."""
    hub = open_hub(block_ms=10_000)
    monkeypatch.setattr(stream_hub, "_FRESH_READ_DELAY_S", _UNMISTAKABLE_DELAY_S)
    _publish_step(sync, "a", 0, 1)
    _publish_final(sync, "a", 1)
    started = time.monotonic()
    subscription = await hub.subscribe(KEYS.stream("a"), "0-0", fresh_since=started)
    assert await _ids(subscription) == ["0-1", "0-2"]
    assert time.monotonic() - started < _UNMISTAKABLE_DELAY_S  # the hub's start, not the delay


def _submitted_elsewhere(sync: redis.Redis) -> str:
    """A job queued by another API process (its state read by this one's routes), owner ""."""
    return submit_job(sync, JobSpec(job_id=uuid.uuid4().hex, model=MODEL, prompt="hello",
                                    sampling=SamplingParams(max_tokens=8))).id


async def test_the_job_stream_of_a_job_with_no_token_yet_costs_no_first_read(
        redis_url: str, sync: redis.Redis) -> None:
    """GET /v1/jobs/{id}/stream subscribes `fresh` while the job's state has no first token: no
    XREAD for it while its notifications follow each other. A job that has one is read at once.
    (Both submitted by another API process: this one reads their states.)"""
    async for client, job_id in _served_job(redis_url, sync):
        first = Reader(client, job_id)  # starts the hub: read at once, the hub not listening yet
        await asyncio.sleep(0.2)
        sync.config_resetstat()
        fresh_id = _submitted_elsewhere(sync)
        fresh = Reader(client, fresh_id)
        # It subscribed (a first token written before then: a gap), and waits past
        # _FRESH_READ_DELAY_S: the hub listened since its state was read, so it reads nothing.
        await asyncio.sleep(stream_hub._FRESH_READ_DELAY_S * 4)
        for index in range(3):
            _publish_step(sync, job_id, index, index + 1)
            _publish_step(sync, fresh_id, index, index + 1)
        _publish_final(sync, job_id, 3)
        _publish_final(sync, fresh_id, 3)
        await _all_ended([first, fresh])
        assert sync.info("commandstats").get("cmdstat_xread", {}).get("calls", 0) == 0

        started_id = _submitted_elsewhere(sync)
        _publish(sync, started_id, 0, 2, notify=False)
        sync.hset(KEYS.state(started_id), "first_token_at", time.time())
        subscribed_at = time.monotonic()
        started = Reader(client, started_id)
        await started.wait_for(2)  # read at once, no notification needed
        assert time.monotonic() - subscribed_at < 1.0  # (not by the 5 s full read)
        assert sync.info("commandstats")["cmdstat_xread"]["calls"] == 1
        _publish_final(sync, started_id, 2)
        await _all_ended([started])
    assert first.events == _expected(3)
    assert fresh.events == _expected(3)
    assert started.events == _expected(2)


@contextlib.asynccontextmanager
async def _busy_worker(sync: redis.Redis) -> AsyncIterator[None]:
    """A worker stepping every 20 ms meanwhile (its notifications, of a job nobody here follows):
    Redis heard serving, as on a busy fleet."""
    async def steps() -> None:
        for index in itertools.count():
            _notify_live(sync, "elsewhere-busy", index, index + 1)
            await asyncio.sleep(0.02)

    ticking = asyncio.create_task(steps())
    await asyncio.sleep(0.1)
    try:
        yield
    finally:
        ticking.cancel()


async def test_a_job_followed_where_it_was_submitted_costs_no_state_read(
        redis_url: str, sync: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """[redis-cost] The API process that submitted a job knows it exists, is the caller's and
    had nothing generated at its submission: following it from the start while Redis is heard
    serving reads neither its state nor (the hub listening since before the submission) its
    stream. A resume reads the state, as does a job another process submitted, and one
    submitted here while no step notification came lately (Redis may be down: the read says
    so with a 503)."""
    reads: list[str] = []
    state = JobService.state

    async def recording_state(self: JobService, job_id: str, owner: str) -> JobState:
        reads.append(job_id)
        return await state(self, job_id, owner)

    monkeypatch.setattr(JobService, "state", recording_state)
    async for client, job_id in _served_job(redis_url, sync):
        first = Reader(client, job_id)  # starts the hub
        await asyncio.sleep(0.2)
        quiet = (await client.post("/v1/jobs", json={"prompt": "hello"})).json()["job_id"]
        unheard = Reader(client, quiet)
        await asyncio.sleep(0.1)
        assert reads == [job_id, quiet]  # no notification yet: Redis not heard lately
        reads.clear()
        async with _busy_worker(sync):
            sync.config_resetstat()
            mine = (await client.post("/v1/jobs", json={"prompt": "hello"})).json()["job_id"]
            follower = Reader(client, mine)
            await asyncio.sleep(stream_hub._FRESH_READ_DELAY_S * 4)  # queued a while
            _publish_step(sync, mine, 0, 1)
            _publish_step(sync, mine, 1, 3)
            await follower.wait_for(3)
            assert reads == []
            assert sync.info("commandstats").get("cmdstat_xread", {}).get("calls", 0) == 0
            resumed = Reader(client, mine, last_event_id="0-2")
            await resumed.wait_for(1)
            elsewhere = _submitted_elsewhere(sync)
            other = Reader(client, elsewhere)
            await asyncio.sleep(0.1)
            assert reads == [mine, elsewhere]
        for done in (mine, elsewhere, job_id, quiet):
            _publish_final(sync, done, 3 if done == mine else 0)
        await _all_ended([first, unheard, follower, resumed, other])
    assert follower.events == _expected(3)
    assert resumed.events == _expected(3, after=2)
    assert other.events == unheard.events == _expected(0)


async def test_the_hub_heard_redis_for_a_moment_after_each_notification(
        open_hub: OpenHub, sync: redis.Redis) -> None:
    hub = open_hub(block_ms=10_000)
    assert not hub.heard_within(60)  # not subscribed
    read = _record_reads(hub)
    subscription = await hub.subscribe(KEYS.stream("a"), "0-0")
    await _first_reads_done(read)  # the hub waits for notifications now
    assert not hub.heard_within(60)  # none came yet
    _notify_live(sync, "b", 0, 1)
    deadline = time.monotonic() + 5
    while not hub.heard_within(0.1):
        assert time.monotonic() < deadline, "the notification never came"
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.15)
    assert not hub.heard_within(0.1) and hub.heard_within(60)
    sync.client_kill_filter(_type="pubsub")  # its subscription lost
    with pytest.raises(redis.exceptions.ConnectionError):
        await subscription.next(5)
    assert not hub.heard_within(60)


async def test_a_late_subscriber_gets_the_entries_the_hub_heard_with_no_read(
        open_hub: OpenHub, sync: redis.Redis) -> None:
    """[redis-cost] A subscriber that comes after its job's first tokens (not fresh: a busy API
    served its request late) gets what the hub heard of the stream from the first on, live
    tokens the stream does not hold yet included, with no read; a read would bring the durable
    first token alone, and then a read at every step until the stream's next write. One that
    resumes within them gets those after its position; one past them has the stream read."""
    hub = open_hub(block_ms=10_000)
    read = _record_reads(hub)
    await hub.subscribe(KEYS.stream("busy"), "0-0")
    await _first_reads_done(read)
    for job in ("late", "resumed", "ahead"):
        _publish_step(sync, job, 0, 1)  # the first token, in the stream
        _notify_live(sync, job, 1, 5)  # live: in notifications only
    await asyncio.sleep(0.1)
    late = await hub.subscribe(KEYS.stream("late"), "0-0")
    resumed = await hub.subscribe(KEYS.stream("resumed"), "0-3")
    assert await _ids(late) == ["0-1", "0-2", "0-3", "0-4", "0-5"]
    assert await _ids(resumed) == ["0-4", "0-5"]
    _notify_live(sync, "late", 5, 6)
    assert await _ids(late) == ["0-6"]
    assert read == []
    ahead = await hub.subscribe(KEYS.stream("ahead"), "0-7")
    _publish(sync, "ahead", 1, 9)  # the stream's next write
    assert await _ids(ahead) == ["0-8", "0-9"]
    assert read and all(keys == [KEYS.stream("ahead")] for keys in read)  # (the `k` may add one)


async def test_a_streamed_completion_costs_no_stream_read(redis_url: str, sync: redis.Redis) -> None:
    """[redis-cost] An OpenAI request follows the job it has just submitted: the hub listened
    since before the submission, so however long the job waits for its first token, its stream
    is not read (the official client, streaming)."""
    async for client, job_id in _served_job(redis_url, sync):
        first = Reader(client, job_id)  # starts the hub
        await asyncio.sleep(0.2)
        sync.config_resetstat()
        known = set(sync.scan_iter(KEYS.state("*")))
        oai = openai.AsyncOpenAI(base_url=f"{client.base_url}/v1", api_key="unused", max_retries=0)

        async def completion(oai: openai.AsyncOpenAI) -> list[tuple[str, str | None]]:
            stream = await oai.completions.create(model=MODEL, prompt="hello", max_tokens=3,
                                                  stream=True)
            return [(chunk.choices[0].text, chunk.choices[0].finish_reason)
                    async for chunk in stream if chunk.choices]

        reading = asyncio.create_task(completion(oai))
        deadline = time.monotonic() + 5
        while not (new := set(sync.scan_iter(KEYS.state("*"))) - known):
            assert time.monotonic() < deadline, "the completion's job was never submitted"
            await asyncio.sleep(0.01)
        completion_id = new.pop().decode().removeprefix(KEYS.state(""))
        await asyncio.sleep(stream_hub._FRESH_READ_DELAY_S * 4)  # queued, waiting for a worker
        _publish_step(sync, completion_id, 0, 3)
        _publish_final(sync, completion_id, 3)
        assert await asyncio.wait_for(reading, 10) == [("t0", None), ("t1", None), ("t2", None),
                                                       ("", "stop")]
        assert sync.info("commandstats").get("cmdstat_xread", {}).get("calls", 0) == 0
        _publish_done(sync, job_id, 0)
        await _all_ended([first])
        await oai.close()


async def test_the_hub_stays_subscribed_a_while_after_its_last_stream(
        open_hub: OpenHub, sync: redis.Redis) -> None:
    """One job at a time: the next subscriber within _LINGER_S finds the hub still listening (no
    new connection or subscription), so its fresh stream costs no read either."""
    hub = open_hub(block_ms=10_000)
    first = await hub.subscribe(KEYS.stream("a"), "0-0", fresh_since=time.monotonic())
    await asyncio.sleep(0.1)
    hub.unsubscribe(first)
    await asyncio.sleep(0.3)  # past a few turns with nothing followed
    read = _record_reads(hub)
    sync.config_resetstat()
    second = await hub.subscribe(KEYS.stream("b"), "0-0", fresh_since=time.monotonic())
    _publish_step(sync, "b", 0, 1)
    _publish_final(sync, "b", 1)
    assert [entry_id for entry_id, _ in await _collect(second, 2)] == ["0-1", "0-2"]
    assert read == []
    commands = sync.info("commandstats")
    assert "cmdstat_subscribe" not in commands and "cmdstat_hello" not in commands


async def test_the_hub_forgets_unfollowed_entries_it_cannot_vouch_for(
        open_hub: OpenHub, sync: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the hub keeps of streams nobody follows yet is dropped when a `k` says the stream
    got more than was notified, and once _RECENT_S passed: a fresh subscriber then reads (one
    that saw the job fresh that long ago, after the delay)."""
    monkeypatch.setattr(stream_hub, "_RECENT_S", 0.2)
    hub = open_hub(block_ms=10_000)
    read = _record_reads(hub)
    await hub.subscribe(KEYS.stream("busy"), "0-0")
    await _first_reads_done(read)
    seen = time.monotonic()
    _publish_step(sync, "k", 0, 1)
    _publish(sync, "k", 1, 2)  # written, then named by a `k`
    _publish_step(sync, "old", 0, 1)
    await asyncio.sleep(0.4)  # past _RECENT_S
    named = await hub.subscribe(KEYS.stream("k"), "0-0", fresh_since=seen)
    aged = await hub.subscribe(KEYS.stream("old"), "0-0", fresh_since=seen)
    assert [entry_id for entry_id, _ in await _collect(named, 2)] == ["0-1", "0-2"]
    assert await _ids(aged) == ["0-1"]
    assert read == [[KEYS.stream("k"), KEYS.stream("old")]]  # together, after the delay
