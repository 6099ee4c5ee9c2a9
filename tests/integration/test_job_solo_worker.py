"""One worker with a single slot: cancellation, priority order, SIGTERM drains."""

from __future__ import annotations

import signal

import pytest
from rq import Queue, Worker
from rq.job import Job
from rq.job import JobStatus as RQJobStatus
from rq.registry import CanceledJobRegistry

from protocol import (
    FinishReason,
    JobReader,
    JobStatus,
    Priority,
    WorkerStats,
    cancel_job,
    submit_jobs,
)
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

# No grace on SIGTERM: the running job is requeued at the next step boundary, however fast the
# engine (the tiny model once took more than 1 s for 600 tokens; it no longer does).
SOLO_ARGS = ["--max-num-seqs", "1", "--lease-seconds", "3", "--drain-seconds", "0",
             "--idle-block-seconds", "0.5", "--num-threads", "1"]


def _normal(fleet: Fleet) -> str:
    """The tiny model's normal-priority queue."""
    return KEYS.queue_name(fleet.model_dir.name, Priority.NORMAL)


@pytest.fixture(scope="module")
def solo(fleet: Fleet) -> Fleet:
    fleet.start(("solo", SOLO_ARGS))
    return fleet


def _tokens_at_least(fleet: Fleet, job_id: str, count: int) -> bool:
    # The first token is in the stream at once; the next ones with the stream's next write (live
    # tokens), by which time the tiny model may have generated them all.
    return JobReader(fleet.redis).num_tokens(job_id) >= count


def _stats(fleet: Fleet, name: str) -> WorkerStats:
    return WorkerStats.from_fields(fleet.redis.hgetall(KEYS.worker_stats(name)))


def test_cancel_stops_a_queued_job_and_a_running_one(solo: Fleet, reference_engine: object) -> None:
    running, queued = make_specs(solo.model_dir.name, 2, max_tokens=600, ignore_eos=True)
    submit_jobs(solo.redis, [running, queued])
    wait_until(lambda: _tokens_at_least(solo, running.job_id, 1), 60, "tokens", solo.logs)
    # Queued: gone from the queue at once, its stream ends with `canceled`.
    assert cancel_job(solo.redis, queued.job_id) is JobStatus.CANCELED
    assert Queue(_normal(solo), connection=solo.redis).count == 0
    assert solo.redis.xrange(KEYS.stream(queued.job_id))[0][0] == b"0-1"
    # Running: stopped at the next iteration boundary.
    assert cancel_job(solo.redis, running.job_id) is JobStatus.RUNNING
    states = wait_final(solo, [running.job_id, queued.job_id])
    reader = JobReader(solo.redis)
    for spec in (running, queued):
        assert states[spec.job_id].status is JobStatus.CANCELED
        assert Job.fetch(spec.job_id, solo.redis).get_status() == RQJobStatus.CANCELED
        assert spec.job_id in CanceledJobRegistry(_normal(solo), connection=solo.redis)
    assert reader.read(queued.job_id).tokens == []
    tokens = reader.token_ids(running.job_id)
    assert 1 <= len(tokens) < 600
    prefix = expected_tokens(reference_engine, [running])[running.job_id][:len(tokens)]
    assert_stream_exact(solo.redis, running.job_id, prefix, FinishReason.CANCELED)
    assert list(states[running.job_id].token_ids) == prefix
    # Its KV blocks are free again, and the worker goes on serving.
    wait_until(lambda: (s := _stats(solo, "solo")).num_running == 0 and s.num_kv_blocks_used == 0,
               30, "the blocks to be freed", solo.logs)
    assert _stats(solo, "solo").num_kv_blocks_total > 0
    (after,) = make_specs(solo.model_dir.name, 1, max_tokens=6)
    submit_jobs(solo.redis, [after])
    assert wait_final(solo, [after.job_id])[after.job_id].status is JobStatus.FINISHED
    assert not solo.redis.sismember(KEYS.canceled(), running.job_id)


def test_higher_priority_jobs_are_taken_first(solo: Fleet) -> None:
    model = solo.model_dir.name
    (blocker,) = make_specs(model, 1, max_tokens=80, ignore_eos=True)
    submit_jobs(solo.redis, [blocker])
    wait_until(lambda: _tokens_at_least(solo, blocker.job_id, 1), 60, "the blocker", solo.logs)
    by_priority = {}
    for priority in (Priority.LOW, Priority.NORMAL, Priority.HIGH):  # submitted low first
        (spec,) = make_specs(model, 1, max_tokens=4, priority=priority)
        by_priority[priority] = spec
    submit_jobs(solo.redis, list(by_priority.values()))
    states = wait_final(solo, [blocker.job_id] + [s.job_id for s in by_priority.values()])
    started = sorted(states, key=lambda job_id: states[job_id].started_at)
    assert started == [blocker.job_id, by_priority[Priority.HIGH].job_id,
                       by_priority[Priority.NORMAL].job_id, by_priority[Priority.LOW].job_id]


def test_sigterm_drains_requeues_the_rest_and_a_new_worker_resumes(
        solo: Fleet, reference_engine: object) -> None:
    (spec,) = make_specs(solo.model_dir.name, 1, max_tokens=600, ignore_eos=True)
    expected = expected_tokens(reference_engine, [spec])[spec.job_id]
    submit_jobs(solo.redis, [spec])
    wait_until(lambda: _tokens_at_least(solo, spec.job_id, 1), 60, "tokens", solo.logs)
    worker = next(w for w in solo.workers if w.name == "solo")
    worker.signal(signal.SIGTERM)
    assert worker.wait(30) == 0
    state = JobReader(solo.redis).state(spec.job_id)
    # No grace to finish 600 tokens in: back at the front, its tokens kept.
    assert state.status is JobStatus.PREEMPTED
    assert Queue(_normal(solo), connection=solo.redis).job_ids == [spec.job_id]
    assert Job.fetch(spec.job_id, solo.redis).get_status() == RQJobStatus.QUEUED
    assert "solo" not in {w.name for w in Worker.all(connection=solo.redis)}
    num_before = JobReader(solo.redis).num_tokens(spec.job_id)
    assert 1 <= num_before < 600
    # A new worker picks it up where the stream ends; this one drains within its grace.
    (successor,) = solo.start(("successor", [*SOLO_ARGS, "--drain-seconds", "120"]))
    (final,) = wait_final(solo, [spec.job_id]).values()
    assert (final.status, final.worker) == (JobStatus.FINISHED, "successor")
    assert_stream_exact(solo.redis, spec.job_id, expected, FinishReason.LENGTH)
    (short,) = make_specs(solo.model_dir.name, 1, max_tokens=40, ignore_eos=True)
    submit_jobs(solo.redis, [short])
    wait_until(lambda: _tokens_at_least(solo, short.job_id, 1), 60, "the short job", solo.logs)
    successor.signal(signal.SIGTERM)
    assert successor.wait(60) == 0
    assert JobReader(solo.redis).state(short.job_id).status is JobStatus.FINISHED
