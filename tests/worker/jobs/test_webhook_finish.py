"""The FINISH script emits the job's webhook event with its final status: once, for each way a
job ends on a worker (completed, failed, expired, canceled by the finish guard)."""

from __future__ import annotations

import json

import pytest

from protocol import FinishReason, JobStatus, cancel_job
from protocol.webhook_events import WebhookEvent
from tests.worker.jobs.job_support import (
    KEYS,
    claim_one,
    expire_lease,
    fake_redis,
    generate,
    make_publisher,
    make_queue,
    running,
    submit,
)
from worker.jobs.stream_publisher import JobEnd

URL = "https://hooks.example.com/jobs"


def events(redis) -> list[tuple[str, dict]]:
    out = []
    for entry_id, fields in redis.xrange(KEYS.webhook_events()):
        event = WebhookEvent.from_entry(entry_id, fields)
        assert event.url == URL
        out.append((event.type, json.loads(event.data)))
    return out


@pytest.mark.parametrize(("end", "event_type", "status"), [
    (JobEnd(JobStatus.FINISHED, FinishReason.STOP), "job.completed", "finished"),
    (JobEnd(JobStatus.FINISHED, FinishReason.LENGTH), "job.completed", "finished"),
    (JobEnd(JobStatus.FINISHED, FinishReason.EXPIRED), "job.expired", "finished"),
    (JobEnd(JobStatus.CANCELED, FinishReason.CANCELED), "job.canceled", "canceled"),
])
def test_each_end_emits_its_event_once(end: JobEnd, event_type: str, status: str) -> None:
    redis = fake_redis()
    job, pub = claim_one(redis, webhook_url=URL, num_prompt_tokens=4)
    generate(job, 11, 12)
    pub.append(job)
    pub.finish(job, end)
    assert pub.flush().ended == {"job-1": JobStatus(status)}
    pub.finish(job, end)  # a resent finish is refused: no second event
    assert pub.flush().refused == {"job-1"}
    assert events(redis) == [(event_type, {
        "id": "job-1", "object": "job", "status": status, "finish_reason": end.finish_reason.value,
        "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6},
        "error": None})]


def test_a_failed_job_carries_its_error() -> None:
    redis = fake_redis()
    job, pub = claim_one(redis, webhook_url=URL, num_prompt_tokens=0)
    pub.finish(job, JobEnd(JobStatus.FAILED, FinishReason.ERROR, "prompt too long"))
    pub.flush()
    assert events(redis) == [("job.failed", {
        "id": "job-1", "object": "job", "status": "failed", "finish_reason": "error",
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
        "error": "prompt too long"})]


def test_a_job_canceled_while_running_reports_canceled_not_completed() -> None:
    redis = fake_redis()
    job, pub = claim_one(redis, webhook_url=URL)
    assert cancel_job(redis, "job-1") is JobStatus.RUNNING  # flagged: no event yet
    assert redis.xlen(KEYS.webhook_events()) == 0
    generate(job, 11)
    pub.append(job)
    pub.finish(job, JobEnd(JobStatus.FINISHED, FinishReason.STOP))
    pub.flush()
    assert [(t, d["status"], d["finish_reason"]) for t, d in events(redis)] == [
        ("job.canceled", "canceled", "canceled")]


def test_a_zombie_worker_cannot_emit_after_a_takeover() -> None:
    redis = fake_redis()
    submit(redis, "job-1", webhook_url=URL)
    zombie_queue = make_queue(redis, worker="w1")
    zombie = running(zombie_queue.claim(1)[0])
    expire_lease(redis, "job-1")
    heir_queue = make_queue(redis, worker="w2")
    heir_pub = make_publisher(heir_queue)
    heir_pub.recover()
    assert heir_pub.flush().recovered == ["job-1"]
    heir = running(heir_queue.claim(1)[0])
    zombie_pub = make_publisher(zombie_queue)
    zombie_pub.finish(zombie, JobEnd(JobStatus.FINISHED, FinishReason.STOP))
    assert zombie_pub.flush().refused == {"job-1"}
    assert redis.xlen(KEYS.webhook_events()) == 0
    heir_pub.finish(heir, JobEnd(JobStatus.FINISHED, FinishReason.LENGTH))
    heir_pub.flush()
    assert [t for t, _ in events(redis)] == ["job.completed"]


def test_no_url_no_event() -> None:
    redis = fake_redis()
    job, pub = claim_one(redis)
    pub.finish(job, JobEnd(JobStatus.FINISHED, FinishReason.STOP))
    assert pub.flush().ended == {"job-1": JobStatus.FINISHED}
    assert redis.xlen(KEYS.webhook_events()) == 0
