"""What a 202 promises: the job is on disk. A private redis-server configured exactly as
docker-compose.yml ships it is SIGKILLed right after a burst of 202s from the real API; once it
is back, every acknowledged job is there, queued, as it was accepted."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from redis import Redis

from protocol import JobReader, JobStatus, Priority
from protocol.rq_keys import RQKeys
from tests.conftest import RedisServer
from tests.reliability.api_support import (
    KEYS,
    REPO,
    ApiProcess,
    register_model,
    report,
    start_redis,
    stop_redis,
)

pytestmark = pytest.mark.reliability

NUM_SUBMISSIONS = 300


def _compose_redis_args() -> list[str]:
    """The persistence flags docker-compose.yml starts its Redis with (after `redis-server`)."""
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    command = compose["services"]["redis"]["command"]
    assert command[0] == "redis-server"
    return list(command[1:])


@pytest.fixture()
def stack(tiny_llama_dir: Path, tmp_path: Path) -> Iterator[tuple[ApiProcess, RedisServer, str]]:
    args = _compose_redis_args()
    assert args == ["--appendonly", "yes", "--appendfsync", "always"]
    server = start_redis(tmp_path / "redis", extra_args=args)
    api: ApiProcess | None = None
    try:
        model = register_model(Redis.from_url(server.url), tiny_llama_dir, max_model_len=64)
        api = ApiProcess.start(server.url, tmp_path / "api.log", max_queue_depth="100000")
        api.wait_healthy()
        yield api, server, model
    finally:
        if api is not None:
            api.stop()
        stop_redis(server)


async def _burst(api_url: str) -> list[str]:
    """NUM_SUBMISSIONS concurrent submissions; the ids of those answered 202."""
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=api_url, timeout=30, limits=limits) as client:
        responses = await asyncio.gather(*(
            client.post("/v1/jobs", json={"prompt": f"job {i}", "max_tokens": 4})
            for i in range(NUM_SUBMISSIONS)), return_exceptions=True)
    return [r.json()["job_id"] for r in responses
            if isinstance(r, httpx.Response) and r.status_code == 202]


def test_every_acknowledged_job_survives_redis_being_killed_right_after(
        stack: tuple[ApiProcess, RedisServer, str]) -> None:
    api, server, model = stack
    accepted = asyncio.run(_burst(api.url))
    server.kill()  # SIGKILL the moment the last answer is in: no shutdown, no flush
    assert len(accepted) == NUM_SUBMISSIONS
    server.start(extra_args=_compose_redis_args())
    redis = Redis.from_url(server.url)
    queued = {job_id.decode() for job_id in
              redis.lrange(RQKeys.queue(KEYS.queue_name(model, Priority.NORMAL)), 0, -1)}
    reader = JobReader(redis)
    missing = [job_id for job_id in accepted
               if job_id not in queued or (state := reader.state(job_id)) is None
               or state.status is not JobStatus.QUEUED or not redis.exists(RQKeys.job(job_id))]
    assert missing == []
    report("durable-submit", acknowledged=len(accepted), after_sigkill=len(accepted) - len(missing))
