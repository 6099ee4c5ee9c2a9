"""The worker as RQ sees it: registered with rq's own Worker class, so `rq info`, rq-dashboard
and `Worker.all()` list it, its state, queues and finished/failed counts."""

from __future__ import annotations

import logging
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
            if age < timedelta(seconds=self.ttl_seconds):
                raise ValueError(f"an RQ worker named {self.name!r} is alive (heartbeat "
                                 f"{age.total_seconds():.0f}s ago); pick another --name")
            log.warning("taking over the name of dead worker %s", self.name)
            self.redis.delete(key)
        self.worker.register_birth()
        self.set_state(WorkerStatus.IDLE)

    def heartbeat(self, pipe: Pipeline) -> None:
        self.worker.heartbeat(self.ttl_seconds + 60, pipeline=pipe)

    def set_state(self, state: WorkerStatus, pipe: Pipeline | None = None) -> None:
        if state != self.state:
            self.worker.set_state(state, pipeline=pipe)
            self.state = state

    def register_death(self) -> None:
        self.worker.register_death()
