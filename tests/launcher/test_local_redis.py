"""`carpool up`'s own redis-server keeps what a 202 promises: SIGKILLed right after submissions
were acknowledged, it comes back with every one of them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from redis import Redis

from launcher.local_redis import LocalRedis
from protocol import JobReader, JobSpec, JobStatus, Keys, Priority, submit_job
from protocol.rq_keys import RQKeys
from tests.conftest import _free_port

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server is not installed")


def test_a_killed_local_redis_comes_back_with_every_acknowledged_job(tmp_path: Path) -> None:
    url = f"redis://127.0.0.1:{_free_port()}/0"
    local = LocalRedis.ensure(url, data_dir=tmp_path / "data")
    try:
        redis = Redis.from_url(url)
        config = redis.config_get("append*")
        assert (config["appendonly"], config["appendfsync"]) == ("yes", "always")
        ids = [f"job-{i}" for i in range(50)]
        for job_id in ids:
            submit_job(redis, JobSpec(job_id=job_id, model="tiny", prompt="hi"))
        assert local._process is not None
        local._process.kill()  # a crash right after the last acknowledgement
        local._process.wait(10)
        local = LocalRedis.ensure(url, data_dir=tmp_path / "data")
        redis = Redis.from_url(url)
        queue = RQKeys.queue(Keys().queue_name("tiny", Priority.NORMAL))
        assert [i.decode() for i in redis.lrange(queue, 0, -1)] == ids
        reader = JobReader(redis)
        assert all(reader.state(job_id).status is JobStatus.QUEUED for job_id in ids)
    finally:
        local.stop()


def test_without_a_data_dir_it_keeps_nothing(tmp_path: Path) -> None:
    url = f"redis://127.0.0.1:{_free_port()}/0"
    local = LocalRedis.ensure(url)
    try:
        assert Redis.from_url(url).config_get("appendonly") == {"appendonly": "no"}
    finally:
        local.stop()
