"""Registering the worker with RQ: a live namesake is refused, a crashed one (this host, its
process gone) is taken over at once, so a supervisor can restart a worker with a fixed --name."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from redis import Redis
from rq import Worker

from tests.worker.jobs.job_support import KEYS, fake_redis
from worker.jobs.rq_presence import RQPresence


def _crashed_namesake(redis: Redis, hostname: str, pid: int) -> None:
    """A worker named w1 that registered, heartbeated just now and never registered a death."""
    namesake = Worker(KEYS.queue_names("tiny"), name="w1", connection=redis)
    namesake.register_birth()
    redis.hset(namesake.key, mapping={"hostname": hostname, "pid": pid})


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: no process has this pid any more
    return child.pid


def _register(redis: Redis) -> RQPresence:
    presence = RQPresence(redis, "w1", KEYS.queue_names("tiny"), ttl_seconds=30)
    presence.register_birth()
    return presence


@pytest.mark.parametrize("pid", [_dead_pid, os.getpid], ids=["process-gone", "same-pid-restart"])
def test_a_crashed_worker_of_this_host_is_taken_over_at_once(pid) -> None:
    redis = fake_redis()
    _crashed_namesake(redis, socket.gethostname(), pid())
    presence = _register(redis)
    assert int(redis.hget(presence.worker.key, "pid")) == os.getpid()
    assert [w.name for w in Worker.all(connection=redis)] == ["w1"]


@pytest.mark.parametrize(("hostname", "pid"), [
    (socket.gethostname(), os.getppid()),  # alive here: a second worker given the same name
    ("another-host", 12345),  # cannot tell from here: it may be alive
], ids=["live-process-here", "other-host"])
def test_a_namesake_that_may_be_alive_is_refused(hostname: str, pid: int) -> None:
    redis = fake_redis()
    _crashed_namesake(redis, hostname, pid)
    with pytest.raises(ValueError, match="an RQ worker named 'w1' is alive"):
        _register(redis)
