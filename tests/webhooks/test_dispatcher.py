"""The dispatcher on a real Redis against a real HTTP receiver on 127.0.0.1: signed delivery,
retries with backoff kept in Redis, dead letters, takeover of a dead dispatcher's events, and the
allow-list applied at delivery (to the address it connects to)."""

from __future__ import annotations

import ipaddress
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from redis import Redis

from protocol import Keys
from protocol.webhook_events import DeadLetter, emit_event
from tests.conftest import UnsavingRedis
from tests.webhooks.receiver import SECRET, Receiver, running_receiver
from webhooks.dispatcher import WebhookDispatcher, backoff_s
from webhooks.sender import WebhookSender
from webhooks.settings import DispatcherSettings

KEYS = Keys()
DATA = {"id": "job-1", "status": "finished"}


@pytest.fixture()
def redis(redis_url: str) -> Iterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture()
def receiver() -> Iterator[Receiver]:
    with running_receiver() as r:
        yield r


def settings(**overrides: object) -> DispatcherSettings:
    fields: dict[str, object] = dict(
        webhook_secret=SECRET, webhook_allowed_hosts=["127.0.0.1"], webhook_max_attempts=3,
        webhook_backoff_base_s=0.05, webhook_backoff_max_s=0.2, webhook_timeout_s=0.5,
        webhook_claim_idle_s=1.5, webhook_concurrency=4)
    fields.update(overrides)
    return DispatcherSettings(**fields)


def dispatcher(redis: Redis, name: str = "d1", **overrides: object) -> WebhookDispatcher:
    d = WebhookDispatcher(redis, settings(**overrides), name)
    d.ensure_group()
    return d


