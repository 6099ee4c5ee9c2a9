"""The batch tier gives way (fakeredis, the real worker loop around a synthetic engine with a
KV pool): a worker whose KV blocks batch jobs hold, with a seat free, preempts them for a
higher-tier job, and they resume exactly where they stopped."""

from __future__ import annotations

import fakeredis

from protocol import JobReader, JobSpec, JobStatus, Priority, SamplingParams, submit_jobs
from tests.worker.jobs.synthetic_worker import PooledEngine, running_worker, wait_for
from worker.engine.synthetic_engine import synthetic_token_id


def test_batch_jobs_holding_the_kv_pool_give_it_to_a_higher_tier_job() -> None:
    server = fakeredis.FakeServer()
    redis = fakeredis.FakeRedis(server=server)
    # Two batch jobs of 5 prompt tokens fill 4 blocks from their 12th token on; a seat stays free.
    with running_worker(redis, PooledEngine(3, 0.01, num_blocks=4), "kv-worker", max_num_seqs=3):
        long = SamplingParams(max_tokens=150, temperature=0.0)
        batch = [JobSpec(job_id=f"batch-{i}", model="synthetic", prompt="Say 0", sampling=long,
                         priority=Priority.BATCH) for i in range(2)]
        submit_jobs(redis, batch)
        wait_for(lambda: all(JobReader(redis).num_tokens(s.job_id) >= 20 for s in batch))
        urgent = JobSpec(job_id="urgent", model="synthetic", prompt="Now",
                         sampling=SamplingParams(max_tokens=5), priority=Priority.HIGH)
        submit_jobs(redis, [urgent])
        reader = JobReader(redis)
        urgent_state = wait_for(lambda: (s := reader.state("urgent")).status.is_final and s)
        states = wait_for(lambda: (s := [reader.state(x.job_id) for x in batch])
                          and all(st.status.is_final for st in s) and s, timeout=60)
    assert urgent_state.status is JobStatus.FINISHED
    # It ran while both batch jobs were unfinished: they gave their blocks up for it.
    assert urgent_state.finished_at < min(s.finished_at for s in states)
    assert sum(s.num_preemptions for s in states) >= 1
    for state in states:  # resumed exactly: every token once, in order
        assert state.status is JobStatus.FINISHED
        assert list(state.token_ids) == [synthetic_token_id(i) for i in range(150)]
