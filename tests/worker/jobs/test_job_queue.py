"""Claims: priority order, RQ bookkeeping as an rq worker does it, KV budget, resume data."""

from __future__ import annotations

import threading
import time
import zlib

import pytest
from rq import Queue, Worker
from rq.job import Job
from rq.job import JobStatus as RQJobStatus
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer
from rq.suspension import resume, suspend

from protocol import (
    JobReader,
    JobStatus,
    Priority,
    StreamEntry,
    cancel_job,
    stream_ids,
    submit_job,
)
from protocol.rq_keys import RQKeys
from tests.worker.jobs.job_support import BLOCK_SIZE, KEYS, fake_redis, make_queue, make_spec, submit
from worker.jobs.job_queue import JobQueue, WorkersSuspended, decode_spec
from worker.jobs.job_scripts import JobScripts


def test_claim_takes_higher_priorities_first_and_fifo_within_one() -> None:
    redis = fake_redis()
    submit(redis, "low-1", priority=Priority.LOW)
    submit(redis, "normal-1", "normal-2")
    submit(redis, "high-1", priority=Priority.HIGH)
    queue = make_queue(redis)
    assert [c.lease.job_id for c in queue.claim(3)] == ["high-1", "normal-1", "normal-2"]
    assert [c.lease.job_id for c in queue.claim(3)] == ["low-1"]
    assert queue.claim(3) == []


def test_claim_records_the_job_as_started_the_rq_way() -> None:
    redis = fake_redis()
    submit(redis, "job-1")
    (claim,) = make_queue(redis, worker="w1").claim(4)
    assert claim.spec == make_spec("job-1")
    assert (claim.lease.token, claim.lease.queue_name) == ("1", "carpool-tiny-normal")
    job = Job.fetch("job-1", redis, serializer=JSONSerializer)
    assert job.get_status() == RQJobStatus.STARTED
    assert job.worker_name == "w1" and job.started_at is not None
    assert StartedJobRegistry("carpool-tiny-normal", connection=redis).get_job_ids() == ["job-1"]
    (execution,) = job.get_executions()
    assert (execution.id, execution.worker_name) == (claim.lease.execution_id, "w1")
    assert redis.smembers(RQKeys.worker_executions("w1")) == {claim.lease.composite.encode()}
    assert Queue("carpool-tiny-normal", connection=redis).count == 0
    state = JobReader(redis).state("job-1")
    assert (state.status, state.worker, state.execution) == (
        JobStatus.RUNNING, "w1", claim.lease.composite)
    assert state.started_at > 0
    assert redis.get(KEYS.lease("job-1")) == b"1"
    assert 9000 < redis.pttl(KEYS.lease("job-1")) <= 10_000
    assert redis.zscore(KEYS.leases(), "job-1") > time.time() * 1000


def test_claim_sets_the_rq_worker_busy_for_rq_info() -> None:
    redis = fake_redis()
    worker = Worker(["carpool-tiny-normal"], name="w1", connection=redis)
    worker.register_birth()
    submit(redis, "job-1")
    make_queue(redis, worker="w1").claim(1)
    (listed,) = Worker.all(connection=redis)
    assert listed.get_state() == "busy"
    assert [e.job_id for e in listed.get_current_executions()] == ["job-1"]


def test_claim_stops_at_a_job_that_does_not_fit_the_kv_budget() -> None:
    redis = fake_redis()
    submit(redis, "big", "small", priority=Priority.HIGH)
    submit(redis, "normal-1")
    redis.hset(KEYS.state("big"), "prompt_tokens", 40)  # 41 tokens: 3 blocks of 16
    queue = make_queue(redis)
    assert queue.claim(4, free_kv_blocks=2) == []
    assert Queue("carpool-tiny-high", connection=redis).job_ids == ["big", "small"]
    assert [c.lease.job_id for c in queue.claim(4, free_kv_blocks=4)] == ["big", "small"]


def test_claim_returns_the_tokens_to_resume_from_and_the_cancel_flag() -> None:
    redis = fake_redis()
    submit(redis, "job-1")
    for i in range(3):
        entry = StreamEntry(kind="token", index=i, token_id=50 + i, text=str(i))
        redis.xadd(KEYS.stream("job-1"), entry.to_fields(), id=stream_ids.token_entry_id(i))
    redis.hset(KEYS.state("job-1"), mapping={"status": "preempted", "num_preemptions": 1})
    redis.sadd(KEYS.canceled(), "job-1")
    (claim,) = make_queue(redis).claim(1)
    assert [(t.index, t.token_id) for t in claim.tokens] == [(0, 50), (1, 51), (2, 52)]
    assert claim.state.num_preemptions == 1
    assert claim.is_canceled


def test_claim_drops_stale_ids_and_reports_malformed_payloads() -> None:
    redis = fake_redis()
    submit(redis, "gone", "broken", "ok")
    redis.delete(RQKeys.job("gone"))
    payload = b'["worker.rq_entry.generate", null, [7], {}]'
    redis.hset(RQKeys.job("broken"), "data", zlib.compress(payload))
    claims = make_queue(redis).claim(3)
    assert [c.lease.job_id for c in claims] == ["broken", "ok"]
    assert claims[0].spec is None
    assert claims[0].error == "malformed job: job spec must be a JSON object, got int"


def test_claim_skips_jobs_canceled_while_queued() -> None:
    redis = fake_redis()
    submit(redis, "job-1", "job-2")
    cancel_job(redis, "job-1")
    assert [c.lease.job_id for c in make_queue(redis).claim(2)] == ["job-2"]


