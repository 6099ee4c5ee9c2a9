"""Webhook events written where a job ends on the protocol side (cancel of a queued job) and by
emit_event; the worker's FINISH path is covered in tests/worker/jobs/test_webhook_finish.py."""

from __future__ import annotations

import json
import time

import fakeredis
import pytest
from redis import Redis

from protocol import JobStatus, Keys, cancel_job, submit_job
from protocol.job_submission import DEFAULT_FAILURE_TTL
from protocol.webhook_events import EMIT_EVENT_LUA, EVENT_RETENTION_MS, WebhookEvent, emit_event
from tests.protocol.conftest import make_spec

KEYS = Keys()


def events(redis: fakeredis.FakeRedis) -> list[WebhookEvent]:
    return [WebhookEvent.from_entry(i, f) for i, f in redis.xrange(KEYS.webhook_events())]


def test_canceling_a_queued_job_emits_job_canceled_once(fake_redis: fakeredis.FakeRedis) -> None:
    submit_job(fake_redis, make_spec("job-1", webhook_url="https://hooks.example.com/a"))
    assert cancel_job(fake_redis, "job-1") is JobStatus.CANCELED
    assert cancel_job(fake_redis, "job-1") is JobStatus.CANCELED  # already final: no event
    (event,) = events(fake_redis)
    assert (event.type, event.url, event.owner) == ("job.canceled", "https://hooks.example.com/a",
                                                    "key-1")
    assert json.loads(event.data) == {
        "id": "job-1", "object": "job", "status": "canceled", "finish_reason": "canceled",
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}, "error": None}
    assert event.at > 1_600_000_000
    body = json.loads(event.body())
    assert body["type"] == "job.canceled" and body["data"]["id"] == "job-1"
    assert body["timestamp"].endswith("Z")


def test_a_job_without_webhook_emits_nothing(fake_redis: fakeredis.FakeRedis) -> None:
    submit_job(fake_redis, make_spec("job-2"))
    assert cancel_job(fake_redis, "job-2") is JobStatus.CANCELED
    assert fake_redis.xlen(KEYS.webhook_events()) == 0


def test_canceling_a_running_job_leaves_the_event_to_its_worker(
        fake_redis: fakeredis.FakeRedis) -> None:
    submit_job(fake_redis, make_spec("job-3", webhook_url="https://hooks.example.com/a"))
    fake_redis.hset(KEYS.state("job-3"), "status", "running")
    assert cancel_job(fake_redis, "job-3") is JobStatus.RUNNING
    assert fake_redis.xlen(KEYS.webhook_events()) == 0


def test_the_spec_carries_the_url_and_the_state_keeps_it(fake_redis: fakeredis.FakeRedis) -> None:
    spec = make_spec("job-4", webhook_url="https://hooks.example.com/b")
    assert spec.to_dict()["webhook_url"] == "https://hooks.example.com/b"
    assert "webhook_url" not in make_spec("job-5").to_dict()  # older workers still read it
    submit_job(fake_redis, spec)
    assert fake_redis.hget(KEYS.state("job-4"), "webhook_url") == b"https://hooks.example.com/b"


def test_emit_event_in_a_transaction(fake_redis: fakeredis.FakeRedis) -> None:
    with fake_redis.pipeline(transaction=True) as pipe:
        emit_event(pipe, "batch.completed", {"id": "batch_1", "request_counts": {"total": 2}},
                   "https://hooks.example.com/c", owner="key-9")
        emit_event(pipe, "batch.completed", {"id": "batch_2"}, "")  # no URL: nothing
        pipe.execute()
    (event,) = events(fake_redis)
    assert (event.type, event.url, event.owner) == ("batch.completed",
                                                    "https://hooks.example.com/c", "key-9")
    assert json.loads(event.data) == {"id": "batch_1", "request_counts": {"total": 2}}
    assert event.webhook_id == f"msg_{event.event_id}"


@pytest.mark.parametrize("writer", ["python", "lua"])
def test_events_older_than_the_retention_are_trimmed_by_the_next_write(
        redis_url: str, writer: str) -> None:
    """A stream no dispatcher reads keeps a week of events, not all of them (real Redis: MINID ~
    trims whole stream nodes, here a first node of 100 old entries)."""
    redis = Redis.from_url(redis_url)
    stream = KEYS.webhook_events()
    for ms in range(1, 101):  # long before the retention: the first node, full
        redis.xadd(stream, {"type": "job.completed", "url": "https://old", "data": "{}"},
                   id=f"{ms}-0")
    six_days_ago = int(time.time() * 1000) - EVENT_RETENTION_MS + 24 * 3600 * 1000
    redis.xadd(stream, {"type": "job.completed", "url": "https://recent", "data": "{}"},
               id=f"{six_days_ago}-0")
    if writer == "python":
        emit_event(redis, "batch.completed", {"id": "batch_1"}, "https://hooks.example.com/b")
    else:
        redis.eval(EMIT_EVENT_LUA + "emit_event(KEYS[1], 'job.completed', "
                   "'https://hooks.example.com/j', 'key-1', '{}')", 1, stream)
    urls = [fields[b"url"] for _, fields in redis.xrange(stream)]
    assert urls[0] == b"https://recent" and urls[1].startswith(b"https://hooks.example.com/")
    assert len(urls) == 2


def test_events_are_kept_as_long_as_a_failed_job() -> None:
    assert EVENT_RETENTION_MS == DEFAULT_FAILURE_TTL * 1000
