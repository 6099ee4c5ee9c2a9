"""Live tokens on a stream shard (protocol/stream_steps.py, worker/jobs/shard_scripts.py): a job
streaming to a shard gets its tokens to subscribers through the shard's step notifications and
into its stream every durable interval, with the worker's live fence and journal on the shard;
the next claim's adoption writes a dead owner's live tokens into the stream first."""

from __future__ import annotations

import math

import fakeredis
import pytest
from redis import Redis

from protocol import FinishReason, JobReader, JobStatus
from protocol.stream_steps import LIVE_WINDOW_MS, notified_streams, notified_tokens
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
from worker.jobs.stream_publisher import JobEnd, StreamPublisher
from worker.jobs.stream_shards import StreamShards

STREAM = KEYS.stream("job-1")


class _Worker:
    """A worker whose every stream is on `shard`, with live tokens (a long durable interval:
    a test says when a stream is due)."""

    def __init__(self, main: Redis, shard: Redis, name: str) -> None:
        self.name = name
        self.queue: JobQueue = make_queue(main, worker=name)
        self.shards = StreamShards(main, [shard], self.queue.scripts, KEYS)
        self.shards.load_scripts()
        self.publisher = StreamPublisher(main, self.queue.scripts, KEYS, name,
                                         self.queue.lease_ms, shards=self.shards,
                                         durable_interval_s=60.0)

    def claim(self, n: int = 1) -> list[RunningJob]:
        return [running(c) for c in self.shards.adopt(self.queue.claim(n), self.name)]

    def publish(self, jobs: list[RunningJob], *token_ids: int):
        for job, token_id in zip(jobs, token_ids):
            generate(job, token_id)
            self.publisher.append(job)
        return self.publisher.flush()


def _notified(redis: Redis) -> list[list[tuple[str, list[tuple[str, str]]]]]:
    """Each step notification's tokens: per stream, (index, token id)."""
    return [[(stream, [(fields["index"], fields["token_id"]) for _, fields in entries])
             for stream, entries in notified_tokens(raw)] for raw in notes_of(redis)]


def test_live_tokens_go_through_the_shard_and_into_its_stream_once_due() -> None:
    main, shard = fake_redis(), fake_redis()
    submit(main, "job-1")
    worker = _Worker(main, shard, "w1")
    (job,) = worker.claim()
    worker.publish([job], 11)  # the first token to the stream at once; the live fence set
    assert shard.get(KEYS.live_fence("w1")) is not None
    worker.publish([job], 12)
    worker.publish([job], 13)
    assert shard.xrange(STREAM) == [token_entry(0, 11)]  # not yet due: notified only
    assert _notified(shard) == [[(STREAM, [("0", "11")])], [(STREAM, [("1", "12")])],
                                [(STREAM, [("2", "13")])]]
    assert shard.xlen(KEYS.live_journal("w1")) == 2
    assert 0 < shard.pttl(KEYS.live_journal("w1"))
    # The main Redis holds neither the stream nor a journal, nor got any step notification.
    assert main.exists(STREAM, KEYS.live_journal("w1")) == 0
    assert notes_of(main) == []
    job.stream_complete_at -= 61  # due
    worker.publish([job], 14)
    assert shard.xrange(STREAM) == [token_entry(0, 11), run_entry(1, 12, 13, 14)]
    assert _notified(shard)[-1] == [(STREAM, [("3", "14")])]
    assert shard.xlen(KEYS.live_journal("w1")) == 2  # a step with no live job journals nothing
    generate(job, 15)
    worker.publisher.append(job)  # live at first, then it finishes in the same step
    worker.publisher.finish(job, JobEnd(JobStatus.FINISHED, FinishReason.LENGTH))
    assert worker.publisher.flush().ended == {"job-1": JobStatus.FINISHED}
    raw = shard.xrange(STREAM)
    assert raw[:3] == [token_entry(0, 11), run_entry(1, 12, 13, 14), token_entry(4, 15)]
    assert raw[3][0] == b"0-6" and raw[3][1][b"kind"] == b"done"
    assert [t.token_id for t in JobReader(shard).tokens("job-1")] == [
        11, 12, 13, 14, 15]