def test_wait_blocks_on_wakeups_and_takes_no_job_off_a_queue() -> None:
    redis = fake_redis()
    queue = make_queue(redis)
    assert queue.wait(0.05) is False
    timer = threading.Timer(0.1, lambda: submit(redis, "job-1"))
    timer.start()
    assert queue.wait(2.0) is True
    timer.join()
    # A worker killed here loses nothing: the job is still queued, for whoever claims first.
    assert Queue("carpool-tiny-normal", connection=redis).job_ids == ["job-1"]
    submit(redis, "job-2", "job-3")
    submit(redis, "job-4", priority=Priority.HIGH)
    assert [c.lease.job_id for c in queue.claim(2)] == ["job-4", "job-1"]
    # The claim leaves one wake-up per job still queued (job-2 and job-3), none for the rest.
    assert redis.llen(KEYS.wakeups("carpool-tiny-normal")) == 2
    assert not redis.exists(KEYS.wakeups("carpool-tiny-high"))
    assert [c.lease.job_id for c in queue.claim(4)] == ["job-2", "job-3"]
    assert not redis.exists(KEYS.wakeups("carpool-tiny-normal"))
    assert queue.wait(0.05) is False


def test_a_claim_of_empty_queues_clears_their_stale_wakeups() -> None:
    redis = fake_redis()
    queue = make_queue(redis)
    submit(redis, "job-1")
    submit(redis, "job-2", priority=Priority.HIGH)
    cancel_job(redis, "job-1")
    cancel_job(redis, "job-2")  # off their queues; their wake-ups stay behind
    assert redis.llen(KEYS.wakeups("carpool-tiny-normal")) == 1
    assert queue.claim(4) == []
    assert not redis.exists(KEYS.wakeups("carpool-tiny-normal"))
    assert not redis.exists(KEYS.wakeups("carpool-tiny-high"))
    assert queue.wait(0.05) is False  # an idle worker is not woken for jobs that are gone
    submit(redis, "job-3", priority=Priority.LOW)  # and the next job is claimed as before
    assert [c.lease.job_id for c in queue.claim(4)] == ["job-3"]


def test_a_worker_claims_only_its_own_models_jobs() -> None:
    redis = fake_redis()
    submit(redis, "other-1", model="other")
    submit(redis, "mine-1")
    submit(redis, "other-2", model="other", priority=Priority.HIGH)
    mine = make_queue(redis)
    assert [c.lease.job_id for c in mine.claim(4)] == ["mine-1"]
    assert mine.wait(0.05) is False  # the other model's wake-ups are not this worker's
    assert Queue("carpool-other-normal", connection=redis).job_ids == ["other-1"]
    scripts = JobScripts()
    scripts.load(redis)
    theirs = JobQueue(redis, scripts, KEYS, "w2", "other", 10_000, execution_ttl_s=120,
                      block_size=BLOCK_SIZE)
    assert theirs.wait(0.05) is True
    claims = theirs.claim(4)
    assert [(c.lease.job_id, c.lease.queue_name) for c in claims] == [
        ("other-2", "carpool-other-high"), ("other-1", "carpool-other-normal")]
    assert [c.spec.model for c in claims] == ["other", "other"]


def test_decode_spec_explains_bad_payloads() -> None:
    redis = fake_redis()
    import pytest

    with pytest.raises(ValueError, match="not rq JSON"):
        decode_spec("j", b"\x80\x04pickle", redis)
    with pytest.raises(ValueError, match="exactly one argument"):
        decode_spec("j", b'["f", null, [], {}]', redis)
    with pytest.raises(ValueError, match="names job 'other'"):
        decode_spec("j", b'["f", null, [{"job_id": "other", "model": "m", "prompt": "x"}], {}]',
                    redis)


def test_claim_survives_a_flushed_script_cache() -> None:
    redis = fake_redis()
    submit(redis, "job-1")
    queue = make_queue(redis)
    redis.script_flush()
    assert [c.lease.job_id for c in queue.claim(1)] == ["job-1"]


def test_claim_carries_each_jobs_own_retention() -> None:
    redis = fake_redis()
    submit_job(redis, make_spec("short"), result_ttl=50, failure_ttl=70)
    submit(redis, "default")
    short, default = make_queue(redis).claim(2)
    assert (short.result_ttl, short.failure_ttl) == (50, 70)
    assert (default.result_ttl, default.failure_ttl) == (24 * 3600, 7 * 24 * 3600)


def test_claims_and_waits_take_nothing_while_rq_suspend_holds() -> None:
    """`rq suspend` (rq.suspension): a claim refuses, its queues, wake-ups and registries as
    they were; an idle wait says so; `rq resume` lets the next claim take the jobs."""
    redis = fake_redis()
    submit(redis, "job-1", "job-2")
    queue = make_queue(redis)
    suspend(redis)
    before = {key: redis.dump(key) for key in redis.keys("*")}
    with pytest.raises(WorkersSuspended):
        queue.claim(4)
    assert {key: redis.dump(key) for key in redis.keys("*")} == before
    with pytest.raises(WorkersSuspended):
        queue.wait(0.05)
    assert queue.is_suspended()
    # A job an rq worker already dequeued (it checks the suspension itself) is adopted anyway.
    redis.lpop(RQKeys.queue("carpool-tiny-normal"))
    assert [c.lease.job_id for c in queue.claim(0, adopt=("job-1", 1))] == ["job-1"]
    resume(redis)
    assert not queue.is_suspended()
    assert [c.lease.job_id for c in queue.claim(4)] == ["job-2"]
    assert JobReader(redis).state("job-2").status is JobStatus.RUNNING
