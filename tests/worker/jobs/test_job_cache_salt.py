"""A job's cache_salt reaches the engine through the worker loop (real engine, tiny model,
fakeredis): the job's cached_tokens count only what jobs of the same salt left cached."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fakeredis
import pytest

from protocol import JobReader, JobSpec, JobStatus, SamplingParams, submit_jobs
from tests.worker.jobs.synthetic_worker import wait_for

PROMPT = " ".join(f"word{i}" for i in range(40))  # several KV blocks of tokens


@pytest.fixture(scope="module")
def worker(tiny_llama_dir: Path) -> Iterator[Any]:
    from worker.engine.engine import Engine
    from worker.jobs.batching_worker import BatchingWorker
    from worker.jobs.settings import WorkerSettings

    settings = WorkerSettings(model=str(tiny_llama_dir), dtype="float32", redis_url="redis://unused",
                              name="w-salt", max_num_seqs=2, lease_seconds=5, drain_seconds=0,
                              idle_block_seconds=0.05, num_threads=1)
    server = fakeredis.FakeServer()
    running = BatchingWorker(settings, Engine(settings.engine_config()),
                             fakeredis.FakeRedis(server=server),
                             presence_redis=fakeredis.FakeRedis(server=server))
    thread = threading.Thread(target=running.run, daemon=True)
    thread.start()
    yield running
    running.request_stop(15, None)
    thread.join(30)
    assert not thread.is_alive()


def cached_tokens_of(worker: Any, job_id: str, cache_salt: str | None) -> int:
    """Run one job to its end; the prompt tokens it found cached."""
    submit_jobs(worker.redis, [JobSpec(
        job_id=job_id, model=worker.settings.served_model_name, prompt=PROMPT,
        sampling=SamplingParams(max_tokens=2, temperature=0.0), cache_salt=cache_salt)])
    reader = JobReader(worker.redis)
    state = wait_for(lambda: (s := reader.state(job_id)) and s.status.is_final and s)
    assert state.status is JobStatus.FINISHED, state.error
    return int(state.cached_tokens)


def test_a_job_reuses_only_what_jobs_of_its_salt_left_cached(worker: Any) -> None:
    num_prompt_tokens = len(worker.engine.tokenizer.encode(PROMPT))
    block_size = worker.engine.block_manager.block_size
    reusable = (num_prompt_tokens - 1) // block_size * block_size  # the last token is computed
    assert reusable > 0
    # Unsalted first: a salted lookup that ignored its salt would find its blocks.
    runs = [("plain-1", None), ("alice-1", "alice"), ("bob-1", "bob"),
            ("alice-2", "alice"), ("bob-2", "bob"), ("plain-2", None)]
    assert {job_id: cached_tokens_of(worker, job_id, salt) for job_id, salt in runs} == {
        "alice-1": 0, "bob-1": 0, "plain-1": 0,
        "alice-2": reusable, "bob-2": reusable, "plain-2": reusable}
