"""Fenced writes: only the lease holder appends, finishes or requeues; the finish guard."""

from __future__ import annotations

import time

import pytest
from rq import Queue, Worker
from rq.job import Job
from rq.job import JobStatus as RQJobStatus
from rq.registry import (
    CanceledJobRegistry,
    FailedJobRegistry,
    FinishedJobRegistry,
    StartedJobRegistry,
)
from rq.results import Result
from rq.serializers import JSONSerializer

from protocol import (
    FinishReason,
    JobReader,
    JobStatus,
    StreamEntry,
    TokenEntry,
    TokenLogprobs,
    cancel_job,
)
from protocol.rq_keys import RQKeys
from protocol.token_runs import expand_runs
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
from worker.jobs import stream_publisher
from worker.jobs.stream_publisher import JobEnd


def _stream(redis, job_id: str) -> list[tuple[str, StreamEntry]]:
    """The stream as readers see it: one entry per token (runs expanded)."""
    return [(i.decode() if isinstance(i, bytes) else i, StreamEntry.from_fields(f))
            for i, f in expand_runs(redis.xrange(KEYS.stream(job_id)))]


def test_append_writes_explicit_ids_and_renews_the_lease() -> None:
    redis = fake_redis()
    job, pub = claim_one(redis, lease_ms=5000)
    redis.pexpire(KEYS.lease("job-1"), 100)
    generate(job, 11, 12)
    pub.append(job)
    report = pub.flush()
    assert report.refused == set()
    assert [(i, e.index, e.token_id, e.text) for i, e in _stream(redis, "job-1")] == [
        ("0-1", 0, 11, "<11>"), ("0-2", 1, 12, "<12>")]
    assert redis.pttl(KEYS.lease("job-1")) > 4000
    state = JobReader(redis).state("job-1")
    assert (state.prompt_tokens, state.first_token_at) == (3, 2000.0)


def test_a_resent_append_is_written_once() -> None:
    # A round trip whose reply was lost is resent as it was: its entries are there already.
    redis = fake_redis()
    job, pub = claim_one(redis)
    generate(job, 11, 12)
    sent = list(job.unpublished)
    pub.append(job)
    pub.flush()
    job.unpublished = sent  # the run of two, again
    pub.append(job)
    assert pub.flush().refused == set()
    generate(job, 13)
    sent = list(job.unpublished)
    pub.append(job)
    pub.flush()
    job.unpublished = sent  # one token, again
    pub.append(job)
    assert pub.flush().refused == set()
    assert [i for i, _ in redis.xrange(KEYS.stream("job-1"))] == [b"0-2", b"0-3"]
    assert [e.token_id for _, e in _stream(redis, "job-1")] == [11, 12, 13]


def test_a_zombie_whose_lease_was_taken_over_cannot_write() -> None:
    redis = fake_redis()
    submit(redis, "job-1")
    zombie_queue = make_queue(redis, worker="zombie")
    zombie = running(zombie_queue.claim(1)[0])
    zombie_pub = make_publisher(zombie_queue)
    generate(zombie, 11)
    zombie_pub.append(zombie)
    zombie_pub.flush()
    # The zombie pauses; its lease lapses; recovery requeues; another worker takes over.
    expire_lease(redis, "job-1")
    other_queue = make_queue(redis, worker="other")
    other_pub = make_publisher(other_queue)
    other_pub.recover()
    assert other_pub.flush().recovered == ["job-1"]
    (claim,) = other_queue.claim(1)
    assert claim.lease.token == "2"
    assert [t.token_id for t in claim.tokens] == [11]
    # The zombie wakes up: every write it tries is refused and changes nothing.
    before = redis.xrange(KEYS.stream("job-1"))
    generate(zombie, 12)
    zombie_pub.append(zombie)
    assert zombie_pub.flush().refused == {"job-1"}
    zombie_pub.finish(zombie, JobEnd(JobStatus.FINISHED, FinishReason.STOP))
    zombie_pub.requeue(zombie, count_as_preemption=True)
    report = zombie_pub.flush()
    assert report.refused == {"job-1"} and report.ended == {} and report.requeued == set()
    assert redis.xrange(KEYS.stream("job-1")) == before
    assert redis.get(KEYS.lease("job-1")) == b"2"
    assert JobReader(redis).state("job-1").worker == "other"
    assert Queue("carpool-tiny-normal", connection=redis).count == 0
    # The new owner continues at index 1.
    owner = running(claim)
    generate(owner, 12)
    other_pub.append(owner)
    assert other_pub.flush().refused == set()
    assert [(i, e.token_id) for i, e in _stream(redis, "job-1")] == [("0-1", 11), ("0-2", 12)]


