"""Preemption pressure: a KV pool far too small for the load. The worker preempts again and
again (each preempted job goes back to the queue's front with its tokens and is taken again);
everything must finish, equal to an unconstrained run, and the worker must keep making
progress: the wait fails after a stall of STALL_S without a new stream entry, long before its
overall bound.
"""

from __future__ import annotations

import time

import pytest

from protocol import submit_jobs
from tests.integration.conftest import KEYS, Fleet, expected_tokens, make_specs, wait_until
from tests.reliability.conftest import (
    TIGHT_NUM_KV_BLOCKS,
    Figures,
    assert_finished_exact,
    assert_none_lost,
    counter,
    wait_settled,
    worker_stats,
)

# Also `slow`: many worker processes for minutes, so `make test-fast` leaves them out.
pytestmark = [pytest.mark.reliability, pytest.mark.slow]

NUM_JOBS = 24
MAX_TOKENS = 90
STALL_S = 20.0


def test_a_far_too_small_kv_pool_preempts_but_finishes_everything_exactly(
        tight_fleet: Fleet, reference_engine: object) -> None:
    # The tight worker: 10 blocks of 16 tokens; a job needs 6 (prompt + 90 tokens), so its 8
    # seats would need 48: one job fits at full length, the rest thrash around it.
    fleet = tight_fleet
    (worker,) = fleet.workers
    specs = make_specs(fleet.model_dir.name, NUM_JOBS, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = expected_tokens(reference_engine, specs)  # unconstrained: 64 seats, a roomy pool
    job_ids = [s.job_id for s in specs]
    preempted_before = counter(fleet.redis, "jobs_preempted_total")
    submit_jobs(fleet.redis, specs)
    states, pending = wait_settled(fleet, job_ids, timeout=180, stall_s=STALL_S)
    settled_at = time.time()
    num_preemptions = sum(s.num_preemptions for s in states.values() if s is not None)
    figures = Figures("preemption-pressure", jobs=NUM_JOBS, faults=num_preemptions,
                      extra={"kv_blocks": TIGHT_NUM_KV_BLOCKS,
                             "jobs_preempted": sum(1 for s in states.values()
                                                   if s is not None and s.num_preemptions)})
    assert_none_lost(fleet, figures, pending, states)
    for spec in specs:
        figures.tokens_checked += assert_finished_exact(fleet.redis, spec, states[spec.job_id],
                                                        expected[spec.job_id])
    assert counter(fleet.redis, "jobs_preempted_total") - preempted_before == num_preemptions
    assert num_preemptions >= NUM_JOBS // 2, "the pool was meant to be far too small"
    stats = wait_until(lambda: (s := worker_stats(fleet.redis, worker.name)) and
                       s.updated_at > settled_at and s, 30, "fresh idle stats", fleet.logs)
    assert (stats.num_jobs, stats.num_kv_blocks_used, stats.num_kv_blocks_total) == (
        0, 0, TIGHT_NUM_KV_BLOCKS), stats
    assert fleet.redis.zcard(KEYS.leases()) == 0
    figures.report()
