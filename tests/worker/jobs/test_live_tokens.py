"""Live tokens (CARPOOL_DURABLE_INTERVAL_MS, protocol/stream_steps.py): between two writes of a
job's stream its tokens reach subscribers through the step notifications only; the stream gets
them as one entry once due, before the job's end or requeue, and from the dead owner's live
journal when recovery requeues the job."""

from __future__ import annotations

import math

import fakeredis
import pytest
from pydantic import ValidationError
from redis import Redis

from protocol import FinishReason, JobReader, JobStatus
from protocol.stream_steps import LIVE_WINDOW_MS, notified_final, notified_tokens
from tests.step_notes import listen, notes_of
from tests.worker.jobs.job_support import (
    KEYS,
    assert_awkward_texts,
    expire_lease,
    fake_redis,
    generate,
    make_queue,
    publish_awkward_texts,
    run_entry,
    running,
    submit,
    token_entry,
)
from worker.jobs.job_queue import JobQueue
from worker.jobs.running_job import RunningJob
from worker.jobs.settings import WorkerSettings
from worker.jobs.stream_publisher import JobEnd, StreamPublisher

STREAM = KEYS.stream("job-1")


def _publisher(queue: JobQueue, interval_s: float = 60.0) -> StreamPublisher:
    return StreamPublisher(queue.redis, queue.scripts, KEYS, queue.worker_name, queue.lease_ms,
                           durable_interval_s=interval_s)


def _claim(redis: Redis, worker: str = "w1") -> tuple[RunningJob, StreamPublisher]:
    queue = make_queue(redis, worker=worker)
    return running(queue.claim(1)[0]), _publisher(queue)


def _publish(pub: StreamPublisher, job: RunningJob, *token_ids: int):
    generate(job, *token_ids)
    pub.append(job)
    return pub.flush()


def _notified(redis: Redis) -> list[list[tuple[str, list[tuple[str, str, str]]]]]:
    """Each step notification's tokens: per stream, (entry id, index, token id)."""
    return [[(stream, [(entry_id, fields["index"], fields["token_id"]) for entry_id, fields in
                       entries]) for stream, entries in notified_tokens(raw)]
            for raw in notes_of(redis)]


def test_live_tokens_are_notified_at_each_publish_and_written_to_the_stream_once_due() -> None:
    redis = fake_redis()
    submit(redis, "job-1")
    job, pub = _claim(redis)
    _publish(pub, job, 11)  # the first token goes to the stream at once
    assert redis.xrange(STREAM) == [token_entry(0, 11)]
    _publish(pub, job, 12)
    _publish(pub, job, 13)
    assert redis.xrange(STREAM) == [token_entry(0, 11)]  # not yet due: notified only
    assert _notified(redis) == [[(STREAM, [("0-1", "0", "11")])], [(STREAM, [("0-2", "1", "12")])],
                                [(STREAM, [("0-3", "2", "13")])]]
    assert redis.xlen(KEYS.live_journal("w1")) == 2
    assert 0 < redis.pttl(KEYS.live_journal("w1"))
    job.stream_complete_at -= 61  # due
    _publish(pub, job, 14)
    # One entry for the live tokens and the new one; the notification carries only the new one.
    assert redis.xrange(STREAM) == [token_entry(0, 11), run_entry(1, 12, 13, 14)]
    assert _notified(redis)[-1] == [(STREAM, [("0-4", "3", "14")])]
    assert redis.xlen(KEYS.live_journal("w1")) == 2  # a publish with no live job adds nothing
    _publish(pub, job, 15)  # live again: the stream is complete as of the last publish
    assert redis.xrange(STREAM)[-1] == run_entry(1, 12, 13, 14)
    assert [t.token_id for t in JobReader(redis).tokens("job-1")] == [11, 12, 13, 14]


def test_an_end_writes_the_live_tokens_before_the_final_entry() -> None:
    redis = fake_redis()
    submit(redis, "job-1")
    job, pub = _claim(redis)
    _publish(pub, job, 11)
    _publish(pub, job, 12)
    generate(job, 13)
    pub.append(job)  # live at first, then it finishes in the same publish
    pub.finish(job, JobEnd(JobStatus.FINISHED, FinishReason.LENGTH))
    report = pub.flush()
    assert report.ended == {"job-1": JobStatus.FINISHED}
    raw = redis.xrange(STREAM)
    assert raw[:2] == [token_entry(0, 11), run_entry(1, 12, 13)]
    assert raw[2][0] == b"0-4" and raw[2][1][b"kind"] == b"done"
    assert raw[2][1][b"completion_tokens"] == b"3"
    assert _notified(redis)[-2] == [(STREAM, [("0-3", "2", "13")])]  # 12 went live before
    # The final entry goes to the hubs whole (`f`), after the step's tokens.
    assert notified_final(notes_of(redis)[-1]) == (STREAM, ("0-4", {
        k.decode(): v.decode() for k, v in raw[2][1].items()}))


def test_a_preempted_live_job_takes_its_tokens_into_the_stream() -> None:
    redis = fake_redis()
    submit(redis, "job-1")
    job, pub = _claim(redis)
    _publish(pub, job, 11)
    _publish(pub, job, 12)
    pub.requeue(job, count_as_preemption=True)
    assert pub.flush().requeued == {"job-1"}
    assert redis.xrange(STREAM) == [token_entry(0, 11), token_entry(1, 12)]
    resumed, _ = _claim(redis, "w2")
    assert resumed.token_ids == [11, 12]


