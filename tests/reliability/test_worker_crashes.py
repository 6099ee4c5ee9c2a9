"""Workers that die or freeze mid-stream: SIGKILL at seeded random moments (with a second worker
alive, and with the only worker restarted under its own name), and SIGSTOP past the lease.

Every job must end, every stream must hold exactly the undisturbed run's tokens at entries
0-1..0-n (no gap, no duplicate), and each job must have been recovered exactly as many times as
it was held by a worker at the moment that worker died.
"""

from __future__ import annotations

import random
import signal
from collections import Counter

import pytest

from protocol import JobStatus, submit_jobs
from tests.integration.conftest import (
    KEYS,
    Fleet,
    WorkerProcess,
    expected_tokens,
    make_specs,
    wait_until,
)
from tests.reliability.conftest import (
    FAST_RECOVERY_ARGS,
    Figures,
    assert_finished_exact,
    assert_none_lost,
    counter,
    describe,
    is_stopped,
    kill,
    num_stream_entries,
    read_states,
    restart,
    wait_ready_since,
    wait_settled,
    worker_stats,
)

# Also `slow`: many worker processes for minutes, so `make test-fast` leaves them out.
pytestmark = [pytest.mark.reliability, pytest.mark.slow]

WORKER_ARGS = ["--max-num-seqs", "8", *FAST_RECOVERY_ARGS]
NUM_JOBS = 50
MAX_TOKENS = 96


def _workers(fleet: Fleet, *names: str, extra_args: tuple[str, ...] = ()) -> list[WorkerProcess]:
    """Exactly the workers `names` alive (started if missing, others stopped), in that order:
    each test states the fleet it needs, whatever ran before it."""
    for worker in fleet.workers:
        if worker.name not in names:
            worker.stop()
    alive = {w.name: w for w in fleet.workers if w.is_alive}
    missing = [name for name in names if name not in alive]
    for worker in [w for w in fleet.workers if w.name in missing]:
        fleet.workers.remove(worker)  # a dead one is started afresh below
    fleet.start(*[(name, [*WORKER_ARGS, *extra_args]) for name in missing])
    by_name = {w.name: w for w in fleet.workers}
    return [by_name[name] for name in names]


def _holders(fleet: Fleet, job_ids: list[str]) -> dict[str, list[str]]:
    """Worker name -> the running jobs it holds, as Redis records them."""
    held: dict[str, list[str]] = {}
    for job_id, state in read_states(fleet.redis, job_ids).items():
        if state is not None and state.status is JobStatus.RUNNING:
            held.setdefault(state.worker, []).append(job_id)
    return held


def _claims_of(fleet: Fleet, worker_name: str, job_ids: list[str]) -> set[tuple[str, int]]:
    """(job, fencing token) of every running job Redis says `worker_name` holds. A claim lost
    with its holder is recovered exactly once, however many lives of the worker it outlives."""
    held = _holders(fleet, job_ids).get(worker_name, [])
    with fleet.redis.pipeline(transaction=False) as pipe:
        for job_id in held:
            pipe.get(KEYS.fence(job_id))
        fences = pipe.execute()
    return {(job_id, int(fence)) for job_id, fence in zip(held, fences)}


