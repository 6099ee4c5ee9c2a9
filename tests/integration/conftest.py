"""Real Redis + real worker processes (`python -m worker`) on the tiny model.

Each test module gets its own Redis database (never flushed while its workers live) and starts
the workers it needs; the expected outputs come from an in-process engine run of the same jobs,
undisturbed (no preemption, no crash).
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis import Redis

from protocol import FinishReason, JobReader, JobSpec, JobState, Keys, StreamEntry
from protocol.token_runs import expand_runs

KEYS = Keys()
REPO = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 240.0  # importing torch on a loaded 2-core box is slow
# Workers and the reference engine in fp32 on every CPU: dtype=auto would pick bf16 on AVX512-BF16
# machines, where a job resumed by a prefill may round differently from its undisturbed run.
FP32 = ["--dtype", "float32"]
# Database numbers handed out to fleets (each module, and tests/reliability's shared worker).
DATABASES = itertools.count(1)

PROMPTS = [
    "The quick brown fox",
    "Once upon a time",
    "Redis streams are",
    "In a continuous batch,",
    "Hello, my name is",
    "The capital of France is",
]


def sse_events(lines: Iterable[str]) -> Iterator[dict[str, str]]:
    """SSE events as dicts (id, event, data) from a response's lines; comments are skipped."""
    event: dict[str, str] = {}
    for line in lines:
        if not line:
            if event:
                yield event
            event = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(":")
            event[name] = value[1:] if value.startswith(" ") else value


@dataclass(slots=True)
class WorkerProcess:
    name: str
    args: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen | None = None

    def start(self) -> None:
        # Appending: a restarted worker's log follows its previous life's, for failure reports.
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "worker", "--name", self.name, *self.args],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
                 **self.env})

    def wait_ready(self, redis: Redis, deadline: float, since: float = 0.0) -> None:
        """Until the worker publishes stats (stamped at or after `since`: a restarted worker's
        name still has its previous life's stats for a few seconds)."""
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"worker {self.name} exited {self.process.returncode}:\n"
                                     f"{self.log()}")
            updated_at = redis.hget(KEYS.worker_stats(self.name), "updated_at")
            if updated_at is not None and float(updated_at) >= since:
                return
            time.sleep(0.1)
        raise AssertionError(f"worker {self.name} not ready in time:\n{self.log()}")

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout=timeout)

    @property
    def is_alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        if self.is_alive:
            self.process.send_signal(signal.SIGCONT)
            self.process.kill()
            self.process.wait(timeout=30)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]


@dataclass(slots=True)
class Fleet:
    """The workers of one test module, on its own Redis database."""

    redis_url: str
    model_dir: Path
    log_dir: Path
    redis: Redis = field(init=False)
    workers: list[WorkerProcess] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.redis = Redis.from_url(self.redis_url)

    def start(self, *specs: tuple[str, list[str]], model_dir: Path | None = None,
              env: dict[str, str] | None = None) -> list[WorkerProcess]:
        """Workers serving `model_dir` (default: the fleet's model), with extra environment."""
        started = []
        for name, extra in specs:
            worker = WorkerProcess(
                name, ["--model", str(model_dir or self.model_dir), "--redis-url", self.redis_url,
                       *FP32, *extra],
                self.log_dir / f"{name}.log", env=env or {})
            worker.start()
            started.append(worker)
        deadline = time.monotonic() + READY_TIMEOUT_S
        for worker in started:
            worker.wait_ready(self.redis, deadline)
        self.workers += started
        return started

    def stop_all(self) -> None:
        for worker in self.workers:
            worker.stop()

    def logs(self) -> str:
        return "\n".join(f"--- {w.name}\n{w.log()}" for w in self.workers)


@pytest.fixture(scope="module")
def fleet(redis_server: Any, tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[Fleet]:
    db = next(DATABASES)
    url = f"redis://127.0.0.1:{redis_server.port}/{db}"
    Redis.from_url(url).flushdb()
    fleet = Fleet(url, tiny_llama_dir, tmp_path_factory.mktemp("worker-logs"))
    yield fleet
    fleet.stop_all()
    fleet.redis.flushdb()


@pytest.fixture(scope="session")
def reference_engine(tiny_llama_dir: Path) -> Any:
    from worker.engine.config import EngineConfig
    from worker.engine.engine import Engine

    # One thread, like the workers under test: on a 2-core box more threads only contend.
    return Engine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_num_seqs=64, num_threads=1))