def test_tokens_past_the_live_window_are_not_notified_and_go_to_the_stream_next() -> None:
    redis = fake_redis()
    submit(redis, "job-1")
    job, pub = _claim(redis)
    _publish(pub, job, 11)
    # Redis last saw the stream complete longer ago than the window (a stalled worker, a clock
    # apart): the script refuses to notify, without dropping the job.
    job.stream_complete_ms -= LIVE_WINDOW_MS + 1
    report = _publish(pub, job, 12)
    assert report.refused == set() and job.unpublished and job.num_notified == 0
    assert len(_notified(redis)) == 1
    assert job.stream_complete_at == -math.inf
    _publish(pub, job, 13)
    assert redis.xrange(STREAM) == [token_entry(0, 11), run_entry(1, 12, 13)]
    assert _notified(redis)[-1] == [(STREAM, [("0-2", "1", "12"), ("0-3", "2", "13")])]


@pytest.fixture(params=["fakeredis", "redis"])
def any_redis(request: pytest.FixtureRequest) -> Redis:
    if request.param == "fakeredis":
        return listen(fakeredis.FakeRedis(server=fakeredis.FakeServer()))
    return listen(Redis.from_url(request.getfixturevalue("redis_url")))


def test_recovery_writes_a_dead_workers_live_tokens_into_the_streams_first(any_redis) -> None:
    redis = any_redis
    submit(redis, "job-1", "job-2")
    queue = make_queue(redis, worker="dead")
    jobs = [running(claim) for claim in queue.claim(2)]
    pub = _publisher(queue)
    publish_awkward_texts(pub, jobs)
    assert [len(redis.xrange(KEYS.stream(j.job_id))) for j in jobs] == [1, 1]  # the rest live
    for job in jobs:
        expire_lease(redis, job.job_id)
    survivor = _publisher(make_queue(redis, worker="survivor"))
    survivor.recover()
    assert sorted(survivor.flush().recovered) == ["job-1", "job-2"]
    reader = JobReader(redis)
    assert_awkward_texts(reader, jobs)
    assert {reader.state(job.job_id).status for job in jobs} == {JobStatus.PREEMPTED}
    # The new owner resumes after them. The old one can notify nothing more: recovery took its
    # live fence, so its live tokens go nowhere, and the write of its stream that follows is
    # refused by the job's lease.
    assert redis.exists(KEYS.live_fence("dead")) == 0
    resumed = [running(claim) for claim in make_queue(redis, worker="w2").claim(2)]
    assert sorted(r.token_ids for r in resumed) == [[100, 101, 102, 103]] * 2
    before = len(notes_of(redis))
    generate(jobs[0], 999)
    pub.append(jobs[0])
    assert pub.flush().refused == set()
    assert (len(jobs[0].unpublished), jobs[0].num_notified) == (4, 3)  # 999 not notified
    pub.append(jobs[0])
    assert pub.flush().refused == {"job-1"}
    assert len(notes_of(redis)) == before
    assert reader.tokens("job-1")[-1].token_id == 103


def test_recovery_skips_journal_tokens_the_stream_already_holds() -> None:
    redis = fake_redis()
    submit(redis, "job-1")
    job, pub = _claim(redis, "dead")
    _publish(pub, job, 11)
    _publish(pub, job, 12)  # live, journaled
    job.stream_complete_at -= 61
    _publish(pub, job, 13)  # due: 12 and 13 into the stream
    _publish(pub, job, 14)  # live again
    expire_lease(redis, "job-1")
    survivor = _publisher(make_queue(redis, worker="survivor"))
    survivor.recover()
    assert survivor.flush().recovered == ["job-1"]
    assert redis.xrange(STREAM) == [token_entry(0, 11), run_entry(1, 12, 13), run_entry(3, 14)]


def test_a_worker_stopping_cleanly_deletes_its_journal_but_not_after_dropping_jobs() -> None:
    redis = fake_redis()
    submit(redis, "job-1")
    job, pub = _claim(redis)
    _publish(pub, job, 11)  # a renewal: the live fence is set
    _publish(pub, job, 12)  # live: journaled
    journal, fence = KEYS.live_journal("w1"), KEYS.live_fence("w1")
    assert redis.exists(journal, fence) == 2
    assert 0 < redis.pttl(fence) <= 10_000  # as long as the leases it vouches for
    pub.discard()  # Redis was out of reach for a lease: jobs dropped, the journal is needed
    pub.forget_live()
    assert redis.exists(journal, fence) == 2
    _publisher(make_queue(redis)).forget_live()  # the same worker, stopping with no job
    assert redis.exists(journal, fence) == 0


def test_a_durable_interval_past_the_live_window_or_below_zero_is_refused_by_name() -> None:
    # The append script refuses to notify a job whose stream is older than LIVE_WINDOW_MS: the
    # interval must leave a second of room below it (a step's time, clocks apart).
    for refused in (LIVE_WINDOW_MS - 999, -1):
        with pytest.raises(ValidationError, match="durable_interval_ms"):
            WorkerSettings(model="synthetic", durable_interval_ms=refused)
    assert WorkerSettings(model="synthetic").durable_interval_ms == 500
    assert WorkerSettings(model="synthetic",
                          durable_interval_ms=LIVE_WINDOW_MS - 1000).durable_interval_ms == 4000
