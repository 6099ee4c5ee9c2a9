"""Two models on one Redis: each worker takes only its own model's jobs, a model without a live
worker queues until one comes, and a worker killed between its idle wait and its claim (the fault
hook CARPOOL_FAULT=kill_after_wake) loses no job."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from rq import Queue, Worker
from rq.registry import FinishedJobRegistry

from protocol import JobReader, JobStatus, Priority, submit_jobs
from tests.integration.conftest import (
    KEYS,
    Fleet,
    assert_stream_exact,
    expected_tokens,
    make_specs,
    wait_final,
    wait_until,
)

pytestmark = pytest.mark.slow

ARGS = ["--max-num-seqs", "4", "--lease-seconds", "3", "--idle-block-seconds", "0.5",
        "--num-threads", "1"]
# The doomed worker waits in its blocking pop nearly all the time, so the job's wake-up (and not
# a non-blocking claim at a loop boundary) is what reaches it.
DOOMED_ARGS = ["--max-num-seqs", "4", "--lease-seconds", "120", "--idle-block-seconds", "25",
               "--num-threads", "1"]


@pytest.fixture(scope="module")
def qwen_engine(tiny_qwen2_dir: Path) -> Any:
    from worker.engine.config import EngineConfig
    from worker.engine.engine import Engine

    return Engine(EngineConfig(model=str(tiny_qwen2_dir), dtype="float32", max_num_seqs=64,
                               num_threads=1))


@pytest.fixture(scope="module")
def models(fleet: Fleet, tiny_qwen2_dir: Path) -> Fleet:
    fleet.start(("llama-1", ARGS))
    fleet.start(("qwen-1", ARGS), model_dir=tiny_qwen2_dir)
    return fleet


def test_interleaved_jobs_of_two_models_each_run_on_their_models_worker(
        models: Fleet, tiny_qwen2_dir: Path, reference_engine: Any, qwen_engine: Any) -> None:
    llama, qwen = models.model_dir.name, tiny_qwen2_dir.name
    llama_specs = make_specs(llama, 6, max_tokens=16)
    qwen_specs = make_specs(qwen, 6, max_tokens=16)
    expected = {**expected_tokens(reference_engine, llama_specs),
                **expected_tokens(qwen_engine, qwen_specs)}
    assert expected[llama_specs[0].job_id] != expected[qwen_specs[0].job_id]  # same prompt
    interleaved = [spec for pair in zip(llama_specs, qwen_specs) for spec in pair]
    submit_jobs(models.redis, interleaved)
    states = wait_final(models, [spec.job_id for spec in interleaved])
    for specs, worker in ((llama_specs, "llama-1"), (qwen_specs, "qwen-1")):
        for spec in specs:
            state = states[spec.job_id]
            assert (state.status, state.worker) == (JobStatus.FINISHED, worker), spec.job_id
            assert list(state.token_ids) == expected[spec.job_id]
            assert_stream_exact(models.redis, spec.job_id, expected[spec.job_id])
    # rq info / rq-dashboard see each worker on its own model's queues, and each queue's jobs.
    workers = {w.name: w for w in Worker.all(connection=models.redis)}
    assert workers["llama-1"].queue_names() == KEYS.queue_names(llama)
    assert workers["qwen-1"].queue_names() == KEYS.queue_names(qwen)
    for model in (llama, qwen):
        name = KEYS.queue_name(model, Priority.NORMAL)
        assert Queue(name, connection=models.redis).count == 0
        assert FinishedJobRegistry(name, connection=models.redis).count == 6
    assert {w.name: w.successful_job_count for w in workers.values()} == {
        "llama-1": 6, "qwen-1": 6}


def test_a_worker_killed_between_its_wait_and_its_claim_loses_no_job(
        models: Fleet, tiny_qwen2_dir: Path, qwen_engine: Any) -> None:
    qwen = tiny_qwen2_dir.name
    serving = next(w for w in models.workers if w.name == "qwen-1")
    serving.signal(15)  # SIGTERM: idle, it stops at once
    assert serving.wait(30) == 0
    (doomed,) = models.start(("qwen-doomed", DOOMED_ARGS), model_dir=tiny_qwen2_dir,
                             env={"CARPOOL_FAULT": "kill_after_wake"})
    specs = make_specs(qwen, 2, max_tokens=8)
    expected = expected_tokens(qwen_engine, specs)
    submit_jobs(models.redis, specs)
    assert doomed.wait(60) == -9  # SIGKILLed itself right after its wait returned
    # Nobody serves the model now: its jobs wait on its queue, untouched (the llama worker, idle
    # on the same Redis, never takes them).
    queue = KEYS.queue_name(qwen, Priority.NORMAL)
    assert Queue(queue, connection=models.redis).job_ids == [s.job_id for s in specs]
    reader = JobReader(models.redis)
    assert [reader.state(s.job_id).status for s in specs] == [JobStatus.QUEUED] * 2
    assert models.redis.zcard(KEYS.leases()) == 0
    models.start(("qwen-2", ARGS), model_dir=tiny_qwen2_dir)
    states = wait_final(models, [s.job_id for s in specs])
    for spec in specs:
        state = states[spec.job_id]
        assert (state.status, state.worker, state.num_recoveries) == (
            JobStatus.FINISHED, "qwen-2", 0)
        assert_stream_exact(models.redis, spec.job_id, expected[spec.job_id])
    wait_until(lambda: not models.redis.exists(KEYS.wakeups(queue)), 10,
               "the wake-ups to be trimmed", models.logs)
