"""A worker with a stream interval (CARPOOL_STREAM_INTERVAL_MS) publishes every few steps: the
real worker loop around a synthetic engine, on fakeredis. A job's first token goes at once, the
tokens of the steps in between go as one entry per job, and nothing is lost or doubled whether
the job finishes, expires or gives its seat to a higher tier."""

from __future__ import annotations

import time

import fakeredis
import pytest
from pydantic import ValidationError

from protocol import JobReader, JobSpec, JobStatus, Priority, SamplingParams, submit_jobs
from protocol.generation import FinishReason
from tests.worker.jobs.job_support import KEYS
from tests.worker.jobs.synthetic_worker import PooledEngine, running_worker, wait_for
from worker.engine.synthetic_engine import SYNTHETIC_TEXT, SyntheticEngine, synthetic_token_id
from worker.jobs.settings import WorkerSettings


def test_steps_between_publishes_go_as_one_entry_per_job_and_read_back_token_by_token() -> None:
    redis = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    with running_worker(redis, SyntheticEngine(2, 0.002), "w-interval", max_num_seqs=2,
                        stream_interval_ms=200):
        specs = [JobSpec(job_id=f"j{i}", model="synthetic", prompt="Hi",
                         sampling=SamplingParams(max_tokens=60)) for i in range(2)]
        submit_jobs(redis, specs)
        reader = JobReader(redis)
        states = wait_for(lambda: (s := [reader.state(x.job_id) for x in specs])
                          and all(st.status.is_final for st in s) and s)
    for spec, state in zip(specs, states):
        assert state.status is JobStatus.FINISHED
        raw = redis.xrange(KEYS.stream(spec.job_id))
        # The first token alone (time to first token), then runs: fewer entries than tokens.
        assert raw[0] == (b"0-1", {b"kind": b"token", b"index": b"0",
                                   b"token_id": str(synthetic_token_id(0)).encode(),
                                   b"text": SYNTHETIC_TEXT.encode()})
        assert b"tokens" in {fields[b"kind"] for _, fields in raw}
        assert len(raw) < 61
        read = reader.read(spec.job_id)
        assert [(t.index, t.token_id, t.text) for t in read.tokens] == [
            (i, synthetic_token_id(i), SYNTHETIC_TEXT) for i in range(60)]
        assert (read.done.finish_reason, read.done.completion_tokens) == (FinishReason.LENGTH, 60)
        assert list(state.token_ids) == [synthetic_token_id(i) for i in range(60)]


def test_a_job_past_its_deadline_ends_with_every_token_it_generated_in_its_stream() -> None:
    redis = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    with running_worker(redis, SyntheticEngine(1, 0.005), "w-interval", max_num_seqs=1,
                        stream_interval_ms=400):
        spec = JobSpec(job_id="late", model="synthetic", prompt="Hi",
                       sampling=SamplingParams(max_tokens=100_000), deadline_at=time.time() + 0.3)
        submit_jobs(redis, [spec])
        reader = JobReader(redis)
        state = wait_for(lambda: (s := reader.state("late")).status.is_final and s)
    assert state.finish_reason is FinishReason.EXPIRED
    tokens = reader.tokens("late")
    assert state.completion_tokens == len(tokens) > 1
    assert [t.token_id for t in tokens] == [synthetic_token_id(i) for i in range(len(tokens))]
    assert reader.read("late").done.completion_tokens == len(tokens)


def test_batch_jobs_preempted_with_tokens_unpublished_resume_exactly() -> None:
    redis = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    # As test_job_batch_tier, with publishes every 100 ms: the preempted jobs hold unsent tokens.
    with running_worker(redis, PooledEngine(3, 0.01, num_blocks=4), "w-interval", max_num_seqs=3,
                        stream_interval_ms=100):
        batch = [JobSpec(job_id=f"batch-{i}", model="synthetic", prompt="Say 0",
                         sampling=SamplingParams(max_tokens=150, temperature=0.0),
                         priority=Priority.BATCH) for i in range(2)]
        submit_jobs(redis, batch)
        reader = JobReader(redis)
        wait_for(lambda: all(len(reader.tokens(s.job_id)) >= 20 for s in batch))
        submit_jobs(redis, [JobSpec(job_id="urgent", model="synthetic", prompt="Now",
                                    sampling=SamplingParams(max_tokens=5),
                                    priority=Priority.HIGH)])
        states = wait_for(lambda: (s := [reader.state(x.job_id) for x in batch])
                          and all(st.status.is_final for st in s) and s, timeout=60)
        assert reader.state("urgent").status is JobStatus.FINISHED
    assert sum(s.num_preemptions for s in states) >= 1
    for state in states:
        assert state.status is JobStatus.FINISHED
        assert list(state.token_ids) == [synthetic_token_id(i) for i in range(150)]
        assert reader.token_ids(state.job_id) == list(state.token_ids)


def test_an_interval_leases_could_not_survive_is_refused_by_name() -> None:
    with pytest.raises(ValidationError, match="CARPOOL_STREAM_INTERVAL_MS"):
        WorkerSettings(model="synthetic", lease_seconds=1.0, stream_interval_ms=100)
    assert WorkerSettings(model="synthetic", lease_seconds=1.6,
                          stream_interval_ms=100).stream_interval_ms == 100