def _sigkill_run(fleet: Fleet, reference_engine: object, workers: list[WorkerProcess],
                 name: str, seed: int, num_faults: int, restart_victims: bool) -> None:
    """Stream NUM_JOBS jobs; at `num_faults` seeded moments SIGKILL a serving worker that holds
    jobs (and, with `restart_victims`, start it again at once under its own name, as a
    supervisor would). With several workers a kill needs another one serving, so one always
    is."""
    rng = random.Random(seed)
    specs = make_specs(fleet.model_dir.name, NUM_JOBS, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = expected_tokens(reference_engine, specs)
    job_ids = [s.job_id for s in specs]
    num_entries = sum(len(tokens) + 1 for tokens in expected.values())
    # Moments as fractions of all stream entries, so they fall mid-stream however fast the box.
    moments = sorted(rng.uniform(0.05, 0.8) for _ in range(num_faults))
    lost_claims: set[tuple[str, int]] = set()
    killed_at: list[str] = []
    restarted_at: dict[str, float] = {}

    def serving(worker: WorkerProcess) -> bool:
        if not worker.is_alive:
            return False
        since = restarted_at.get(worker.name)
        stats = worker_stats(fleet.redis, worker.name) if since is not None else None
        if since is not None and (stats is None or stats.updated_at < since):
            return False  # still starting
        restarted_at.pop(worker.name, None)
        return True

    submit_jobs(fleet.redis, specs)
    for moment in moments:
        def due(target: float = moment * num_entries
                ) -> tuple[bool, list[WorkerProcess]] | None:
            progress = num_stream_entries(fleet.redis, job_ids)
            if progress >= num_entries:
                return True, []
            if progress < target:
                return None
            holders = _holders(fleet, job_ids)
            up = [w for w in workers if serving(w)]
            candidates = [w for w in up if holders.get(w.name)
                          and (len(workers) == 1 or len(up) >= 2)]
            return (False, candidates) if candidates else None

        streamed_all, candidates = wait_until(
            due, 240, f"progress {moment:.2f} with a serving worker holding jobs",
            lambda: describe(fleet, job_ids) + fleet.logs())
        if streamed_all:
            break
        victim = rng.choice(candidates)
        kill(victim)
        # Read after the kill: what Redis says the dead worker held is what must come back.
        lost_claims |= _claims_of(fleet, victim.name, job_ids)
        killed_at.append(f"{num_stream_entries(fleet.redis, job_ids) / num_entries:.2f}")
        if restart_victims:
            restarted_at[victim.name] = restart(victim)
    # A worker that is still starting makes no progress: let it start before the stall watch.
    for worker in workers:
        if worker.name in restarted_at:
            wait_ready_since(fleet, worker, restarted_at.pop(worker.name))
    states, pending = wait_settled(fleet, job_ids, timeout=240)
    recoveries = Counter(job_id for job_id, _ in lost_claims)
    figures = Figures(name, jobs=len(specs), faults=len(killed_at),
                      extra={"jobs_recovered": sum(recoveries.values()),
                             "killed_at": ",".join(killed_at)})
    assert_none_lost(fleet, figures, pending, states)
    for spec in specs:
        state = states[spec.job_id]
        figures.tokens_checked += assert_finished_exact(fleet.redis, spec, state,
                                                        expected[spec.job_id])
        assert state.num_recoveries == recoveries[spec.job_id], spec.job_id
    assert len(killed_at) == num_faults, f"only {len(killed_at)} kills landed mid-stream"
    assert sum(recoveries.values()) >= len(killed_at)  # each kill took jobs down with it
    assert fleet.redis.zcard(KEYS.leases()) == 0
    figures.report()


def test_a_paused_worker_is_fenced_and_every_stream_it_held_stays_exact(
        fleet: Fleet, reference_engine: object) -> None:
    workers = _workers(fleet, "alpha", "beta", "gamma")
    # Long enough to be mid-generation when paused: a stream shows a job's first token at once
    # and the next ones only every CARPOOL_DURABLE_INTERVAL_MS (500), in which the tiny model can
    # finish 160 tokens (a clean-clone CI run on a Xeon did), so the wait is for first tokens.
    specs = make_specs(fleet.model_dir.name, 6, max_tokens=1000, ignore_eos=True)
    expected = expected_tokens(reference_engine, specs)
    job_ids = [s.job_id for s in specs]
    fenced_before = counter(fleet.redis, "fenced_writes_total")
    submit_jobs(fleet.redis, specs)

    def busiest_streaming() -> str | None:
        holders = _holders(fleet, job_ids)
        busiest = max(holders, key=lambda name: len(holders[name]), default=None)
        if busiest and len(holders[busiest]) >= 2 and all(
                num_stream_entries(fleet.redis, [job_id]) for job_id in holders[busiest]):
            return busiest
        return None

    zombie_name = wait_until(busiest_streaming, 60, "a worker streaming two jobs", fleet.logs)
    zombie = next(w for w in workers if w.name == zombie_name)
    zombie.signal(signal.SIGSTOP)  # a GC pause or a partition: alive, silent past its lease
    try:
        wait_until(lambda: is_stopped(zombie), 10, "SIGSTOP to take effect")
        held = _holders(fleet, job_ids).get(zombie.name, [])
        assert len(held) >= 2

        def all_taken_over() -> bool:
            # Claimed again by another worker (not just requeued): the strictest case for the
            # zombie's late writes, whose lease token is now lower than the live one.
            return all(s.worker != zombie.name and s.status in (JobStatus.RUNNING,
                                                                JobStatus.FINISHED)
                       for s in read_states(fleet.redis, held).values())

        wait_until(all_taken_over, 60, f"the others to take over {held}",
                   lambda: describe(fleet, job_ids) + fleet.logs())
    finally:
        zombie.signal(signal.SIGCONT)
    states, pending = wait_settled(fleet, job_ids, timeout=120)
    figures = Figures("worker-sigstop", jobs=len(specs), faults=1,
                      extra={"jobs_taken_over": len(held)})
    assert_none_lost(fleet, figures, pending, states)
    # Each job the zombie held cost it exactly one refused write when it woke: its lease had
    # passed to another worker, so the append script wrote nothing and it dropped the job.
    wait_until(lambda: counter(fleet.redis, "fenced_writes_total") - fenced_before >= len(held),
               30, "the zombie's refused writes", fleet.logs)
    for spec in specs:
        state = states[spec.job_id]
        figures.tokens_checked += assert_finished_exact(fleet.redis, spec, state,
                                                        expected[spec.job_id])
        if spec.job_id in held:
            assert state.worker != zombie.name and state.num_recoveries == 1, spec.job_id
    assert counter(fleet.redis, "fenced_writes_total") - fenced_before == len(held)
    assert all(w.is_alive for w in workers)
    figures.extra["fenced_writes"] = len(held)
    figures.report()


def test_sigkill_with_a_second_worker_alive_loses_nothing(
        fleet: Fleet, reference_engine: object) -> None:
    workers = _workers(fleet, "alpha", "beta", "gamma")
    # Victims stay dead: two kills leave one of three serving.
    _sigkill_run(fleet, reference_engine, workers, "worker-sigkill-survivors", seed=8,
                 num_faults=2, restart_victims=False)


def test_sigkill_of_the_only_worker_restarted_under_its_name_loses_nothing(
        fleet: Fleet, reference_engine: object) -> None:
    # Whichever worker the previous test left alive (starting one costs seconds of CPU).
    survivor = next((w.name for w in fleet.workers if w.is_alive), "alpha")
    workers = _workers(fleet, survivor)
    _sigkill_run(fleet, reference_engine, workers, "worker-sigkill-restart", seed=9,
                 num_faults=3, restart_victims=True)


def test_sigkill_of_workers_that_publish_every_few_steps_loses_nothing(
        fleet: Fleet, reference_engine: object) -> None:
    # A stream interval: a killed worker takes the tokens it had not published yet with it; the
    # job resumes after what its stream holds and generates them again, the same ones.
    workers = _workers(fleet, "iv-alpha", "iv-beta", "iv-gamma",
                       extra_args=("--stream-interval-ms", "100"))
    _sigkill_run(fleet, reference_engine, workers, "worker-sigkill-stream-interval", seed=10,
                 num_faults=2, restart_victims=False)
