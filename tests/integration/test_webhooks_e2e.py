"""Webhooks end to end: real Redis, a real worker on the tiny model, the real dispatcher process
(`python -m webhooks`) and a receiver on 127.0.0.1 that checks every signature. Each way a job
ends (completed, failed, expired, canceled queued, canceled running) brings its event once; a
first delivery answered 500 comes again and is accepted; an endpoint that always fails ends in
the dead-letter stream."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from protocol import JobSpec, JobStatus, cancel_job, submit_jobs
from protocol.webhook_events import DeadLetter
from tests.integration.conftest import KEYS, REPO, Fleet, new_id, wait_final, wait_until
from tests.webhooks.receiver import SECRET, Receiver, running_receiver

pytestmark = pytest.mark.slow

WORKER_ARGS = ["--max-num-seqs", "4", "--lease-seconds", "3", "--idle-block-seconds", "0.5",
               "--num-threads", "1"]
MAX_ATTEMPTS = 3


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    with running_receiver() as r:
        yield r


@pytest.fixture(scope="module")
def stack(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """The worker and the dispatcher process."""
    log_path = Path(tmp_path_factory.mktemp("dispatcher")) / "dispatcher.log"
    with log_path.open("ab") as log:
        dispatcher = subprocess.Popen(
            [sys.executable, "-m", "webhooks"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "CARPOOL_REDIS_URL": fleet.redis_url,
                 "CARPOOL_WEBHOOK_SECRET": SECRET, "CARPOOL_WEBHOOK_ALLOWED_HOSTS": "127.0.0.1",
                 "CARPOOL_WEBHOOK_MAX_ATTEMPTS": str(MAX_ATTEMPTS),
                 "CARPOOL_WEBHOOK_BACKOFF_BASE_S": "0.2", "CARPOOL_WEBHOOK_BACKOFF_MAX_S": "0.5",
                 "CARPOOL_WEBHOOK_TIMEOUT_S": "2", "CARPOOL_WEBHOOK_CLAIM_IDLE_S": "5"})
    fleet.start(("hooked", WORKER_ARGS))
    yield fleet
    dispatcher.terminate()
    assert dispatcher.wait(timeout=30) == 0, log_path.read_text()


def _spec(model: str, url: str, **fields: object) -> JobSpec:
    data: dict[str, object] = dict(job_id=new_id(), model=model, prompt="Once upon a time",
                                   max_tokens=6, temperature=0.0, webhook_url=url)
    data.update(fields)
    return JobSpec.from_dict(data)


def test_every_final_status_is_delivered_signed_and_once(stack: Fleet, receiver: Receiver) -> None:
    model = stack.model_dir.name
    receiver.answers["/flaky"] = [500, 204]
    receiver.answers["/down"] = [500]
    completed = _spec(model, receiver.url("/flaky"))
    failed = _spec(model, receiver.url("/ok"), prompt=None, prompt_token_ids=[10**7])
    expired = _spec(model, receiver.url("/ok"), queue_deadline_at=time.time() - 1)
    running = _spec(model, receiver.url("/ok"), max_tokens=600, ignore_eos=True)
    queued = _spec("a-model-nobody-serves", receiver.url("/ok"))
    undeliverable = _spec(model, receiver.url("/down"))
    submit_jobs(stack.redis, [completed, failed, expired, running, undeliverable])
    submit_jobs(stack.redis, [queued])
    assert cancel_job(stack.redis, queued.job_id) is JobStatus.CANCELED
    # Its first token: it runs (and has most of its 600 tokens to go). Not a later entry: the
    # worker writes a job's stream every CARPOOL_DURABLE_INTERVAL_MS, by which time a loaded box
    # may have seen the tiny model finish it.
    wait_until(lambda: stack.redis.xlen(KEYS.stream(running.job_id)) >= 1, 120, "tokens",
               stack.logs)
    assert cancel_job(stack.redis, running.job_id) is JobStatus.RUNNING
    job_ids = [completed.job_id, failed.job_id, expired.job_id, running.job_id,
               undeliverable.job_id]
    states = wait_final(stack, job_ids)

    def accepted() -> dict[str, dict]:
        return {r.payload["data"]["id"]: r.payload for r in receiver.received if r.status == 204}

    wait_until(lambda: len(accepted()) == 5, 60, "5 accepted deliveries", stack.logs)
    wait_until(lambda: stack.redis.xlen(KEYS.webhook_dead_letters()) == 1, 60, "a dead letter",
               stack.logs)
    assert all(r.verified for r in receiver.received)
    # One accepted delivery per job: the 500 answered ones and the dead one aside, no repeats.
    assert sorted(r.payload["data"]["id"] for r in receiver.received if r.status == 204) == sorted(
        [completed.job_id, failed.job_id, expired.job_id, running.job_id, queued.job_id])
    got = accepted()

    def expected(job_id: str, event_type: str, status: str, reason: str, error: object = None,
                 ) -> dict:
        state = states.get(job_id)
        prompt, completion = (state.prompt_tokens, state.completion_tokens) if state else (0, 0)
        return {"type": event_type, "data": {
            "id": job_id, "object": "job", "status": status, "finish_reason": reason,
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                      "total_tokens": prompt + completion}, "error": error}}

    def without_time(payload: dict) -> dict:
        assert payload["timestamp"].endswith("Z")
        return {k: v for k, v in payload.items() if k != "timestamp"}

    assert states[completed.job_id].completion_tokens == 6
    assert without_time(got[completed.job_id]) == expected(
        completed.job_id, "job.completed", "finished", "length")
    assert states[failed.job_id].status is JobStatus.FAILED
    assert without_time(got[failed.job_id]) == expected(
        failed.job_id, "job.failed", "failed", "error", states[failed.job_id].error)
    assert without_time(got[expired.job_id]) == expected(
        expired.job_id, "job.expired", "finished", "expired")
    assert states[running.job_id].completion_tokens >= 3
    assert without_time(got[running.job_id]) == expected(
        running.job_id, "job.canceled", "canceled", "canceled")
    assert without_time(got[queued.job_id]) == expected(
        queued.job_id, "job.canceled", "canceled", "canceled")
    # The flaky endpoint: refused once, then the same message (id and body) accepted.
    first, second = receiver.on("/flaky")
    assert (first.status, second.status) == (500, 204)
    assert first.headers["webhook-id"] == second.headers["webhook-id"]
    assert first.body == second.body
    # The endpoint that always fails: MAX_ATTEMPTS tries, then the dead letter.
    assert [r.status for r in receiver.on("/down")] == [500] * MAX_ATTEMPTS
    ((_, fields),) = stack.redis.xrange(KEYS.webhook_dead_letters())
    letter = DeadLetter.from_fields(fields)
    assert (letter.type, letter.url, letter.attempts, letter.status_code, letter.error) == (
        "job.completed", receiver.url("/down"), MAX_ATTEMPTS, 500, "HTTP 500")
    assert letter.webhook_id == receiver.on("/down")[0].headers["webhook-id"]
    # Nothing left open: every event acknowledged and dropped.
    wait_until(lambda: stack.redis.xlen(KEYS.webhook_events()) == 0, 10, "an empty event stream")
    assert stack.redis.xpending(KEYS.webhook_events(), KEYS.webhook_group())["pending"] == 0
