"""The batch tier gives way (fakeredis, the real worker loop around a synthetic engine with a
KV pool): a worker whose KV blocks batch jobs hold, with a seat free, preempts them for a
higher-tier job, and they resume exactly where they stopped."""

from __future__ import annotations

import math
import threading
import time

import fakeredis

from protocol import JobReader, JobSpec, JobStatus, Priority, SamplingParams, submit_jobs
from tests.worker.jobs.job_support import KEYS
from worker.engine.synthetic_engine import SyntheticEngine, synthetic_token_id
from worker.jobs.batching_worker import BatchingWorker
from worker.jobs.settings import WorkerSettings

BLOCK_SIZE = 16


class _PooledEngine(SyntheticEngine):
    """A synthetic engine whose requests hold KV blocks as a real one's do (prompt + output)."""

    def __init__(self, max_num_seqs: int, step_s: float, num_blocks: int) -> None:
        super().__init__(max_num_seqs, step_s)
        self.num_blocks = num_blocks

    def num_free_kv_blocks(self) -> int:
        used = sum(math.ceil((r.num_prompt_tokens + r.num_output_tokens + 1) / BLOCK_SIZE)
                   for r in self._requests.values() if not r.is_aborted)
        return max(0, self.num_blocks - used)


def _wait(condition, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.01)
    raise AssertionError("timed out")


def test_batch_jobs_holding_the_kv_pool_give_it_to_a_higher_tier_job() -> None:
    server = fakeredis.FakeServer()
    redis = fakeredis.FakeRedis(server=server)
    settings = WorkerSettings(model="synthetic", redis_url="redis://unused", name="kv-worker",
                              max_num_seqs=3, block_size=BLOCK_SIZE, drain_seconds=0,
                              lease_seconds=10, idle_block_seconds=0.05)
    # Two batch jobs of 5 prompt tokens fill 4 blocks from their 12th token on; a seat stays free.
    worker = BatchingWorker(settings, _PooledEngine(3, 0.01, num_blocks=4),  # type: ignore[arg-type]
                            redis, register_presence=False)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        long = SamplingParams(max_tokens=150, temperature=0.0)
        batch = [JobSpec(job_id=f"batch-{i}", model="synthetic", prompt="Say 0", sampling=long,
                         priority=Priority.BATCH) for i in range(2)]
        submit_jobs(redis, batch)
        _wait(lambda: all(redis.xlen(KEYS.stream(s.job_id)) >= 20 for s in batch))
        urgent = JobSpec(job_id="urgent", model="synthetic", prompt="Now",
                         sampling=SamplingParams(max_tokens=5), priority=Priority.HIGH)
        submit_jobs(redis, [urgent])
        reader = JobReader(redis)
        urgent_state = _wait(lambda: (s := reader.state("urgent")).status.is_final and s)
        states = _wait(lambda: (s := [reader.state(x.job_id) for x in batch])
                       and all(st.status.is_final for st in s) and s, timeout=60)
    finally:
        worker.request_stop(15, None)
        thread.join(30)
    assert urgent_state.status is JobStatus.FINISHED
    # It ran while both batch jobs were unfinished: they gave their blocks up for it.
    assert urgent_state.finished_at < min(s.finished_at for s in states)
    assert sum(s.num_preemptions for s in states) >= 1
    for state in states:  # resumed exactly: every token once, in order
        assert state.status is JobStatus.FINISHED
        assert list(state.token_ids) == [synthetic_token_id(i) for i in range(150)]
