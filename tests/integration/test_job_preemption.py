"""Preemption: a worker short of KV blocks puts jobs back at the queue's front; another worker
resumes them from their streams, with exactly the tokens of an undisturbed run."""

from __future__ import annotations

import pytest
from rq.job import Job
from rq.job import JobStatus as RQJobStatus

from protocol import FinishReason, JobReader, JobStatus, cancel_job, submit_jobs
from tests.integration.conftest import (
    Fleet,
    assert_stream_exact,
    expected_tokens,
    make_specs,
    wait_final,
    wait_until,
)

pytestmark = pytest.mark.slow

COMMON = ["--lease-seconds", "3", "--idle-block-seconds", "0.5", "--num-threads", "1"]


def _occupy(fleet: Fleet, name: str) -> str:
    """Submit long jobs until worker `name` runs one (canceling any another worker took)."""
    reader = JobReader(fleet.redis)
    def running(job_id: str) -> object:
        state = reader.state(job_id)
        return state if state.status is JobStatus.RUNNING else None

    for _ in range(20):
        (spec,) = make_specs(fleet.model_dir.name, 1, max_tokens=1000, ignore_eos=True)
        submit_jobs(fleet.redis, [spec])
        state = wait_until(lambda: running(spec.job_id), 60, "a worker to take the blocker",  # noqa: B023
                           fleet.logs)
        if state.worker == name:
            return spec.job_id
        cancel_job(fleet.redis, spec.job_id)
        wait_final(fleet, [spec.job_id])
    raise AssertionError(f"{name} never took a job")


def test_preempted_jobs_resume_on_the_other_worker_token_for_token(
        fleet: Fleet, reference_engine: object) -> None:
    model = fleet.model_dir.name
    # 16 blocks of 16 tokens: one job of 125 tokens needs 8; four cannot all stay.
    fleet.start(("roomy", ["--max-num-seqs", "1", *COMMON]),
                ("tight", ["--max-num-seqs", "4", "--num-kv-blocks", "16", *COMMON]))
    reader = JobReader(fleet.redis)
    specs = make_specs(model, 4, max_tokens=120, ignore_eos=True)
    expected = expected_tokens(reference_engine, specs)
    blocker = _occupy(fleet, "roomy")  # so the tight worker takes every job
    submit_jobs(fleet.redis, specs)
    wait_until(lambda: any(reader.state(s.job_id).num_preemptions for s in specs), 120,
               "a preemption", fleet.logs)
    assert cancel_job(fleet.redis, blocker) is JobStatus.RUNNING  # roomy is free now
    states = wait_final(fleet, [s.job_id for s in specs], timeout=240)
    resumed_on_roomy = [s for s in specs if states[s.job_id].num_preemptions
                        and states[s.job_id].worker == "roomy"]
    assert resumed_on_roomy, {s.job_id: (st.worker, st.num_preemptions) for s, st in states.items()}
    for spec in specs:
        state = states[spec.job_id]
        assert state.status is JobStatus.FINISHED
        assert list(state.token_ids) == expected[spec.job_id]
        assert_stream_exact(fleet.redis, spec.job_id, expected[spec.job_id], FinishReason.LENGTH)
        job = Job.fetch(spec.job_id, fleet.redis)
        assert job.get_status() == RQJobStatus.FINISHED
    assert {s.sampling.temperature for s in specs} == {0.0, 0.8}  # greedy and seeded both covered
    assert sum(states[s.job_id].num_preemptions for s in specs) >= 1
    assert int(fleet.redis.hget("carpool:metrics:counters", "jobs_preempted_total")) >= 1
