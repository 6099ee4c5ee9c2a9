"""A Redis failover under a running fleet, as a managed Redis does it: the primary is demoted to
a replica of the one promoted, and its address (here a TCP forwarder standing in for the DNS
name) leads to the new primary from then on, while connections made before stay on the old one.

There every write is refused (READONLY). The API answers 503, the worker and the webhook
dispatcher wait it out, and each drops its idle connections, so that new ones reach the new
primary: the running job goes on there and ends with every token once, its webhook is delivered,
and the next requests are answered. Before, the API answered 500 (a chat request a reset
connection) and the worker and the dispatcher died; their pooled connections would have stayed
on the old primary for good.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from redis import Redis

from protocol import JobReader, JobStatus, Keys
from tests.conftest import RedisServer
from tests.reliability.api_support import ApiProcess, start_redis, stop_redis
from tests.webhooks.receiver import SECRET, running_receiver
from webhooks.dispatcher import WebhookDispatcher
from webhooks.settings import DispatcherSettings
from worker.engine.synthetic_engine import SyntheticEngine, synthetic_token_id
from worker.jobs.batching_worker import BatchingWorker
from worker.jobs.settings import WorkerSettings

pytestmark = pytest.mark.reliability

NUM_TOKENS = 80


class Forwarder:
    """A TCP port whose new connections go to `target_port` (changed at any time); those made
    before stay where they went, as connections to a DNS name do when the name moves."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target_port))
            threading.Thread(target=_pump, args=(client, server), daemon=True).start()

    def close(self) -> None:
        self._closed = True
        self._listener.close()


def _pump(a: socket.socket, b: socket.socket) -> None:
    try:
        while True:
            readable, _, _ = select.select([a, b], [], [], 1.0)
            for source in readable:
                data = source.recv(65536)
                if not data:
                    return
                (b if source is a else a).sendall(data)
    except OSError:
        return
    finally:
        a.close()
        b.close()


def _in_sync(primary: Redis, replica: Redis) -> bool:
    replication = replica.info("replication")
    return (replication.get("master_link_status") == "up"
            and replication["slave_repl_offset"] == primary.info("replication")["master_repl_offset"])


def _fail_over(old: Redis, new: RedisServer, forwarder: Forwarder) -> None:
    """`new` (a replica of `old`) promoted once it holds every write, `old` demoted to its
    replica, and the address moved to `new`; `old`'s writes paused meanwhile."""
    promoted = Redis.from_url(new.url)
    old.execute_command("CLIENT", "PAUSE", "5000", "WRITE")
    deadline = time.monotonic() + 10
    while not _in_sync(old, promoted):
        assert time.monotonic() < deadline, "the replica did not catch up"
        time.sleep(0.01)
    promoted.replicaof("NO", "ONE")
    old.replicaof("127.0.0.1", new.port)
    forwarder.target_port = new.port
    old.execute_command("CLIENT", "UNPAUSE")


@pytest.fixture()
def pair(tmp_path: Path) -> Iterator[tuple[RedisServer, RedisServer]]:
    """A primary and its replica."""
    primary, replica = start_redis(tmp_path / "a"), start_redis(tmp_path / "b")
    Redis.from_url(replica.url).replicaof("127.0.0.1", primary.port)
    try:
        yield primary, replica
    finally:
        for server in (primary, replica):
            stop_redis(server)


def test_a_failover_to_a_new_primary_under_a_running_job(
        pair: tuple[RedisServer, RedisServer], tmp_path: Path) -> None:
    primary, replica = pair
    forwarder = Forwarder(primary.port)
    old = Redis.from_url(primary.url)
    settings = WorkerSettings(model="synthetic", redis_url=forwarder.url, name="w0",
                              max_num_seqs=4, drain_seconds=0, lease_seconds=10,
                              redis_timeout_seconds=2)
    worker = BatchingWorker(settings, SyntheticEngine(4, 0.05),  # type: ignore[arg-type]
                            Redis.from_url(forwarder.url))
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    dispatcher = WebhookDispatcher(Redis.from_url(forwarder.url), DispatcherSettings(
        webhook_secret=SECRET, webhook_allowed_hosts=["127.0.0.1"]), "d1")
    stop_dispatching = threading.Event()
    dispatching = threading.Thread(target=dispatcher.run, args=(stop_dispatching,), daemon=True)
    dispatching.start()
    api = ApiProcess.start(forwarder.url, tmp_path / "api.log", retry_after_s="2",
                           webhook_allowed_hosts="127.0.0.1")
    receiving = running_receiver()
    receiver = receiving.__enter__()
    try:
        api.wait_healthy()
        deadline = time.monotonic() + 60
        while not old.hexists(Keys().models(), "synthetic"):
            assert time.monotonic() < deadline, "the worker did not register"
            time.sleep(0.05)
        with httpx.Client(base_url=api.url, timeout=30) as client:
            submitted = client.post("/v1/jobs", json={
                "prompt": "hi", "max_tokens": NUM_TOKENS, "webhook_url": receiver.url("/hook")})
            assert submitted.status_code == 202, submitted.text
            job_id = submitted.json()["job_id"]
            deadline = time.monotonic() + 30
            while not JobReader(old).state(job_id).first_token_at:
                assert time.monotonic() < deadline, "no first token"
                time.sleep(0.02)
            _fail_over(old, replica, forwarder)
            # The API's pooled connections reach the old primary: the first write refused there
            # is a 503 that drops them; the next request's connections reach the new one.
            chat = {"model": "synthetic", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 5}
            statuses = []
            deadline = time.monotonic() + 30
            while not statuses or statuses[-1] != 200:
                assert time.monotonic() < deadline, (
                    f"never answered after the failover: {len(statuses)} tries, the last "
                    f"{statuses[-1]}")
                if statuses:
                    time.sleep(0.05)
                response = client.post("/v1/chat/completions", json=chat)
                statuses.append(response.status_code)
                if response.status_code == 503:
                    assert response.json()["error"]["message"] == (
                        "Redis is a read-only replica now (a failover is under way) and takes "
                        "no new jobs; try again shortly")
                    assert response.headers["retry-after"] == "2"
            assert set(statuses) <= {200, 503}, statuses
            assert thread.is_alive()
        new = JobReader(Redis.from_url(replica.url))
        deadline = time.monotonic() + 30
        while new.state(job_id).status != JobStatus.FINISHED:
            assert time.monotonic() < deadline, f"job {new.state(job_id).status}"
            time.sleep(0.05)
        read = new.read(job_id)
        assert [(t.index, t.token_id) for t in read.tokens] == [
            (i, synthetic_token_id(i)) for i in range(NUM_TOKENS)]
        assert read.is_done
        assert old.info("replication")["role"] == "slave"  # nothing of it came from the old one
        deadline = time.monotonic() + 30
        while not receiver.on("/hook"):
            assert dispatching.is_alive(), "the dispatcher's thread ended"
            assert time.monotonic() < deadline, "the job's webhook was not delivered"
            time.sleep(0.05)
        (hook,) = receiver.on("/hook")
        assert (hook.verified, hook.payload["type"], hook.payload["data"]["id"]) == (
            True, "job.completed", job_id)
        print(f"RELIABILITY Redis failover under a running job: its {NUM_TOKENS} tokens once, "
              f"on the new primary; a chat request answered after {statuses.count(503)} 503s; "
              "the job's webhook delivered")
    finally:
        receiving.__exit__(None, None, None)
        api.stop()
        worker.request_stop(0, None)
        thread.join(30)
        stop_dispatching.set()
        dispatching.join(10)
        dispatcher.close()
        forwarder.close()
