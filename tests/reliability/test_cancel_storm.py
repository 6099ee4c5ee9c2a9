"""A cancellation storm: 100 jobs, half of them canceled at seeded random moments, some still
queued, some running, some mid-claim, some already done.

Afterwards the worker must hold nothing: no KV block in use, no job, no lease (its published
WorkerStats say so once it is idle); every canceled stream ends with exactly one `canceled`
entry after the tokens it got (the undisturbed run's first k, at entries 0..k-1); every other
job finishes with its complete stream.
"""

from __future__ import annotations

import random
import time
from collections import Counter

import pytest

from protocol import (
    FinishReason,
    JobSpec,
    JobState,
    JobStatus,
    StreamEntry,
    cancel_job,
    submit_jobs,
)
from protocol.rq_keys import RQKeys
from protocol.stream_ids import entry_index
from protocol.token_runs import expand_runs
from tests.integration.conftest import KEYS, Fleet, expected_tokens, make_specs, wait_until
from tests.reliability.conftest import (
    TIGHT_NUM_KV_BLOCKS,
    Figures,
    assert_finished_exact,
    assert_none_lost,
    describe,
    num_stream_entries,
    read_states,
    wait_settled,
    worker_stats,
)

# Also `slow`: many worker processes for minutes, so `make test-fast` leaves them out.
pytestmark = [pytest.mark.reliability, pytest.mark.slow]

NUM_JOBS = 100
MAX_TOKENS = 40
# cancel_job's answer -> where the storm found the job.
_FOUND = {JobStatus.CANCELED: "queued", JobStatus.RUNNING: "running",
          JobStatus.QUEUED: "being_claimed", JobStatus.PREEMPTED: "being_claimed",
          JobStatus.FINISHED: "finished", None: "unknown"}


def _assert_canceled_exact(fleet: Fleet, spec: JobSpec, state: JobState | None,
                           expected: list[int]) -> int:
    """Tokens 0..k-1 equal to the undisturbed run's first k (k may be 0, or all of them when the
    cancel met the last token: the finish guard still ends it canceled), then one final
    `canceled` entry. Returns k."""
    assert state is not None and state.status is JobStatus.CANCELED, (spec.job_id, state)
    # Runs (several tokens in one entry: live tokens written once due) taken apart.
    raw = expand_runs(fleet.redis.xrange(KEYS.stream(spec.job_id)))
    entries = [StreamEntry.from_fields(fields) for _, fields in raw]
    num_tokens = len(entries) - 1
    assert 0 <= num_tokens <= len(expected), spec.job_id
    assert [entry_index(entry_id) for entry_id, _ in raw] == list(range(num_tokens + 1)), \
        spec.job_id
    assert [e.kind for e in entries] == ["token"] * num_tokens + ["done"], spec.job_id
    assert [e.index for e in entries[:-1]] == list(range(num_tokens))
    assert [e.token_id for e in entries[:-1]] == expected[:num_tokens], spec.job_id
    done = entries[-1]
    assert (done.finish_reason, done.completion_tokens) == (FinishReason.CANCELED, num_tokens)
    assert (state.finish_reason, list(state.token_ids)) == (FinishReason.CANCELED,
                                                            expected[:num_tokens])
    return num_tokens


def test_a_cancel_storm_leaks_no_block_no_job_and_no_stream_entry(
        tight_fleet: Fleet, reference_engine: object) -> None:
    # The tight worker: 8 seats of jobs needing 3 blocks each share 10 blocks, so some jobs are
    # preempted (back on the queue with tokens) when a cancel reaches them, a path of its own.
    fleet = tight_fleet
    (worker,) = fleet.workers
    rng = random.Random(4)
    specs = make_specs(fleet.model_dir.name, NUM_JOBS, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = expected_tokens(reference_engine, specs)
    job_ids = [s.job_id for s in specs]
    doomed = set(rng.sample(job_ids, NUM_JOBS // 2))
    kept = [job_id for job_id in job_ids if job_id not in doomed]
    kept_entries = sum(len(expected[job_id]) + 1 for job_id in kept)
    # Moments are shares of the kept jobs' entries (which all get written, whatever is
    # canceled). At each, a coin picks a doomed job that is running, if one is, or any doomed
    # job not canceled yet: most would otherwise be found queued or already done.
    storm = sorted(rng.uniform(0.0, 0.7) for _ in doomed)
    submit_jobs(fleet.redis, specs)
    answers: dict[str, JobStatus | None] = {}
    for moment in storm:
        wait_until(lambda: num_stream_entries(fleet.redis, kept)  # noqa: B023
                   >= moment * kept_entries, 120, f"progress {moment:.2f}",  # noqa: B023
                   lambda: describe(fleet, job_ids) + fleet.logs())
        left = sorted(doomed - set(answers))
        running = [job_id for job_id, state in read_states(fleet.redis, left).items()
                   if state is not None and state.status is JobStatus.RUNNING]
        job_id = rng.choice(running if running and rng.random() < 0.5 else left)
        answers[job_id] = cancel_job(fleet.redis, job_id)
    states, pending = wait_settled(fleet, job_ids, timeout=120)
    settled_at = time.time()
    found = Counter(_FOUND[status] for status in answers.values())
    preempted = sum(1 for s in states.values() if s is not None and s.num_preemptions)
    figures = Figures("cancel-storm", jobs=NUM_JOBS, faults=len(storm),
                      extra={f"found_{where}": n for where, n in sorted(found.items())})
    figures.extra["jobs_preempted"] = preempted
    assert_none_lost(fleet, figures, pending, states)
    num_canceled = 0
    for spec in specs:
        job_id, state = spec.job_id, states[spec.job_id]
        if job_id in doomed and answers[job_id] is not JobStatus.FINISHED:
            # Too late is the only way out of ending canceled: a running job's finish is
            # turned into `canceled` by the guard in the finish script.
            figures.tokens_checked += _assert_canceled_exact(fleet, spec, state,
                                                             expected[job_id])
            num_canceled += 1
        else:
            figures.tokens_checked += assert_finished_exact(fleet.redis, spec, state,
                                                            expected[job_id])
    # Storm shape: some cancels took jobs straight off the queue, some stopped running ones.
    assert found["queued"] >= 1 and found["running"] >= 1, found
    # No leak: once idle, the worker holds no job and every KV block is back in the pool.
    stats = wait_until(lambda: (s := worker_stats(fleet.redis, worker.name)) and
                       s.updated_at > settled_at and s, 30, "fresh idle stats", fleet.logs)
    assert (stats.num_jobs, stats.num_running, stats.num_waiting, stats.num_kv_blocks_used,
            stats.num_kv_blocks_total) == (0, 0, 0, 0, TIGHT_NUM_KV_BLOCKS), stats
    assert fleet.redis.zcard(KEYS.leases()) == 0
    assert fleet.redis.scard(KEYS.canceled()) == 0  # every flag was consumed by an end
    assert not any(fleet.redis.llen(RQKeys.queue(name)) for name in KEYS.queue_names(fleet.model_dir.name))
    figures.extra["canceled"] = num_canceled
    figures.report()
