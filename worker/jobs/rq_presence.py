"""The worker as RQ sees it: registered with rq's own Worker class, so `rq info`, rq-dashboard
and `Worker.all()` list it, its state, queues and finished/failed counts."""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta

from redis import Redis
from redis.client import Pipeline
from rq import Worker
from rq.serializers import JSONSerializer
from rq.utils import as_text, now, utcparse
from rq.worker import WorkerStatus

log = logging.getLogger(__name__)


class RQPresence:
    def __init__(self, redis: Redis, name: str, queue_names: list[str], ttl_seconds: int) -> None:
        # rq's Worker raises its connection pool's socket timeout for its own BLPOPs; it never
        # pops here, so give it a client of its own and keep the worker's timeouts as set.
        self.redis = redis
        self.ttl_seconds = ttl_seconds
        self.worker = Worker(queue_names, name=name, connection=redis, serializer=JSONSerializer,
                             worker_ttl=ttl_seconds)
        self.state = ""

    @property
    def name(self) -> str:
        return self.worker.name

    def register_birth(self) -> None:
        key = self.worker.key
        if self.redis.exists(key) and not self.redis.hexists(key, "death"):
            last = self.redis.hget(key, "last_heartbeat")
            age = now() - utcparse(as_text(last)) if last else timedelta(days=1)
            if age < timedelta(seconds=self.ttl_seconds) and not self._was_this_host_and_died():
                raise ValueError(f"an RQ worker named {self.name!r} is alive (heartbeat "
                                 f"{age.total_seconds():.0f}s ago); pick another --name")
            log.warning("taking over the name of dead worker %s", self.name)
            self.redis.delete(key)
        self.worker.register_birth()  # type: ignore[no-untyped-call]  # rq: unannotated method
        self.set_state(WorkerStatus.IDLE)

    def register_again(self) -> None:
        """Registered anew after Redis lost the registration (a restart without its data, or a
        flush): whatever holds this name now is this worker's own heartbeat, written since."""
        self.redis.delete(self.worker.key)
        self.worker.register_birth()  # type: ignore[no-untyped-call]  # rq: unannotated method
        state, self.state = self.state, ""
        self.set_state(WorkerStatus(state) if state else WorkerStatus.IDLE)

    def _was_this_host_and_died(self) -> bool:
        """The worker registered under our name ran on this host and its process is gone: we are
        its restart (a supervisor restarting a crashed worker with a fixed --name must not wait
        for the old heartbeat to age out). A live process there, or another host, is a clash."""
        hostname, pid = self.redis.hmget(self.worker.key, "hostname", "pid")
        if hostname is None or as_text(hostname) != socket.gethostname() or not pid:
            return False
        pid_number = int(pid)
        if pid_number == os.getpid():
            return True  # a restarted container: same host name, same pid, so not alive
        try:
            os.kill(pid_number, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False  # alive, another user's
        return False

    def heartbeat(self, pipe: Pipeline) -> None:
        self.worker.heartbeat(self.ttl_seconds + 60, pipeline=pipe)

    def set_state(self, state: WorkerStatus, pipe: Pipeline | None = None) -> None:
        if state != self.state:
            self.worker.set_state(state, pipeline=pipe)
            self.state = state

    def register_death(self) -> None:
        self.worker.register_death()  # type: ignore[no-untyped-call]  # rq: unannotated method