def test_finish_records_the_result_everywhere_rq_looks() -> None:
    redis = fake_redis()
    Worker(["carpool-tiny-normal"], name="w1", connection=redis).register_birth()
    submit(redis, "job-1")
    queue = make_queue(redis, worker="w1")
    claim = queue.claim(1)[0]
    job = running(claim, num_prompt_tokens=4)
    pub = make_publisher(queue)
    generate(job, 11, 12, 13)
    pub.append(job)
    pub.finish(job, JobEnd(JobStatus.FINISHED, FinishReason.LENGTH), now=3000.0)
    report = pub.flush()
    assert report.ended == {"job-1": JobStatus.FINISHED}
    ids, entries = zip(*_stream(redis, "job-1"))
    assert ids == ("0-1", "0-2", "0-3", "0-4")
    assert entries[-1] == StreamEntry(kind="done", finish_reason=FinishReason.LENGTH,
                                      prompt_tokens=4, completion_tokens=3)
    state = JobReader(redis).state("job-1")
    assert (state.status, state.finish_reason, state.text, state.token_ids, state.finished_at) == (
        JobStatus.FINISHED, FinishReason.LENGTH, "<11><12><13>", (11, 12, 13), 3000.0)
    rq_job = Job.fetch("job-1", redis, serializer=JSONSerializer)
    assert rq_job.get_status() == RQJobStatus.FINISHED
    value = rq_job.return_value()
    assert (value["token_ids"], value["text"], value["finish_reason"], value["status"]) == (
        [11, 12, 13], "<11><12><13>", "length", "finished")
    assert value["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    assert (value["created_at"], value["finished_at"]) == (1000.0, 3000.0)
    result = rq_job.latest_result()
    assert result.type == Result.Type.SUCCESSFUL and result.execution_id == claim.lease.execution_id
    assert "job-1" in FinishedJobRegistry("carpool-tiny-normal", connection=redis)
    assert StartedJobRegistry("carpool-tiny-normal", connection=redis).get_job_ids() == []
    assert rq_job.get_executions() == []
    execution_key = RQKeys.execution("job-1", claim.lease.execution_id)
    assert redis.exists(KEYS.lease("job-1"), execution_key) == 0
    assert redis.zcard(KEYS.leases()) == 0
    assert redis.scard(RQKeys.worker_executions("w1")) == 0
    for key in (KEYS.stream("job-1"), KEYS.state("job-1"), RQKeys.job("job-1"),
                KEYS.fence("job-1")):
        assert 0 < redis.ttl(key) <= claim.result_ttl
    (worker,) = Worker.all(connection=redis)
    assert (worker.successful_job_count, worker.failed_job_count) == (1, 0)


def test_the_finish_guard_turns_a_late_finish_of_a_canceled_job_into_canceled() -> None:
    redis = fake_redis()
    job, pub = claim_one(redis)
    assert cancel_job(redis, "job-1") is JobStatus.RUNNING
    generate(job, 11)
    pub.append(job)
    pub.finish(job, JobEnd(JobStatus.FINISHED, FinishReason.STOP))
    assert pub.flush().ended == {"job-1": JobStatus.CANCELED}
    assert _stream(redis, "job-1")[-1] == ("0-2", StreamEntry(
        kind="done", finish_reason=FinishReason.CANCELED, prompt_tokens=3, completion_tokens=1))
    assert JobReader(redis).state("job-1").status is JobStatus.CANCELED
    assert Job.fetch("job-1", redis).get_status() == RQJobStatus.CANCELED
    assert "job-1" in CanceledJobRegistry("carpool-tiny-normal", connection=redis)
    assert not redis.sismember(KEYS.canceled(), "job-1")
    # Neither a success nor a failure in rq's worker counts (`rq info`).
    assert redis.hmget(RQKeys.worker("w1"), "successful_job_count", "failed_job_count") == [
        None, None]
    # And nothing can finish it again.
    pub.finish(job, JobEnd(JobStatus.FINISHED, FinishReason.STOP))
    assert pub.flush().refused == {"job-1"}


def test_a_failed_job_carries_its_message_to_rq_jobstate_and_stream() -> None:
    redis = fake_redis()
    job, pub = claim_one(redis, num_prompt_tokens=0)
    pub.finish(job, JobEnd(JobStatus.FAILED, FinishReason.ERROR, "prompt too long"))
    assert pub.flush().ended == {"job-1": JobStatus.FAILED}
    assert _stream(redis, "job-1") == [("0-1", StreamEntry(
        kind="done", finish_reason=FinishReason.ERROR, error="prompt too long"))]
    state = JobReader(redis).state("job-1")
    assert (state.status, state.error) == (JobStatus.FAILED, "prompt too long")
    rq_job = Job.fetch("job-1", redis, serializer=JSONSerializer)
    assert rq_job.get_status() == RQJobStatus.FAILED
    assert rq_job.latest_result().exc_string == "prompt too long"
    assert "job-1" in FailedJobRegistry("carpool-tiny-normal", connection=redis)


def test_requeue_puts_the_job_at_the_front_and_the_next_claim_resumes_it() -> None:
    redis = fake_redis()
    submit(redis, "job-1", "job-2")
    queue = make_queue(redis)
    job = running(queue.claim(1)[0], num_prompt_tokens=5)
    pub = make_publisher(queue)
    generate(job, 11, 12)
    pub.append(job)
    pub.flush()
    pub.requeue(job, count_as_preemption=True)
    assert pub.flush().requeued == {"job-1"}
    assert Queue("carpool-tiny-normal", connection=redis).job_ids == ["job-1", "job-2"]
    assert redis.llen(KEYS.wakeups("carpool-tiny-normal")) == 2  # idle workers wake for it
    state = JobReader(redis).state("job-1")
    assert (state.status, state.num_preemptions, state.prompt_tokens) == (
        JobStatus.PREEMPTED, 1, 5)
    assert Job.fetch("job-1", redis).get_status() == RQJobStatus.QUEUED
    assert StartedJobRegistry("carpool-tiny-normal", connection=redis).get_job_ids() == []
    assert redis.exists(KEYS.lease("job-1")) == 0
    (again,) = make_queue(redis, worker="w2").claim(1)
    assert (again.lease.job_id, again.lease.token) == ("job-1", "2")
    assert [t.token_id for t in again.tokens] == [11, 12]


def test_running_job_insists_on_consecutive_token_indices() -> None:
    import pytest

    redis = fake_redis()
    submit(redis, "job-1")
    job = running(make_queue(redis).claim(1)[0])
    generate(job, 11)
    with pytest.raises(ValueError, match="engine produced token index 3, expected 1"):
        job.add_tokens([TokenEntry(3, 12, "x")], now=1.0)


def test_leases_are_renewed_an_eighth_of_a_lease_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    redis = fake_redis()
    job, pub = claim_one(redis, lease_ms=8000)  # renewed at the first flush 1 s after the last
    leases = []
    for offset_s in (0.0, 0.5, 1.1):
        now = time.monotonic() + offset_s
        monkeypatch.setattr(stream_publisher.time, "monotonic", lambda now=now: now)
        redis.pexpire(KEYS.lease("job-1"), 5000)
        generate(job, 11)
        pub.append(job)
        assert pub.flush().refused == set()
        job.unpublished.clear()
        leases.append(redis.pttl(KEYS.lease("job-1")) > 7000)
    assert leases == [True, False, True]
    assert [i.decode() for i, _ in redis.xrange(KEYS.stream("job-1"))] == ["0-1", "0-2", "0-3"]


def test_logprobs_ride_in_the_token_entries_through_a_resent_append() -> None:
    redis = fake_redis()
    submit(redis, "job-1", "job-2")
    queue = make_queue(redis)
    job, other = (running(claim) for claim in queue.claim(2))
    pub = make_publisher(queue)
    first = TokenLogprobs(-0.5, ((11, -0.5), (3, -1.25)))
    second = TokenLogprobs(-2.0, ())
    job.add_tokens([TokenEntry(0, 11, "a", first)], now=2000.0)
    generate(other, 7)  # a job without logprobs in the same script call
    pub.append(job)
    pub.append(other)
    pub.flush()
    # A retry overlapping the last write: the entry already there is kept, not doubled.
    job.unpublished = [TokenEntry(0, 11, "a", first), TokenEntry(1, 12, "b", second)]
    pub.append(job)
    assert pub.flush().refused == set()
    entries = [e for _, e in _stream(redis, "job-1")]
    assert [(e.index, e.token_id, e.logprobs) for e in entries] == [(0, 11, first), (1, 12, second)]
    assert JobReader(redis).tokens("job-1") == entries
    assert [e.logprobs for _, e in _stream(redis, "job-2")] == [None]
    assert "lp" not in {k.decode() for k in redis.xrange(KEYS.stream("job-2"))[0][1]}


def test_an_ended_job_that_rq_requeues_runs_again_from_its_start() -> None:
    """rq's requeue (`rq requeue`, rq-dashboard, Job.requeue) of a failed or canceled job puts
    it back as queued: the next claim starts it over, its old end, result fields, stream and
    retention gone; an ended job's id left on a queue otherwise stays dropped."""
    redis = fake_redis()
    job, pub = claim_one(redis)
    generate(job, 11, 12)
    pub.append(job)
    pub.finish(job, JobEnd(JobStatus.FAILED, FinishReason.ERROR, "out of memory"))
    assert pub.flush().ended == {"job-1": JobStatus.FAILED}
    assert redis.ttl(KEYS.state("job-1")) > 0
    FailedJobRegistry("carpool-tiny-normal", connection=redis,
                      serializer=JSONSerializer).requeue("job-1")
    queue = make_queue(redis, worker="w2")
    (claim,) = queue.claim(4)
    assert (claim.lease.job_id, claim.lease.token, claim.restarted_from_shard) == ("job-1", "2", -1)
    assert claim.tokens == []
    state = JobReader(redis).state("job-1")
    assert (state.status, state.worker, state.error, state.finish_reason, state.text,
            state.token_ids, state.finished_at, state.first_token_at) == (
        JobStatus.RUNNING, "w2", "", None, "", (), 0.0, 0.0)
    assert state.started_at == claim.claimed_at
    assert redis.exists(KEYS.stream("job-1")) == 0
    assert (redis.ttl(KEYS.state("job-1")), redis.ttl(KEYS.fence("job-1"))) == (-1, -1)
    assert Job.fetch("job-1", redis).get_status() == RQJobStatus.STARTED
    # Run again to its end: a stream of this run only, rq's records as for any job.
    again = running(claim)
    generate(again, 21)
    pub2 = make_publisher(queue)
    pub2.append(again)
    pub2.finish(again, JobEnd(JobStatus.FINISHED, FinishReason.STOP))
    assert pub2.flush().ended == {"job-1": JobStatus.FINISHED}
    assert [entry.token_id for _, entry in _stream(redis, "job-1")[:-1]] == [21]
    assert JobReader(redis).state("job-1").token_ids == (21,)
    assert Job.fetch("job-1", redis).get_status() == RQJobStatus.FINISHED
    assert FailedJobRegistry("carpool-tiny-normal", connection=redis).count == 0
    # An ended job's id on a queue that rq did not requeue (its rq status is not queued) is a
    # stale one: the claim drops it.
    submit(redis, "job-2")
    assert cancel_job(redis, "job-2") is JobStatus.CANCELED
    assert Job.fetch("job-2", redis).get_status() == RQJobStatus.CANCELED
    redis.rpush(RQKeys.queue("carpool-tiny-normal"), "job-2")
    assert queue.claim(4) == []
    assert JobReader(redis).state("job-2").status is JobStatus.CANCELED
