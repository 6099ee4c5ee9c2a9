"""Reliability suite (issue #8), worker side: faults injected into real `python -m worker`
processes on a real Redis, checked entry for entry against an undisturbed in-process run.

Builds on tests/integration/conftest.py (WorkerProcess, Fleet, the reference engine, the exact
stream check) rather than copying it. What is added here: bounded waits that also fail on a
stall, fault helpers (restart under the same name, wait for SIGSTOP to bite), and the one summary
line per scenario (`RELIABILITY name: jobs=... faults=... tokens_checked=... lost=0`) that the
README quotes; run with `-s` to see it.
"""

from __future__ import annotations

import signal
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from protocol import FinishReason, JobSpec, JobState, JobStatus, WorkerStats
from protocol.rq_keys import RQKeys
from protocol.stream_ids import entry_index
from tests.conftest import RedisServer, _free_port
from tests.integration import conftest as integration
from tests.integration.conftest import (
    KEYS,
    READY_TIMEOUT_S,
    Fleet,
    WorkerProcess,
    assert_stream_exact,
)

# The integration suite's fixtures, offered to this directory under their own names: a fleet of
# worker processes per test module (on its own database of the session's Redis), and the
# undisturbed in-process engine run that every stream is compared with.
fleet = integration.fleet
reference_engine = integration.reference_engine

# Short leases so a crashed worker's jobs come back within seconds, yet long enough that a live
# worker starved of CPU for a moment (workers, Redis and the test share two cores) keeps them:
# the crash tests count recoveries exactly. Workers idle-block briefly so they sweep for lapsed
# leases often; one torch thread each.
FAST_RECOVERY_ARGS = ["--lease-seconds", "3", "--idle-block-seconds", "0.25", "--num-threads", "1"]
# A worker whose KV pool is far too small for its seats (8 seats; 10 blocks of 16 tokens hold
# one job of ~100 tokens, or three of ~40), with a small step budget so that resumed jobs
# rebuild their cache in several prefill chunks.
TIGHT_NUM_KV_BLOCKS = 10
TIGHT_ARGS = ["--max-num-seqs", "8", "--max-num-batched-tokens", "32",
              "--num-kv-blocks", str(TIGHT_NUM_KV_BLOCKS), *FAST_RECOVERY_ARGS]


@dataclass(slots=True)
class Figures:
    """What one scenario did, printed as one line for the README's RELIABILITY section."""

    name: str
    jobs: int = 0
    faults: int = 0
    tokens_checked: int = 0
    lost: int = 0
    extra: dict[str, int | float | str] = field(default_factory=dict)

    def line(self) -> str:
        extra = "".join(f" {key}={value}" for key, value in self.extra.items())
        return (f"RELIABILITY {self.name}: jobs={self.jobs} faults={self.faults} "
                f"tokens_checked={self.tokens_checked} lost={self.lost}{extra}")

    def report(self) -> None:
        print(f"\n{self.line()}", flush=True)


def read_states(redis: Redis, job_ids: list[str]) -> dict[str, JobState | None]:
    """Every job's JobState in one round trip."""
    with redis.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.hgetall(KEYS.state(job_id))
        replies = pipe.execute()
    return {job_id: JobState.from_fields(raw) if raw else None
            for job_id, raw in zip(job_ids, replies)}


def num_stream_entries(redis: Redis, job_ids: list[str]) -> int:
    """Entries in all the jobs' streams together, one per token however the worker wrote them
    (a run of several tokens is one stream entry: protocol/token_runs.py), plus the final ones:
    the progress a fault is timed against. An entry id's sequence counts the entries up to it."""
    with redis.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.xrevrange(KEYS.stream(job_id), count=1)
        return sum(entry_index(last[0][0]) + 1 for last in pipe.execute() if last)


def describe(fleet: Fleet, job_ids: list[str]) -> str:
    """Where the jobs stand, for failure messages: statuses by worker, queues, leases, stats."""
    try:
        states = read_states(fleet.redis, job_ids)
        by_status = Counter((s.status.value, s.worker) if s else ("missing", "")
                            for s in states.values())
        queues = {name: fleet.redis.llen(RQKeys.queue(name))
                  for name in KEYS.queue_names(fleet.model_dir.name)}
        now_ms = time.time() * 1000
        leases = {job_id.decode()[:8]: round((deadline - now_ms) / 1000, 1) for job_id, deadline
                  in fleet.redis.zrange(KEYS.leases(), 0, -1, withscores=True)}
        stats = {w.name: worker_stats(fleet.redis, w.name) for w in fleet.workers}
        return (f"jobs by (status, worker): {dict(by_status)}\nqueues: {queues}\n"
                f"lease deadlines (s from now): {leases}\nworker stats: {stats}\n"
                f"stream entries: {num_stream_entries(fleet.redis, job_ids)}\n")
    except RedisConnectionError as exc:
        return f"(Redis unreachable: {exc})\n"


