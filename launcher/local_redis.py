"""Make sure a Redis answers at the configured URL before the local service starts.

Order: one already answering; else a `redis-server` we start on that port (and stop on exit);
else an in-process fakeredis server, which keeps nothing and is announced loudly as such.

Given a data directory, the redis-server we start keeps what a 202 promises: an append-only file
fsynced before every answer (`--appendfsync always`), so a job the API accepted survives Redis
being killed, and the next start finds the queue as it was (docker-compose.yml's Redis does the
same). Without one (the bench) it keeps nothing.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from protocol.redis_urls import shown_url

log = logging.getLogger(__name__)

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", ""}
# `carpool up` keeps its Redis' data here, one directory per port.
DEFAULT_DATA_DIR = Path("~/.cache/carpool/redis").expanduser()
DURABLE_ARGS = ("--appendonly", "yes", "--appendfsync", "always")


class RedisUnavailableError(RuntimeError):
    pass


def redis_answers(url: str, timeout_s: float = 0.5) -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_timeout=timeout_s,
                                         socket_connect_timeout=timeout_s).ping())
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        return False


@dataclass(slots=True)
class LocalRedis:
    """A Redis this process started for the local run; `stop()` ends it."""

    url: str
    kind: str  # "existing", "redis-server" or "fakeredis"
    _process: subprocess.Popen | None = None
    _fake_server: object | None = field(default=None, repr=False)

    @classmethod
    def ensure(cls, url: str, data_dir: Path | None = None) -> LocalRedis:
        if redis_answers(url):
            return cls(url=url, kind="existing")
        parsed = urlparse(url)
        if parsed.hostname not in LOCAL_HOSTS:
            raise RedisUnavailableError(
                f"no Redis answers at {shown_url(url)}, and it is not a local address we could "
                "start one on"
            )
        port = parsed.port or 6379
        binary = shutil.which("redis-server")
        if binary is not None:
            persistence: tuple[str, ...] = ("--appendonly", "no")
            if data_dir is not None:
                data_dir.mkdir(parents=True, exist_ok=True)
                persistence = (*DURABLE_ARGS, "--dir", str(data_dir))
            process = subprocess.Popen(
                [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", *persistence],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            _wait_until_answers(url)
            log.info("started redis-server on port %d (stopped again on exit; data: %s)", port,
                     data_dir or "none kept")
            return cls(url=url, kind="redis-server", _process=process)
        return cls._start_fakeredis(url, port)

    @classmethod
    def _start_fakeredis(cls, url: str, port: int) -> LocalRedis:
        try:
            from fakeredis import TcpFakeServer
        except ImportError as exc:
            raise RedisUnavailableError(
                "no Redis answers and redis-server is not installed: "
                "`sudo apt-get install redis-server`, or `docker compose up -d redis`"
            ) from exc
        server = TcpFakeServer(("127.0.0.1", port), server_type="redis")
        threading.Thread(target=server.serve_forever, daemon=True, name="fakeredis").start()
        _wait_until_answers(url)
        log.warning(
            "\n%s\nredis-server is not installed: serving an IN-MEMORY fakeredis on port %d.\n"
            "It keeps NOTHING across restarts and only this machine can reach it.\n"
            "Install the real one: `sudo apt-get install redis-server` (or docker compose).\n%s",
            "!" * 72, port, "!" * 72,
        )
        return cls(url=url, kind="fakeredis", _fake_server=server)

    def describe(self) -> str:
        """One line for the person who ran `carpool up`."""
        url = shown_url(self.url)
        return {"existing": f"found at {url}",
                "redis-server": f"started redis-server for {url} (stopped again on exit)",
                "fakeredis": f"IN-MEMORY fakeredis at {url}: it keeps nothing"}[self.kind]

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(timeout=10)
            self._process = None
        if self._fake_server is not None:
            self._fake_server.shutdown()  # type: ignore[attr-defined]
            self._fake_server = None


def _wait_until_answers(url: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if redis_answers(url, timeout_s=0.2):
            return
        time.sleep(0.05)
    raise RedisUnavailableError(f"started a Redis for {url} but it does not answer")
