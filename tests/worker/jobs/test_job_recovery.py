"""Recovery: jobs whose lease lapsed go back to the front of their queue, RQ's cleanup undone."""

from __future__ import annotations

from rq import Queue
from rq.job import Job
from rq.job import JobStatus as RQJobStatus
from rq.registry import FailedJobRegistry, StartedJobRegistry

from protocol import JobReader, JobStatus
from tests.worker.jobs.job_support import (
    KEYS,
    expire_lease,
    fake_redis,
    generate,
    make_publisher,
    make_queue,
    running,
    submit,
)


def _recover(queue) -> list[str]:
    pub = make_publisher(queue)
    pub.recover()
    return pub.flush().recovered


def test_a_lapsed_lease_puts_the_job_back_at_the_front() -> None:
    redis = fake_redis()
    submit(redis, "job-1", "job-2", "job-3")
    dead = make_queue(redis, worker="dead")
    first, second = dead.claim(2)
    pub = make_publisher(dead)
    job = running(first)
    generate(job, 11)
    pub.append(job)
    pub.flush()
    expire_lease(redis, "job-1")
    expire_lease(redis, "job-2")
    survivor = make_queue(redis, worker="survivor")
    assert sorted(_recover(survivor)) == ["job-1", "job-2"]
    assert Queue("carpool-tiny-normal", connection=redis).job_ids[-1] == "job-3"
    assert set(Queue("carpool-tiny-normal", connection=redis).job_ids[:2]) == {"job-1", "job-2"}
    # Each requeued job rang for idle workers (job-3's wake-up was trimmed by the claim).
    assert redis.llen(KEYS.wakeups("carpool-tiny-normal")) == 3
    reader = JobReader(redis)
    # job-1 has tokens in its stream: preempted (resumes); job-2 had none: queued.
    assert (reader.state("job-1").status, reader.state("job-2").status) == (
        JobStatus.PREEMPTED, JobStatus.QUEUED)
    assert reader.state("job-1").num_recoveries == 1
    assert Job.fetch("job-1", redis).get_status() == RQJobStatus.QUEUED
    assert StartedJobRegistry("carpool-tiny-normal", connection=redis).get_job_ids() == []
    assert redis.zcard(KEYS.leases()) == 0
    assert _recover(survivor) == []


def test_a_live_lease_is_left_alone_even_if_its_deadline_lagged() -> None:
    redis = fake_redis()
    submit(redis, "job-1")
    queue = make_queue(redis)
    queue.claim(1)
    redis.zadd(KEYS.leases(), {"job-1": 1})  # stale deadline, lease key still alive
    assert _recover(queue) == []
    assert redis.zscore(KEYS.leases(), "job-1") > 1
    assert JobReader(redis).state("job-1").status is JobStatus.RUNNING


def test_recovery_undoes_rqs_abandoned_job_cleanup() -> None:
    redis = fake_redis()
    submit(redis, "job-1")
    make_queue(redis, worker="dead").claim(1)
    expire_lease(redis, "job-1")
    # An rq worker's maintenance ran first and moved the abandoned job to the FailedJobRegistry.
    StartedJobRegistry("carpool-tiny-normal", connection=redis).cleanup(timestamp=10**10)
    assert Job.fetch("job-1", redis).get_status() == RQJobStatus.FAILED
    assert _recover(make_queue(redis, worker="survivor")) == ["job-1"]
    assert Job.fetch("job-1", redis).get_status() == RQJobStatus.QUEUED
    assert "job-1" not in FailedJobRegistry("carpool-tiny-normal", connection=redis)
    assert redis.ttl("rq:job:job-1") == -1
    assert Queue("carpool-tiny-normal", connection=redis).job_ids == ["job-1"]


def test_ended_jobs_just_leave_the_leases_set() -> None:
    redis = fake_redis()
    submit(redis, "job-1")
    make_queue(redis).claim(1)
    redis.hset(KEYS.state("job-1"), "status", "finished")
    expire_lease(redis, "job-1")
    assert _recover(make_queue(redis)) == []
    assert redis.zcard(KEYS.leases()) == 0
    assert Queue("carpool-tiny-normal", connection=redis).count == 0
