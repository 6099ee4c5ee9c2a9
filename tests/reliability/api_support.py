"""Builders for the API half of the reliability suite (issue #8): a private redis-server, the API
as a real `python -m api` process (uvicorn), a worker on the tiny model, and what the tests read
back (SSE events, the API's resident memory, the one summary line per scenario).

Everything listens on and talks to 127.0.0.1 only; every process started here is killed by the
fixture that started it.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from redis import Redis

from protocol import Keys, ModelCard
from tests.conftest import RedisServer, _free_port
from tests.integration.conftest import (
    FP32,
    READY_TIMEOUT_S,
    REPO,
    WorkerProcess,
    sse_events,  # noqa: F401  (re-exported for the api tests here)
    wait_until,
)

KEYS = Keys()


def start_redis(directory: Path, appendonly: bool = False,
                extra_args: Sequence[str] = ()) -> RedisServer:
    """A redis-server of the test's own, on a free port (stopping it harms no other test)."""
    directory.mkdir(parents=True, exist_ok=True)
    server = RedisServer(port=_free_port(), directory=directory)
    server.start(appendonly=appendonly, extra_args=extra_args)
    return server


def stop_redis(server: RedisServer) -> None:
    if server.process is not None and server.process.poll() is None:
        server.process.kill()  # a stopped (SIGSTOP) one too: SIGKILL needs no cooperation
        server.process.wait(timeout=10)
    server.process = None


@dataclass(slots=True)
class ApiProcess:
    """`python -m api` under uvicorn, as a deployment runs it."""

    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    @classmethod
    def start(cls, redis_url: str, log_path: Path, **settings: str) -> ApiProcess:
        """`settings` become CARPOOL_* variables (max_queue_depth="50": CARPOOL_MAX_QUEUE_DEPTH)."""
        port = _free_port()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "CARPOOL_LOG_LEVEL": "warning",
               **{f"CARPOOL_{name.upper()}": value for name, value in settings.items()}}
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "api", "--host", "127.0.0.1", "--port", str(port),
                 "--redis-url", redis_url], cwd=REPO, env=env, stdout=log,
                stderr=subprocess.STDOUT)
        return cls(url=f"http://127.0.0.1:{port}", process=process, log_path=log_path)

    def wait_healthy(self, min_workers: int = 0, timeout: float = 60.0) -> None:
        """Until /healthz answers 200 (Redis up) with at least `min_workers` workers."""
        def healthy() -> bool:
            if self.process.poll() is not None:
                raise AssertionError(f"the API exited {self.process.returncode}:\n{self.log()}")
            try:
                response = httpx.get(f"{self.url}/healthz", timeout=1.0)
            except httpx.HTTPError:
                return False
            return response.status_code == 200 and response.json()["workers"] >= min_workers

        wait_until(healthy, timeout, "the API to answer /healthz", self.log)

    @property
    def is_alive(self) -> bool:
        return self.process.poll() is None

    def rss_bytes(self) -> int:
        """Resident memory now (VmRSS of /proc/PID/status, in kB there)."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS line: not Linux?")

    def cpu_seconds(self) -> float:
        """User + system CPU time the process has used so far."""
        return process_cpu_seconds(self.process.pid)

    def stop(self) -> None:
        if self.is_alive:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()  # a graceful shutdown that hangs is not this test's subject
                self.process.wait(timeout=10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]


# Runs in its own process, so that the latencies it measures are the API's, not the event loop
# or the GIL of a test process busy with hundreds of streams. Probes every INTERVAL until a line
# arrives on stdin, then prints the latencies (ms) as JSON. Usage: prober URL INTERVAL_S.
_PROBER = """
import http.client, json, select, sys, time
host, port = sys.argv[1].removeprefix("http://").split(":")
interval = float(sys.argv[2])
connection = http.client.HTTPConnection(host, int(port), timeout=10)
latencies, failures = [], 0
print("ready", flush=True)
while not select.select([sys.stdin], [], [], interval)[0]:
    started = time.perf_counter()
    try:
        connection.request("GET", "/healthz")
        response = connection.getresponse()
        response.read()
        ok = response.status == 200
    except (OSError, http.client.HTTPException):
        connection.close()
        ok = False
    latencies.append(1000 * (time.perf_counter() - started))
    failures += not ok
print(json.dumps({"latencies_ms": latencies, "failures": failures}), flush=True)
"""


@dataclass(slots=True)
class HealthzProber:
    """GET /healthz every `interval_s` from a process of its own, while the test loads the API."""

    process: subprocess.Popen[str]

    @classmethod
    def start(cls, api_url: str, interval_s: float = 0.02) -> HealthzProber:
        process = subprocess.Popen([sys.executable, "-c", _PROBER, api_url, str(interval_s)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert process.stdout is not None and process.stdout.readline() == "ready\n"
        return cls(process)

    def stop(self) -> tuple[list[float], int]:
        """(latencies in ms, probes that failed or answered other than 200)."""
        try:
            out, _ = self.process.communicate("stop\n", timeout=30)
        finally:
            self.kill()
        result = json.loads(out)
        return result["latencies_ms"], result["failures"]

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


def process_cpu_seconds(pid: int) -> float:
    # Fields 14 and 15 of /proc/PID/stat, counted after the parenthesised command name.
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_worker(name: str, redis_url: str, model_dir: Path, log_dir: Path,
                 args: list[str]) -> WorkerProcess:
    """A real `python -m worker` on `model_dir`, ready (its stats are in Redis) when returned."""
    worker = WorkerProcess(name, ["--model", str(model_dir), "--redis-url", redis_url, *FP32, *args],
                           log_dir / f"{name}.log")
    worker.start()
    try:
        worker.wait_ready(Redis.from_url(redis_url), time.monotonic() + READY_TIMEOUT_S)
    except BaseException:
        worker.stop()
        raise
    return worker


def register_model(redis: Redis, model_dir: Path, max_model_len: int) -> str:
    """What a worker publishes at start (its ModelCard and tokenizer.json), for tests that need
    the API to accept jobs but no worker to run them."""
    name = model_dir.name
    template = model_dir / "chat_template.jinja"
    card = ModelCard(name=name, max_model_len=max_model_len, eos_token="<|im_end|>",
                     bos_token="<|im_start|>",
                     chat_template=template.read_text() if template.is_file() else None)
    with redis.pipeline(transaction=True) as pipe:
        pipe.hset(KEYS.models(), name, card.to_json())
        pipe.set(KEYS.model_tokenizer(name), (model_dir / "tokenizer.json").read_text())
        pipe.execute()
    return name


def percentile(values: list[float], fraction: float) -> float:
    """The nearest-rank percentile (p99 of 200 probes is the 198th smallest)."""
    ordered = sorted(values)
    return ordered[max(1, math.ceil(len(ordered) * fraction)) - 1]


def report(name: str, **figures: object) -> str:
    """Print the scenario's one summary line (the README quotes it); `-s` shows it."""
    line = f"RELIABILITY {name}: " + " ".join(f"{key}={value}" for key, value in figures.items())
    print(f"\n{line}", flush=True)
    return line


def timed(call: Callable[[], httpx.Response]) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    response = call()
    return response, time.monotonic() - started
