"""A publish that carries several tokens of a job (a worker with a stream interval) writes them as
one entry, a run (protocol/token_runs.py), on the main Redis and on a stream shard; readers get
one entry per token; a job leaving the batch takes its unsent tokens along (fakeredis)."""

from __future__ import annotations

import fakeredis

from protocol import FinishReason, JobReader, JobStatus, TokenEntry, TokenLogprobs
from protocol.token_runs import run_fields
from tests.worker.jobs.job_support import (
    KEYS,
    claim_one,
    fake_redis,
    generate,
    make_publisher,
    make_queue,
    running,
    submit,
)
from worker.jobs.stream_publisher import JobEnd, StreamPublisher
from worker.jobs.stream_shards import StreamShards


def _raw(redis: fakeredis.FakeRedis, job_id: str) -> list[tuple[str, dict[str, str]]]:
    return [(i.decode(), {k.decode(): v.decode() for k, v in f.items()})
            for i, f in redis.xrange(KEYS.stream(job_id))]


def test_several_tokens_of_a_publish_are_one_entry_exactly_as_run_fields_encodes_it() -> None:
    redis = fake_redis()
    job, pub = claim_one(redis)
    logprobs = [TokenLogprobs(-0.5, ((7, -0.5), (3, -1.25))), TokenLogprobs(-2.0, ((8, -2.0),)),
                TokenLogprobs(-0.125, ((9, -0.125),))]
    job.add_tokens([TokenEntry(0, 7, "a/", logprobs[0]), TokenEntry(1, 8, " é", logprobs[1]),
                    TokenEntry(2, 9, "\"\n", logprobs[2])], now=2000.0)
    pub.append(job)
    assert pub.flush().refused == set()
    ((entry_id, fields),) = _raw(redis, "job-1")
    assert entry_id == "0-3"
    assert fields == run_fields(0, [7, 8, 9], ["a/", " é", "\"\n"],
                                [lp.encode() for lp in logprobs])
    assert job.unpublished == []  # the flush landed: they are in the stream
    tokens = JobReader(redis).tokens("job-1")
    assert [(t.index, t.token_id, t.text, t.logprobs) for t in tokens] == [
        (0, 7, "a/", logprobs[0]), (1, 8, " é", logprobs[1]), (2, 9, "\"\n", logprobs[2])]
    # The next publish of one token writes the one-token entry after the run.
    generate(job, 10)
    pub.append(job)
    pub.flush()
    assert [i for i, _ in _raw(redis, "job-1")] == ["0-3", "0-4"]
    assert JobReader(redis).token_ids("job-1") == [7, 8, 9, 10]


def test_a_job_ended_or_requeued_with_tokens_unsent_takes_them_along() -> None:
    redis = fake_redis()
    submit(redis, "done", "preempted")
    queue = make_queue(redis)
    done, preempted = (running(claim) for claim in queue.claim(2))
    pub = make_publisher(queue)
    generate(done, 1, 2, 3)
    generate(preempted, 4, 5)
    # The worker left the batch's last steps unpublished and now ends one job, requeues the other,
    # without appending either (they left its batch).
    pub.finish(done, JobEnd(JobStatus.FINISHED, FinishReason.LENGTH))
    pub.requeue(preempted, count_as_preemption=True)
    report = pub.flush()
    assert (report.ended, report.requeued) == ({"done": JobStatus.FINISHED}, {"preempted"})
    reader = JobReader(redis)
    assert reader.token_ids("done") == [1, 2, 3]
    assert reader.read("done").done.completion_tokens == 3
    assert reader.state("done").token_ids == (1, 2, 3)
    assert reader.token_ids("preempted") == [4, 5]
    assert reader.state("preempted").status is JobStatus.PREEMPTED
    # Its next claim resumes after them.
    (resumed,) = queue.claim(1)
    assert [t.token_id for t in resumed.tokens] == [4, 5]


def test_a_stream_shard_takes_runs_too() -> None:
    main, shard = fake_redis(), fake_redis()
    submit(main, "job-1")
    queue = make_queue(main)
    shards = StreamShards(main, [shard], queue.scripts, KEYS)
    shards.load_scripts()
    pub = StreamPublisher(main, queue.scripts, KEYS, "w1", queue.lease_ms, shards=shards)
    (job,) = [running(claim) for claim in shards.adopt(queue.claim(1), queue.worker_name)]
    generate(job, 21, 22, 23)
    pub.append(job)
    assert pub.flush().refused == set()
    assert [(i, f["kind"], f["token_ids"]) for i, f in _raw(shard, "job-1")] == [
        ("0-3", "tokens", "21 22 23")]
    assert main.exists(KEYS.stream("job-1")) == 0
    pub.finish(job, JobEnd(JobStatus.FINISHED, FinishReason.STOP))
    pub.flush()
    assert JobReader(shard).token_ids("job-1") == [21, 22, 23]
    assert JobReader(shard).read("job-1").done.completion_tokens == 3
