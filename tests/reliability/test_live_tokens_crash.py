"""A worker dies with live tokens out (sent to subscribers, not yet in the stream: "Live tokens" in
protocol/stream_steps.py): recovery writes them into the stream from its live journal (for a
stream on a stream shard: the next claim's adoption, from the journal on the shard), so the
subscriber's events and the stream agree token for token, though the next owner would have
generated other tokens at those indices.

Real Redis, the real API process and an SSE subscriber; synthetic workers (the real worker loop,
no model) whose token ids differ by worker, so a token regenerated instead of recovered shows.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from redis import Redis

from protocol import JobReader, JobStatus, Keys
from protocol.generation import TokenEntry
from tests.conftest import RedisServer
from tests.integration.conftest import wait_until
from tests.reliability.api_support import ApiProcess, start_redis, stop_redis
from worker.engine.synthetic_engine import SyntheticEngine, synthetic_token_id
from worker.jobs.batching_worker import BatchingWorker
from worker.jobs.settings import WorkerSettings

pytestmark = pytest.mark.reliability

KEYS = Keys()
NUM_TOKENS = 120
STEP_S = 0.02
NUM_LIVE_AT_CRASH = 5  # the worker dies once this many of its tokens are live only
OFFSET = 100_000  # the successor's token ids: synthetic_token_id(i) + OFFSET


class _Crash(BaseException):
    """Ends a worker's thread mid-loop, past its `except Exception`, without a publish."""


class _WorkerEngine(SyntheticEngine):
    """Token ids offset by `offset` (each worker its own); with `redis`, it crashes once the job
    it runs has NUM_LIVE_AT_CRASH tokens more than its stream holds (sent live only)."""

    def __init__(self, offset: int = 0, redis: Redis | None = None) -> None:
        super().__init__(4, STEP_S)
        self._offset = offset
        self._redis = redis
        self.num_tokens = 0  # of the one job it runs
        self.go = threading.Event()  # the first step waits for it (the subscriber is there)
        if redis is None:
            self.go.set()

    def step(self):  # type: ignore[no-untyped-def]
        assert self.go.wait(30)
        if self._redis is not None:
            job_ids = list(self._requests)
            if job_ids and (self.num_tokens - JobReader(self._redis).num_tokens(job_ids[0])
                            >= NUM_LIVE_AT_CRASH):
                raise _Crash
        output = super().step()
        self.num_tokens += sum(len(request.tokens) for request in output.outputs)
        for request in output.outputs:
            request.tokens[:] = [TokenEntry(t.index, t.token_id + self._offset, t.text)
                                 for t in request.tokens]
        return output


def _start(url: str, name: str, engine: _WorkerEngine, shard_urls: list[str]
           ) -> tuple[BatchingWorker, threading.Thread]:
    settings = WorkerSettings(model="synthetic", redis_url=url, name=name, max_num_seqs=4,
                              drain_seconds=0, lease_seconds=4, stream_redis_urls=shard_urls)
    assert settings.durable_interval_ms == 500  # the default: live tokens in between
    worker = BatchingWorker(settings, engine, Redis.from_url(url),  # type: ignore[arg-type]
                            register_presence=False)

    def run() -> None:
        try:
            worker.run()
        except _Crash:
            pass

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return worker, thread


def _follow(base_url: str, job_id: str, events: list[dict[str, str]]) -> None:
    with httpx.stream("GET", f"{base_url}/v1/jobs/{job_id}/stream", timeout=60) as response:
        event: dict[str, str] = {}
        for line in response.iter_lines():
            if not line:
                if event:
                    events.append(event)
                    if event.get("event") == "done":
                        return
                event = {}
            elif not line.startswith(":"):
                name, _, value = line.partition(":")
                event[name] = value.removeprefix(" ")


@pytest.fixture(params=["main", "shard"])
def stream_server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RedisServer | None]:
    """Where the job's stream lives: the main Redis, or a stream shard of the test's own."""
    if request.param == "main":
        yield None
        return
    shard = start_redis(tmp_path / "shard")
    try:
        yield shard
    finally:
        stop_redis(shard)


def test_a_dead_workers_live_tokens_reach_the_stream_before_its_job_resumes(
        redis_url: str, tmp_path: Path, stream_server: RedisServer | None) -> None:
    shard_urls = [stream_server.url] if stream_server is not None else []
    redis = Redis.from_url(redis_url)
    streams = Redis.from_url(shard_urls[0]) if shard_urls else redis  # the stream's server
    # The engine's own client: the worker's is not thread-safe.
    doomed = _WorkerEngine(redis=Redis.from_url(shard_urls[0] if shard_urls else redis_url))
    _, first = _start(redis_url, "doomed", doomed, shard_urls)
    # Connections from here on are the API's (the session's Redis may hold earlier tests' ones).
    last_client_id = max(int(c["id"]) for c in streams.client_list())
    api = ApiProcess.start(redis_url, tmp_path / "api.log", **(
        {"stream_redis_urls": shard_urls[0]} if shard_urls else {}))
    successor: BatchingWorker | None = None
    try:
        api.wait_healthy()
        wait_until(lambda: redis.hexists(KEYS.models(), "synthetic"), 30, "the model", api.log)
        response = httpx.post(f"{api.url}/v1/jobs", json={"prompt": "hello",
                                                           "max_tokens": NUM_TOKENS})
        assert response.status_code == 202, response.text
        job_id = response.json()["job_id"]
        events: list[dict[str, str]] = []
        follower = threading.Thread(target=_follow, args=(api.url, job_id, events), daemon=True)
        follower.start()
        # The API's stream hub subscribed to the step notifications: it gets them from here on.
        wait_until(lambda: streams.exists(KEYS.stream(job_id)) == 0 and any(
            int(c["id"]) > last_client_id and int(c.get("sub", 0)) > 0
            for c in streams.client_list()), 10,
            "the subscriber's hub to follow the notifications", api.log)
        doomed.go.set()
        first.join(timeout=30)
        assert not first.is_alive()
        in_stream_at_crash = JobReader(streams).num_tokens(job_id)
        # What the subscriber got live beyond the stream, before anyone took the job over.
        num_sent = in_stream_at_crash + NUM_LIVE_AT_CRASH
        wait_until(lambda: len(events) >= num_sent, 10, "the live tokens", api.log)
        assert len(events) == num_sent
        # The next owner's tokens differ: had it regenerated these, the subscriber's would not
        # be the stream's.
        successor, _ = _start(redis_url, "successor", _WorkerEngine(offset=OFFSET), shard_urls)
        follower.join(timeout=60)
        assert not follower.is_alive()
    finally:
        if successor is not None:
            successor.request_stop(0, None)
        api.stop()
    state = JobReader(redis).state(job_id)
    assert state is not None and state.status is JobStatus.FINISHED and state.num_recoveries == 1
    expected = [synthetic_token_id(i) for i in range(num_sent)] + [
        synthetic_token_id(i) + OFFSET for i in range(num_sent, NUM_TOKENS)]
    assert [t.token_id for t in JobReader(streams).tokens(job_id)] == expected
    assert list(state.token_ids) == expected
    tokens = [(e["id"], json.loads(e["data"])["token_id"]) for e in events
              if e["event"] == "token"]
    assert tokens == [(f"0-{i + 1}", token_id) for i, token_id in enumerate(expected)]
    assert events[-1]["event"] == "done"
    assert streams.exists(KEYS.live_journal("doomed")) == 1  # recovery reads it; it expires
    if shard_urls:  # nothing of the stream's on the main Redis
        assert redis.exists(KEYS.stream(job_id), KEYS.live_journal("doomed")) == 0