def test_the_next_claim_writes_a_dead_owners_live_tokens_into_the_shards_stream(
        ) -> None:
    main, shard = fake_redis(), fake_redis()
    submit(main, "job-1", "job-2")
    dead = _Worker(main, shard, "dead")
    jobs = dead.claim(2)
    dead.publish(jobs, 11, 21)
    dead.publish(jobs, 12, 22)
    dead.publish(jobs, 13, 23)  # 12, 13 and 22, 23 live: in the journal on the shard only
    assert shard.xrange(STREAM) == [token_entry(0, 11)]
    expire_lease(main, "job-1")
    survivor = _Worker(main, shard, "survivor")
    survivor.publisher.recover()
    assert survivor.publisher.flush().recovered == ["job-1"]
    before = len(notes_of(shard))
    (resumed,) = survivor.claim()
    assert resumed.token_ids == [11, 12, 13]
    assert shard.xrange(STREAM) == [token_entry(0, 11), run_entry(1, 12, 13)]
    # Hubs are told to read it; the dead owner's live fence on the shard is gone.
    assert [notified_streams(raw) for raw in notes_of(shard)[before:]] == [[STREAM]]
    assert shard.exists(KEYS.live_fence("dead")) == 0
    assert shard.get(KEYS.stream_owner("job-1")) == b"survivor"
    # Were the old owner alive after all: its live tokens are notified nowhere (job-2's neither:
    # the fence vouched for both), then the write of its streams is refused for job-1 alone.
    before = len(notes_of(shard))
    report = dead.publish(jobs, 14, 24)
    assert report.refused == set() and len(notes_of(shard)) == before
    assert [job.num_notified for job in jobs] == [2, 2]  # 14 and 24 not notified
    for job in jobs:
        dead.publisher.append(job)  # no new token: the stream writes the live fence sent back
    assert dead.publisher.flush().refused == {"job-1"}
    assert shard.xrange(STREAM)[-1] == run_entry(1, 12, 13)
    assert shard.xrange(KEYS.stream("job-2"))[-1] == run_entry(1, 22, 23, 24)
    # The survivor continues after the tokens the subscribers got.
    assert survivor.publish([resumed], 14).refused == set()
    assert [t.token_id for t in JobReader(shard).tokens("job-1")] == [
        11, 12, 13, 14]


def test_a_renewal_that_finds_a_fence_copy_taken_leaves_no_live_fence() -> None:
    main, shard = fake_redis(), fake_redis()
    submit(main, "job-1", "job-2")
    old = _Worker(main, shard, "old")
    jobs = old.claim(2)
    old.publish(jobs, 11, 21)
    expire_lease(main, "job-1")
    new = _Worker(main, shard, "new")
    new.publisher.recover()
    new.publisher.flush()
    new.claim()
    old.publisher._renewed_at = -math.inf  # the old owner's next step renews
    assert old.publish(jobs, 12, 22).refused == {"job-1"}
    assert shard.exists(KEYS.live_fence("old")) == 0
    old.publish(jobs[1:], 23)  # a renewal with every fence copy held sets it again
    assert shard.exists(KEYS.live_fence("old")) == 0  # not a renewing step: nothing changes
    old.publisher._renewed_at = -math.inf
    old.publish(jobs[1:], 24)
    assert shard.get(KEYS.live_fence("old")) is not None


def test_tokens_past_the_live_window_are_not_notified_and_go_to_the_shards_stream_next(
        ) -> None:
    main, shard = fake_redis(), fake_redis()
    submit(main, "job-1")
    worker = _Worker(main, shard, "w1")
    (job,) = worker.claim()
    worker.publish([job], 11)
    job.stream_complete_ms -= LIVE_WINDOW_MS + 1  # by the shard's clock
    report = worker.publish([job], 12)
    assert report.refused == set() and job.num_notified == 0
    assert job.stream_complete_at == -math.inf
    assert len(notes_of(shard)) == 1
    worker.publish([job], 13)
    assert shard.xrange(STREAM) == [token_entry(0, 11), run_entry(1, 12, 13)]
    assert _notified(shard)[-1] == [(STREAM, [("1", "12"), ("2", "13")])]


@pytest.fixture(params=["fakeredis", "redis"])
def servers(request: pytest.FixtureRequest) -> tuple[Redis, Redis]:
    """The main Redis and a shard: two fakeredis servers, or two databases of a real one."""
    if request.param == "fakeredis":
        return fake_redis(), listen(fakeredis.FakeRedis(server=fakeredis.FakeServer()))
    url = request.getfixturevalue("redis_url")
    return Redis.from_url(url), Redis.from_url(url.rsplit("/", 1)[0] + "/1")


def test_live_texts_and_logprobs_reach_the_shards_stream_exactly(servers) -> None:
    main, shard = servers
    shard.flushdb()
    submit(main, "job-1", "job-2")
    dead = _Worker(main, shard, "dead")
    jobs = dead.claim(2)
    publish_awkward_texts(dead.publisher, jobs)
    assert [shard.xlen(KEYS.stream(j.job_id)) for j in jobs] == [1, 1]  # the rest live
    for job in jobs:
        expire_lease(main, job.job_id)
    survivor = _Worker(main, shard, "survivor")
    survivor.publisher.recover()
    assert sorted(survivor.publisher.flush().recovered) == ["job-1", "job-2"]
    resumed = survivor.claim(2)
    assert [r.token_ids for r in resumed] == [[100, 101, 102, 103]] * 2
    assert_awkward_texts(JobReader(shard), jobs)


def test_a_worker_stopping_cleanly_deletes_its_live_keys_on_the_shard() -> None:
    main, shard = fake_redis(), fake_redis()
    submit(main, "job-1")
    worker = _Worker(main, shard, "w1")
    (job,) = worker.claim()
    worker.publish([job], 11)
    worker.publish([job], 12)
    assert shard.exists(KEYS.live_journal("w1"), KEYS.live_fence("w1")) == 2
    worker.publisher.finish(job, JobEnd(JobStatus.FINISHED, FinishReason.LENGTH))
    worker.publisher.flush()
    worker.publisher.forget_live()
    assert shard.exists(KEYS.live_journal("w1"), KEYS.live_fence("w1")) == 0
