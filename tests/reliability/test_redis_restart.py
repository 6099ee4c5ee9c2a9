"""Redis killed and restarted under running workers, with the append-only file fsynced at every
write (so Redis itself loses nothing it acknowledged): one outage shorter than a lease, one
longer. Workers must reconnect on their own, retrying with capped exponential backoff and jitter
and logging every retry; no job may be lost and every stream must come out complete, in order,
equal to an undisturbed run.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from protocol import submit_jobs
from tests.conftest import RedisServer
from tests.integration.conftest import (
    KEYS,
    Fleet,
    WorkerProcess,
    expected_tokens,
    make_specs,
    wait_until,
)
from tests.reliability.conftest import (
    AOF,
    Figures,
    assert_finished_exact,
    assert_none_lost,
    describe,
    num_stream_entries,
    wait_settled,
)

# Also `slow`: many worker processes for minutes, so `make test-fast` leaves them out.
pytestmark = [pytest.mark.reliability, pytest.mark.slow]

LEASE_S = 3.0
WORKER_ARGS = ["--max-num-seqs", "4", "--lease-seconds", str(LEASE_S),
               "--idle-block-seconds", "0.25", "--num-threads", "1"]
# WorkerSettings defaults: backoff from 50 ms, capped at a quarter lease (under the 2 s max).
BACKOFF_BASE_S, BACKOFF_CAP_S = 0.05, LEASE_S / 4
_RETRY = re.compile(r"Redis unreachable while .*: retry (\d+) in (\d+\.\d+)s")


@pytest.fixture()
def aof_fleet(aof_redis: RedisServer, tiny_llama_dir: Path, tmp_path: Path) -> Iterator[Fleet]:
    log_dir = tmp_path / "worker-logs"
    log_dir.mkdir()
    fleet = Fleet(aof_redis.url, tiny_llama_dir, log_dir)
    try:
        yield fleet
    finally:
        fleet.stop_all()


def _log_since(worker: WorkerProcess, offset: int) -> str:
    with worker.log_path.open("rb") as log:
        log.seek(offset)
        return log.read().decode(errors="replace")


def _check_backoff(text: str, worker: str) -> int:
    """Every retry of one outage is logged, numbered 1, 2, 3... with a wait inside its jittered
    band [ceiling/2, ceiling], the ceiling doubling from the base up to the cap. Returns the
    number of retries."""
    retries = [(int(n), float(delay)) for n, delay in _RETRY.findall(text)]
    assert retries, f"{worker} logged no retry:\n{text[-3000:]}"
    # A worker may retry in two places (a claim, then a publish) but the count runs on.
    assert [n for n, _ in retries] == list(range(1, len(retries) + 1)), (worker, retries)
    for n, delay in retries:
        ceiling = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** (n - 1))
        assert ceiling / 2 - 0.006 <= delay <= ceiling + 0.006, (worker, n, delay)
    assert "Redis reachable again after" in text, worker
    return len(retries)


def test_redis_restarts_lose_no_job_and_workers_reconnect_with_backoff(
        aof_redis: RedisServer, aof_fleet: Fleet, reference_engine: object) -> None:
    fleet = aof_fleet
    workers = fleet.start(("one", WORKER_ARGS), ("two", WORKER_ARGS))
    rng = random.Random(11)
    specs = make_specs(fleet.model_dir.name, 30, max_tokens=64, ignore_eos=True)
    expected = expected_tokens(reference_engine, specs)
    job_ids = [s.job_id for s in specs]
    num_entries = sum(len(tokens) + 1 for tokens in expected.values())
    # (moment as a share of all stream entries, how long Redis stays down): first shorter than a
    # lease (workers keep their jobs), then longer (the leases lapse and recovery hands them on).
    outages = [(rng.uniform(0.1, 0.3), 0.0), (rng.uniform(0.45, 0.7), 1.5 * LEASE_S)]
    submit_jobs(fleet.redis, specs)
    retries = 0
    downtimes = []
    for moment, down_s in outages:
        target = moment * num_entries
        wait_until(lambda target=target: num_stream_entries(fleet.redis, job_ids) >= target,
                   120, f"progress {moment:.2f}", lambda: describe(fleet, job_ids) + fleet.logs())
        offsets = {w.name: w.log_path.stat().st_size for w in workers}
        aof_redis.kill()
        killed_at = time.monotonic()
        wait_until(lambda: all("Redis unreachable" in _log_since(w, offsets[w.name])  # noqa: B023
                               for w in workers), 30, "every worker to notice", fleet.logs)
        # How long a fault lasts, not an assertion: the workers must cope with it.
        time.sleep(max(0.0, killed_at + down_s - time.monotonic()))
        aof_redis.start(**AOF)
        downtimes.append(f"{time.monotonic() - killed_at:.1f}")
        wait_until(lambda: all("Redis reachable again" in _log_since(w, offsets[w.name])  # noqa: B023
                               for w in workers), 60, "every worker to reconnect", fleet.logs)
        for worker in workers:
            retries += _check_backoff(_log_since(worker, offsets[worker.name]), worker.name)
    states, pending = wait_settled(fleet, job_ids, timeout=180)
    recovered = sum(s.num_recoveries for s in states.values() if s is not None)
    figures = Figures("redis-restart", jobs=len(specs), faults=len(outages),
                      extra={"retries_logged": retries, "jobs_recovered": recovered,
                             "down_s": ",".join(downtimes)})
    assert_none_lost(fleet, figures, pending, states)
    for spec in specs:
        figures.tokens_checked += assert_finished_exact(fleet.redis, spec, states[spec.job_id],
                                                        expected[spec.job_id])
    assert all(w.is_alive for w in workers)
    assert fleet.redis.zcard(KEYS.leases()) == 0
    figures.report()