def run_until(d: WebhookDispatcher, done, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "dispatcher did not get there in time"
        d.step(block_ms=50)


def open_work(redis: Redis) -> tuple[int, int, int, int]:
    """Events in the stream, pending in the group, waiting on a retry, with an attempt count."""
    pending = redis.xpending(KEYS.webhook_events(), KEYS.webhook_group())["pending"]
    return (redis.xlen(KEYS.webhook_events()), pending, redis.zcard(KEYS.webhook_retries()),
            redis.hlen(KEYS.webhook_attempts()))


def dead_letters(redis: Redis) -> list[DeadLetter]:
    return [DeadLetter.from_fields(f) for _, f in redis.xrange(KEYS.webhook_dead_letters())]


def test_a_failed_delivery_is_sent_again_with_the_same_id_and_body(
        redis: Redis, receiver: Receiver) -> None:
    receiver.answers["/flaky"] = [500, 204]
    d = dispatcher(redis)
    emit_event(redis, "job.completed", DATA, receiver.url("/flaky"))
    run_until(d, lambda: len(receiver.on("/flaky")) == 2)
    first, second = receiver.on("/flaky")
    assert (first.status, second.status) == (500, 204)
    assert first.verified and second.verified
    assert first.headers["webhook-id"] == second.headers["webhook-id"]
    assert first.body == second.body
    assert first.payload["type"] == "job.completed" and first.payload["data"] == DATA
    assert open_work(redis) == (0, 0, 0, 0)  # acknowledged and dropped
    assert dead_letters(redis) == []
    d.close()


def test_an_endpoint_that_always_fails_ends_in_a_dead_letter(
        redis: Redis, receiver: Receiver) -> None:
    receiver.answers["/down"] = [503]
    d = dispatcher(redis)
    emit_event(redis, "job.failed", DATA, receiver.url("/down"), owner="key-1")
    run_until(d, lambda: dead_letters(redis))
    assert [r.status for r in receiver.on("/down")] == [503, 503, 503]  # max_attempts
    (letter,) = dead_letters(redis)
    assert (letter.type, letter.url, letter.owner, letter.attempts, letter.status_code,
            letter.error) == ("job.failed", receiver.url("/down"), "key-1", 3, 503, "HTTP 503")
    assert letter.webhook_id == receiver.on("/down")[0].headers["webhook-id"]
    assert open_work(redis) == (0, 0, 0, 0)
    d.close()


def test_retries_survive_a_dispatcher_restart(redis: Redis, receiver: Receiver) -> None:
    receiver.answers["/flaky"] = [500, 204]
    first = dispatcher(redis, "d1", webhook_backoff_base_s=0.5, webhook_backoff_max_s=0.5)
    emit_event(redis, "job.completed", DATA, receiver.url("/flaky"))
    run_until(first, lambda: receiver.on("/flaky"))
    first.close()  # stops with the event failed once, its retry time in Redis
    assert open_work(redis) == (1, 1, 1, 1)
    second = dispatcher(redis, "d2", webhook_backoff_base_s=0.5, webhook_backoff_max_s=0.5)
    run_until(second, lambda: len(receiver.on("/flaky")) == 2)
    assert receiver.on("/flaky")[1].status == 204
    assert open_work(redis) == (0, 0, 0, 0)
    second.close()


def test_a_dead_dispatchers_events_are_claimed_after_the_idle_time(
        redis: Redis, receiver: Receiver) -> None:
    d = dispatcher(redis, "alive")
    emit_event(redis, "job.completed", DATA, receiver.url("/ok"))
    # Another dispatcher read it and died before delivering it.
    redis.xreadgroup(KEYS.webhook_group(), "dead", {KEYS.webhook_events(): ">"}, count=10)
    d.step(block_ms=10)
    assert receiver.on("/ok") == []  # still the dead one's, not idle long enough
    time.sleep(1.6)
    d._next_claim_at = 0.0  # the claim pass runs every claim_idle_s / 4: do not wait for it
    run_until(d, lambda: receiver.on("/ok"))
    assert open_work(redis) == (0, 0, 0, 0)
    d.close()


def test_a_url_refused_at_delivery_is_dead_lettered_without_a_request(
        redis: Redis, receiver: Receiver) -> None:
    d = dispatcher(redis, webhook_allowed_hosts=[])  # 127.0.0.1 is loopback: refused
    emit_event(redis, "job.completed", DATA, receiver.url("/ok"))
    run_until(d, lambda: dead_letters(redis))
    (letter,) = dead_letters(redis)
    assert letter.attempts == 1 and letter.status_code == 0
    assert "non-public address (127.0.0.1" in letter.error
    assert receiver.received == []
    d.close()


def test_the_check_uses_the_address_resolved_now_and_connects_to_it(
        redis: Redis, receiver: Receiver) -> None:
    answers = {"rebound.example": ["10.0.0.8"], "hooks.example": ["127.0.0.1"]}
    resolved: list[str] = []

    def resolver(host: str, port: int) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
        resolved.append(host)
        return [ipaddress.ip_address(a) for a in answers[host]]

    config = settings()
    d = WebhookDispatcher(redis, config, "d1",
                          sender=WebhookSender(config.allow_list, 0.5, resolver=resolver))
    d.ensure_group()
    emit_event(redis, "job.completed", DATA, f"http://rebound.example:{receiver.port}/x")
    emit_event(redis, "job.completed", DATA, f"http://hooks.example:{receiver.port}/y")
    run_until(d, lambda: dead_letters(redis) and receiver.on("/y"))
    (letter,) = dead_letters(redis)
    assert "'rebound.example' (10.0.0.8) is not in the webhook allow-list" in letter.error
    (delivered,) = receiver.received
    assert delivered.headers["host"] == f"hooks.example:{receiver.port}"  # the name, kept
    assert sorted(resolved) == ["hooks.example", "rebound.example"]
    d.close()


def test_backoff_doubles_up_to_the_cap_with_jitter() -> None:
    assert [backoff_s(n, 2.0, 20.0, lambda: 1.0) for n in (1, 2, 3, 4, 5)] == [2.0, 4.0, 8.0, 16.0, 20.0]
    assert [backoff_s(n, 2.0, 20.0, lambda: 0.0) for n in (1, 2, 5)] == [1.0, 2.0, 10.0]


def test_settings_refuse_a_claim_time_a_slow_delivery_could_outlive() -> None:
    with pytest.raises(ValueError, match="CARPOOL_WEBHOOK_CLAIM_IDLE_S"):
        settings(webhook_timeout_s=10.0, webhook_claim_idle_s=15.0)


def test_the_dispatcher_waits_out_a_redis_that_refuses_writes(
        unsaving_redis: UnsavingRedis, receiver: Receiver) -> None:
    # A Redis that cannot save to disk refuses writes (MISCONF), its consumer group's reads too:
    # the dispatcher waits, then delivers. Before, its thread ended on the first refusal.
    redis = unsaving_redis.client
    d = dispatcher(redis)
    emit_event(redis, "job.completed", DATA, receiver.url("/hook"))
    unsaving_redis.fail_saves()
    with running(d) as thread:
        time.sleep(0.5)
        assert thread.is_alive() and receiver.on("/hook") == []
        unsaving_redis.allow_writes()
        _until_delivered(receiver, thread)


def test_the_dispatcher_creates_its_group_again_after_redis_lost_its_data(
        redis: Redis, receiver: Receiver) -> None:
    # A Redis restarted without its data (or flushed) has no consumer group: the dispatcher's
    # reads answered NOGROUP, which ended its thread. It makes the group again and delivers
    # what comes next.
    with running(dispatcher(redis)) as thread:
        _until_blocked_reading(redis)
        redis.flushall()  # under its blocked read: UNBLOCKED (a read after it: NOGROUP)
        _until_blocked_reading(redis)
        emit_event(redis, "job.completed", DATA, receiver.url("/hook"))
        _until_delivered(receiver, thread)


@contextmanager
def running(d: WebhookDispatcher) -> Iterator[threading.Thread]:
    """The dispatcher's `run` loop on a thread of its own, as `python -m webhooks` runs it."""
    stop = threading.Event()
    thread = threading.Thread(target=d.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        stop.set()
        thread.join(10)
        d.close()


def _until_delivered(receiver: Receiver, thread: threading.Thread) -> None:
    deadline = time.monotonic() + 10
    while not receiver.on("/hook"):
        assert thread.is_alive(), "the dispatcher's thread ended"
        assert time.monotonic() < deadline, "not delivered"
        time.sleep(0.05)
    assert receiver.on("/hook")[0].payload["data"] == DATA


def _until_blocked_reading(redis: Redis) -> None:
    deadline = time.monotonic() + 10
    while not any(client.get("cmd") == "xreadgroup" for client in redis.client_list()):
        assert time.monotonic() < deadline, "the dispatcher did not block on its read"
        time.sleep(0.01)
