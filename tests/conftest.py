"""Shared builders: tiny random models, the real SmolLM2, and a real Redis server per session."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from protocol import JobSpec, JobState, JobStatus, Keys, Priority
from protocol.keys import RQ_JOB_FUNCTION


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from worker.model.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from worker.model.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", seed=1)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from worker.model.loader import resolve_model_dir

    return resolve_model_dir("smollm2")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(slots=True)
class RedisServer:
    """A real redis-server on a free port, owned by the test session (tests may restart it)."""

    port: int
    directory: Path
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, appendonly: bool = False, extra_args: Sequence[str] = ()) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed (apt-get install redis-server)")
        # Each module with a fleet takes a database of its own (tests/integration/conftest.py
        # DATABASES): more than Redis' default 16.
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes" if appendonly else "no", "--dir", str(self.directory),
             "--databases", "256", *extra_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None

    def kill(self) -> None:
        """SIGKILL: a crash, not a shutdown (nothing is flushed that was not already)."""
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None

    def flush(self) -> None:
        import redis

        redis.Redis.from_url(self.url).flushall()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(port=_free_port(), directory=tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture()
def redis_url(redis_server: RedisServer) -> str:
    """A clean database on the session's real Redis server."""
    redis_server.flush()
    return redis_server.url


@pytest.fixture()
def unsaving_redis(redis_server: RedisServer, redis_url: str) -> Iterator[UnsavingRedis]:
    """The session's real Redis, which refuses writes with MISCONF once `fail_saves` ran, as a
    Redis whose disk filled up does; `allow_writes` (and the end of the test) lifts it."""
    unsaving = UnsavingRedis(redis_server)
    try:
        yield unsaving
    finally:
        unsaving.allow_writes()


class UnsavingRedis:
    def __init__(self, server: RedisServer) -> None:
        import redis

        self.client = redis.Redis.from_url(server.url)
        dump_name = self.client.config_get("dbfilename")["dbfilename"]
        self._dump = server.directory / dump_name

    def fail_saves(self) -> None:
        """A save point, and a save that fails: its file cannot replace a directory of its
        name. Redis' `stop-writes-on-bgsave-error` (on by default) then refuses every write."""
        self._dump.mkdir()
        self.client.config_set("save", "3600 1")
        self.client.bgsave()
        deadline = time.monotonic() + 10
        while self.client.info("persistence")["rdb_last_bgsave_status"] != "err":
            assert time.monotonic() < deadline, "the failing save did not fail"
            time.sleep(0.02)

    def allow_writes(self) -> None:
        """No save point: a failed save refuses nothing (as after a save succeeds)."""
        self.client.config_set("save", "")
        if self._dump.is_dir():
            self._dump.rmdir()


def pytest_sessionstart(session: pytest.Session) -> None:
    # Build the C++ CPU kernels once, here, before any test starts worker processes: a worker that a
    # test SIGKILLs in the middle of that first build would leave its build lock behind.
    from kernels import cpu_extension

    cpu_extension.load()


def spec_of(**fields: object) -> JobSpec:
    """A JobSpec from flat fields, the sampling ones (max_tokens, temperature...) included."""
    return JobSpec.from_dict(fields)


def enqueue_raw(redis: object, payload: object, job_id: str, model: str, keys: Keys = Keys(),
                priority: Priority = Priority.NORMAL) -> None:
    """Queue a job whose payload no API would write (bad values, not a JobSpec at all) on
    `model`'s queue, with its JobState and wake-up, the way submit_job does: for the worker's own
    checks."""
    from rq import Queue
    from rq.serializers import JSONSerializer

    queue_name = keys.queue_name(model, priority)
    # The state first, as submit_job writes it: written after the enqueue, it could land after a
    # worker had already failed the job and turn its final state back to queued.
    redis.hset(keys.state(job_id), mapping=JobState(job_id=job_id, status=JobStatus.QUEUED).to_fields())
    Queue(queue_name, connection=redis, serializer=JSONSerializer).enqueue_call(
        RQ_JOB_FUNCTION, args=[payload], job_id=job_id)
    redis.lpush(keys.wakeups(queue_name), 1)
