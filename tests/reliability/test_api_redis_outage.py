"""Redis outage, from the API's side: the real API process (uvicorn) in front of a private
redis-server that the test kills (a crash: connections refused) and then freezes (SIGSTOP: a hung
Redis, where only socket timeouts end a command).

Every route that needs Redis must answer 503 with Retry-After and a message saying so, within a
bounded time (no hang); /healthz reports Redis down; an open SSE stream ends once the outage
outlasts CARPOOL_STREAM_OUTAGE_S, so its client can reconnect; and once Redis is back the same
API process serves again, jobs and streams included, without a restart.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis import Redis

from api.context import REDIS_RETRIES
from protocol import FinishReason, JobStatus, StreamEntry, stream_ids
from tests.conftest import RedisServer
from tests.integration.conftest import wait_until
from tests.reliability.api_support import (
    KEYS,
    ApiProcess,
    register_model,
    report,
    sse_events,
    start_redis,
    stop_redis,
)

pytestmark = pytest.mark.reliability

RETRY_AFTER_S = 2
REDIS_TIMEOUT_S = 1.0
STREAM_BLOCK_MS = 200
# Redis down: a refused connection fails at once, retried REDIS_RETRIES times a few ms apart.
DOWN_BOUND_S = 1.0
# Redis hung: each attempt waits out a socket timeout (the stream-reading client's is longer by
# the XREAD block), and a reconnect may wait out one more on its handshake.
HUNG_BOUND_S = (REDIS_RETRIES + 1) * 2 * (REDIS_TIMEOUT_S + STREAM_BLOCK_MS / 1000) + 1.0
RECOVERY_BOUND_S = 5.0
# An open stream rides out this much of an outage (tests/reliability/test_stream_outage.py has
# the outage it outlasts); this one outlasts it.
STREAM_OUTAGE_S = 1.0
CHAT = [{"role": "user", "content": "What is 2+2?"}]
REDIS_DOWN = "Redis is unreachable; the job queue is unavailable, try again shortly"


@dataclass(frozen=True, slots=True)
class Route:
    method: str
    path: str  # `{job}`: a real job id
    body: Any = None

    @property
    def is_openai(self) -> bool:
        return self.path.startswith(("/v1/completions", "/v1/chat/", "/v1/models", "/tokenize"))


def _routes(model: str) -> list[Route]:
    """Every route that needs Redis."""
    return [
        Route("POST", "/v1/jobs", {"prompt": "Hello", "max_tokens": 4}),
        Route("GET", "/v1/jobs"),
        Route("GET", "/v1/jobs/{job}"),
        Route("GET", "/v1/jobs/{job}/stream"),
        Route("DELETE", "/v1/jobs/{job}"),
        Route("POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 4}),
        Route("POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "stream": True}),
        Route("POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4}),
        Route("POST", "/v1/chat/completions", {"messages": CHAT, "stream": True}),
        Route("GET", "/v1/models"),
        Route("GET", f"/v1/models/{model}"),
        Route("POST", "/tokenize", {"prompt": "Hello"}),
        Route("GET", "/metrics"),
        Route("GET", "/v1/stats"),
    ]


@dataclass(slots=True)
class OutageStack:
    api: ApiProcess
    server: RedisServer
    redis: Redis
    model: str


@pytest.fixture()
def stack(tiny_llama_dir: Path, tmp_path: Path) -> Iterator[OutageStack]:
    # Append-only, fsynced at every write: the Redis that comes back has every job it had.
    server = start_redis(tmp_path / "redis", appendonly=True,
                         extra_args=("--appendfsync", "always"))
    api: ApiProcess | None = None
    try:
        redis = Redis.from_url(server.url, socket_timeout=5)
        model = register_model(redis, tiny_llama_dir, max_model_len=64)  # no worker needed
        api = ApiProcess.start(server.url, tmp_path / "api.log",
                               redis_timeout_s=str(REDIS_TIMEOUT_S),
                               retry_after_s=str(RETRY_AFTER_S),
                               stream_block_ms=str(STREAM_BLOCK_MS), sse_keepalive_s="1",
                               stream_outage_s=str(STREAM_OUTAGE_S))
        api.wait_healthy()
        yield OutageStack(api=api, server=server, redis=redis, model=model)
    finally:
        if api is not None:
            api.stop()
        stop_redis(server)


@dataclass(slots=True)
class Probe:
    route: Route
    status: int
    elapsed_s: float
    body: Any
    retry_after: str | None


def _probe(client: httpx.Client, route: Route, job_id: str) -> Probe:
    path = route.path.replace("{job}", job_id)
    started = time.monotonic()
    response = client.request(route.method, path, json=route.body)
    elapsed = time.monotonic() - started
    try:
        body = response.json()
    except ValueError:
        body = response.text
    return Probe(route, response.status_code, elapsed, body, response.headers.get("retry-after"))


def _probe_all(api: ApiProcess, routes: list[Route], job_id: str) -> list[Probe]:
    """All routes at once, as a live service sees them (and so that a hung phase costs one
    timeout, not one per route)."""
    # One client for all (httpx clients are thread-safe): building one per request costs tens of
    # milliseconds of the test's own CPU, which would be timed as the API's.
    limits = httpx.Limits(max_connections=len(routes))
    with httpx.Client(base_url=api.url, timeout=30, limits=limits) as client, \
            ThreadPoolExecutor(max_workers=len(routes)) as pool:
        return list(pool.map(lambda route: _probe(client, route, job_id), routes))


def _assert_unavailable(probes: list[Probe], bound_s: float) -> None:
    for probe in probes:
        where = f"{probe.route.method} {probe.route.path}"
        assert probe.status == 503, (where, probe.status, probe.body)
        assert probe.retry_after == str(RETRY_AFTER_S), where
        if probe.route.is_openai:
            assert probe.body["error"]["message"] == REDIS_DOWN, where
            assert probe.body["error"]["code"] == "service_unavailable", where
        else:
            assert probe.body == {"detail": REDIS_DOWN}, where
        assert probe.elapsed_s < bound_s, (where, probe.elapsed_s)


def _assert_healthz_down(api: ApiProcess, bound_s: float) -> float:
    started = time.monotonic()
    response = httpx.get(f"{api.url}/healthz", timeout=30)
    elapsed = time.monotonic() - started
    assert response.status_code == 503
    assert response.headers["retry-after"] == str(RETRY_AFTER_S)
    assert response.json() == {"status": "redis_unreachable", "redis": False, "workers": 0,
                               "models": [], "models_without_workers": []}
    assert elapsed < bound_s
    return elapsed


def _wait_recovered(api: ApiProcess) -> float:
    """Seconds until /healthz says Redis answers again and a job is accepted."""
    started = time.monotonic()

    def serving() -> bool:
        try:
            health = httpx.get(f"{api.url}/healthz", timeout=5)
            job = httpx.post(f"{api.url}/v1/jobs", json={"prompt": "Hello", "max_tokens": 2},
                             timeout=5)
        except httpx.HTTPError:
            return False
        return health.json()["redis"] is True and job.status_code == 202

    wait_until(serving, RECOVERY_BOUND_S, "the API to serve again after Redis came back", api.log)
    return time.monotonic() - started


@dataclass(slots=True)
class Subscriber:
    """An SSE client following a job in a thread; records its events and when its stream ended."""

    url: str
    events: list[dict[str, str]] = field(default_factory=list)
    ended_at: float | None = None
    error: str | None = None
    thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._follow, daemon=True)
        self.thread.start()

    def _follow(self) -> None:
        try:
            with httpx.stream("GET", self.url, timeout=httpx.Timeout(10, read=30)) as response:
                assert response.status_code == 200
                self.events.extend(sse_events(response.iter_lines()))
        except httpx.HTTPError as exc:
            self.error = repr(exc)
        self.ended_at = time.monotonic()


def _finish_like_a_worker(redis: Redis, job_id: str, texts: list[str]) -> None:
    """The stream entries and final state a worker writes for a job, in one transaction."""
    with redis.pipeline(transaction=True) as pipe:
        for index, text in enumerate(texts):
            entry = StreamEntry(kind=StreamEntry.TOKEN, index=index, token_id=100 + index,
                                text=text)
            pipe.xadd(KEYS.stream(job_id), entry.to_fields(),
                      id=stream_ids.token_entry_id(index))
        done = StreamEntry(kind=StreamEntry.DONE, finish_reason=FinishReason.LENGTH,
                           prompt_tokens=2, completion_tokens=len(texts))
        pipe.xadd(KEYS.stream(job_id), done.to_fields(), id=stream_ids.done_entry_id(len(texts)))
        pipe.hset(KEYS.state(job_id), mapping={
            "status": JobStatus.FINISHED.value, "finish_reason": FinishReason.LENGTH.value,
            "completion_tokens": len(texts), "text": "".join(texts), "finished_at": time.time()})
        pipe.execute()


def test_api_answers_503_while_redis_is_down_or_hung_and_recovers_without_restart(
        stack: OutageStack) -> None:
    api, server = stack.api, stack.server
    routes = _routes(stack.model)
    with httpx.Client(base_url=api.url, timeout=10) as client:
        job = client.post("/v1/jobs", json={"prompt": "Hello", "max_tokens": 3})
        assert job.status_code == 202
        job_id = job.json()["job_id"]
    subscriber = Subscriber(f"{api.url}/v1/jobs/{job_id}/stream")
    subscriber.start()
    time.sleep(0.5)  # it is waiting on the stream (XREAD BLOCK) when Redis dies

    # 1. Redis crashes (SIGKILL): connections are refused.
    killed_at = time.monotonic()
    server.kill()
    down = _probe_all(api, routes, job_id)
    healthz_down_s = _assert_healthz_down(api, DOWN_BOUND_S)
    _assert_unavailable(down, DOWN_BOUND_S)
    wait_until(lambda: subscriber.ended_at is not None, 10, "the open SSE stream to end")
    sse_ended_s = subscriber.ended_at - killed_at
    assert sse_ended_s >= STREAM_OUTAGE_S  # it waited for Redis that long first
    assert subscriber.error is None and subscriber.events == []  # a clean end: reconnect later
    # What needs no Redis is still served.
    assert httpx.get(f"{api.url}/", timeout=10).status_code == 200
    assert httpx.get(f"{api.url}/openapi.json", timeout=10).status_code == 200

    # 2. Redis comes back with its data (append-only file): the same API process serves again.
    server.start(appendonly=True, extra_args=("--appendfsync", "always"))
    recovered_s = _wait_recovered(api)
    with httpx.Client(base_url=api.url, timeout=10) as client:
        assert client.get(f"/v1/jobs/{job_id}").json()["status"] == "queued"
        _finish_like_a_worker(stack.redis, job_id, ["a", "b", "c"])
        with client.stream("GET", f"/v1/jobs/{job_id}/stream",
                           headers={"Last-Event-ID": "0-1"}) as response:
            resumed = list(sse_events(response.iter_lines()))
    assert [event["id"] for event in resumed] == ["0-2", "0-3", "0-4"]
    assert [json.loads(event["data"]).get("text") for event in resumed] == ["b", "c", None]

    # 3. Redis hangs (SIGSTOP): only socket timeouts end a command.
    server.process.send_signal(signal.SIGSTOP)
    try:
        hung = _probe_all(api, routes, job_id)
        healthz_hung_s = _assert_healthz_down(api, HUNG_BOUND_S)
    finally:
        server.process.send_signal(signal.SIGCONT)
    _assert_unavailable(hung, HUNG_BOUND_S)
    recovered_hung_s = _wait_recovered(api)
    assert api.is_alive, api.log()

    report("api-redis-outage", routes=len(routes) + 1,
           down_503=sum(p.status == 503 for p in down) + 1,
           down_max_ms=round(1000 * max([healthz_down_s, *(p.elapsed_s for p in down)])),
           sse_ended_ms=round(1000 * sse_ended_s), recovered_ms=round(1000 * recovered_s),
           hung_503=sum(p.status == 503 for p in hung) + 1,
           hung_max_ms=round(1000 * max([healthz_hung_s, *(p.elapsed_s for p in hung)])),
           hung_bound_ms=round(1000 * HUNG_BOUND_S),
           recovered_after_hang_ms=round(1000 * recovered_hung_s), api_restarts=0)