def wait_settled(fleet: Fleet, job_ids: list[str], timeout: float, stall_s: float = 45.0
                 ) -> tuple[dict[str, JobState | None], list[str]]:
    """Wait until every job is final; returns (states, ids still not final).

    Gives up early when nothing moves for `stall_s` (no stream entry, no job ending): a deadlock
    fails in seconds, not at the outer timeout. Does not raise, so the caller can print its
    figures (lost=N) before asserting.
    """
    deadline = time.monotonic() + timeout
    last_progress, last_change = -1, time.monotonic()
    while True:
        states = read_states(fleet.redis, job_ids)
        pending = [job_id for job_id, state in states.items()
                   if state is None or not state.status.is_final]
        now = time.monotonic()
        if not pending or now >= deadline:
            return states, pending
        progress = num_stream_entries(fleet.redis, job_ids) + len(job_ids) - len(pending)
        if progress != last_progress:
            last_progress, last_change = progress, now
        elif now - last_change >= stall_s:
            return states, pending
        time.sleep(0.1)


def assert_none_lost(fleet: Fleet, figures: Figures, pending: list[str],
                     states: dict[str, JobState | None]) -> None:
    figures.lost = len(pending)
    if pending:
        figures.report()  # the figures of a failed run are worth seeing too
        shown = {job_id: states[job_id] for job_id in pending[:5]}
        raise AssertionError(f"{len(pending)} jobs never ended, e.g. {shown}\n"
                             f"{describe(fleet, list(states))}{fleet.logs()}")


def assert_finished_exact(redis: Redis, spec: JobSpec, state: JobState | None,
                          expected: list[int]) -> int:
    """A job that ran to its end: the undisturbed run's tokens, stream entries 0..n-1 once each,
    then the final entry. Returns the number of tokens compared."""
    assert state is not None and state.status is JobStatus.FINISHED, (spec.job_id, state)
    assert list(state.token_ids) == expected, spec.job_id
    reason = FinishReason.LENGTH if len(expected) == spec.sampling.max_tokens else FinishReason.STOP
    assert_stream_exact(redis, spec.job_id, expected, reason)
    return len(expected)


def worker_stats(redis: Redis, name: str) -> WorkerStats | None:
    raw = redis.hgetall(KEYS.worker_stats(name))
    return WorkerStats.from_fields(raw) if raw else None


def restart(worker: WorkerProcess) -> float:
    """Start a killed worker again under the same name (as a supervisor would); returns the wall
    time its fresh stats must postdate (see `wait_ready`)."""
    assert not worker.is_alive, worker.name
    since = time.time()
    worker.start()
    return since


def wait_ready_since(fleet: Fleet, worker: WorkerProcess, since: float) -> None:
    worker.wait_ready(fleet.redis, time.monotonic() + READY_TIMEOUT_S, since=since)


def kill(worker: WorkerProcess) -> None:
    worker.signal(signal.SIGKILL)
    worker.wait(30)


def is_stopped(worker: WorkerProcess) -> bool:
    """The kernel has stopped the process (SIGSTOP delivered): state 'T' in /proc/PID/stat."""
    stat = Path(f"/proc/{worker.process.pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")


def counter(redis: Redis, name: str) -> int:
    return int(redis.hget(KEYS.counters(), name) or 0)


@pytest.fixture(scope="package")
def tight_fleet(redis_server: RedisServer, tiny_llama_dir: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """The TIGHT_ARGS worker on a database of its own, shared by the cancel-storm and
    preemption-pressure modules: starting a worker costs seconds of CPU on this box, and each
    module's checks hold whatever the other ran before it."""
    url = f"redis://127.0.0.1:{redis_server.port}/{next(integration.DATABASES)}"
    fleet = Fleet(url, tiny_llama_dir, tmp_path_factory.mktemp("tight-worker-logs"))
    fleet.redis.flushdb()
    try:
        fleet.start(("tight", TIGHT_ARGS))
        yield fleet
    finally:
        fleet.stop_all()
        fleet.redis.flushdb()


# redis-server flags for the Redis-restart scenario: every write in the append-only file, fsynced
# before Redis answers, so killing it loses nothing a worker was told had happened.
AOF: dict[str, Any] = dict(appendonly=True, extra_args=("--appendfsync", "always"))


@pytest.fixture()
def aof_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A private redis-server with the append-only file fsynced at every write, so a SIGKILL of
    Redis loses nothing it acknowledged; restart it with `.start(**AOF)` on the same port/dir."""
    server = RedisServer(port=_free_port(), directory=tmp_path / "redis")
    server.directory.mkdir()
    server.start(**AOF)
    try:
        yield server
    finally:
        server.kill()