def new_id() -> str:
    return uuid.uuid4().hex


def make_specs(model: str, count: int, max_tokens: int = 24, seeded_every: int = 2,
               **overrides: Any) -> list[JobSpec]:
    """Alternating greedy and seeded-sampling jobs over PROMPTS.

    Seeded jobs sample from the top 8: a tiny random model's distribution over the whole
    vocabulary is so flat that float noise between batch shapes (fp32 matmuls differ in the last
    bits with the batch size) moves inverse-CDF sampling to a neighbouring token id now and
    then, which would make "equal to an undisturbed run" a coin toss rather than a test.
    """
    specs = []
    for i in range(count):
        sampling = (dict(temperature=0.0) if i % seeded_every == 0
                    else dict(temperature=0.8, top_k=8, seed=1000 + i))
        fields = dict(job_id=new_id(), model=model, prompt=PROMPTS[i % len(PROMPTS)],
                      max_tokens=max_tokens, **sampling)
        fields.update(overrides)
        specs.append(JobSpec.from_dict(fields))
    return specs


def expected_tokens(engine: Any, specs: list[JobSpec]) -> dict[str, list[int]]:
    """What an undisturbed run produces for each job."""
    completions = engine.generate([s.prompt for s in specs], [s.sampling for s in specs])
    return {spec.job_id: list(c.token_ids) for spec, c in zip(specs, completions)}


def wait_until(condition: Callable[[], Any], timeout: float, what: str,
               logs: Callable[[], str] = lambda: "") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}\n{logs()}")


def wait_final(fleet: Fleet, job_ids: list[str], timeout: float = 120.0) -> dict[str, JobState]:
    reader = JobReader(fleet.redis)

    def all_final() -> dict[str, JobState] | None:
        states = {job_id: reader.state(job_id) for job_id in job_ids}
        if all(s is not None and s.status.is_final for s in states.values()):
            return states
        return None

    def still_open() -> str:
        states = {job_id: reader.state(job_id) for job_id in job_ids}
        open_jobs = [f"{job_id}: {s.status.value if s else 'no state'}"
                     for job_id, s in states.items() if s is None or not s.status.is_final]
        return "not final: " + ", ".join(open_jobs) + "\n" + fleet.logs()

    return wait_until(all_final, timeout, f"{len(job_ids)} jobs to end", still_open)


def assert_stream_exact(redis: Redis, job_id: str, tokens: list[int],
                        reason: FinishReason | None = None) -> list[StreamEntry]:
    """Entry ids 0-1..0-n for tokens 0..n-1, each exactly once, then one final entry (as readers
    see the stream: a run of several tokens in one entry counts as its tokens, each written once)."""
    raw = redis.xrange(KEYS.stream(job_id))
    expanded = expand_runs(raw)
    assert len(expanded) == sum(len(f[b"token_ids"].split()) if f[b"kind"] == b"tokens" else 1
                                for _, f in raw), f"{job_id}: a token written twice"
    ids = [entry_id.decode() if isinstance(entry_id, bytes) else entry_id
           for entry_id, _ in expanded]
    entries = [StreamEntry.from_fields(fields) for _, fields in expanded]
    assert ids == [f"0-{i + 1}" for i in range(len(tokens) + 1)], job_id
    assert [e.kind for e in entries] == ["token"] * len(tokens) + ["done"]
    assert [e.index for e in entries[:-1]] == list(range(len(tokens)))
    assert [e.token_id for e in entries[:-1]] == tokens, job_id
    assert entries[-1].completion_tokens == len(tokens)
    if reason is not None:
        assert entries[-1].finish_reason is reason
    return entries


def stream_then_resume(client: httpx.Client, job_id: str, cut_after: int
                       ) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """A job's SSE stream read by a client that goes away after `cut_after` events and comes
    back with `Last-Event-ID`: the events before the cut and those after it."""
    first: list[dict[str, str]] = []
    with client.stream("GET", f"/v1/jobs/{job_id}/stream") as response:
        for event in sse_events(response.iter_lines()):
            first.append(event)
            if len(first) == cut_after:
                break  # the client goes away mid-stream
    with client.stream("GET", f"/v1/jobs/{job_id}/stream",
                       headers={"Last-Event-ID": first[-1]["id"]}) as response:
        rest = list(sse_events(response.iter_lines()))
    return first, rest
