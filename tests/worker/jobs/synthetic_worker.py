"""The real worker loop around a synthetic engine on fakeredis, for tests of the loop itself
(batch-tier preemption, the stream interval): a worker run in a thread, an engine whose
requests hold KV blocks, and a wait for a condition."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import fakeredis

from tests.worker.jobs.job_support import BLOCK_SIZE
from worker.engine.synthetic_engine import SyntheticEngine
from worker.jobs.batching_worker import BatchingWorker
from worker.jobs.settings import WorkerSettings

T = TypeVar("T")


class PooledEngine(SyntheticEngine):
    """A synthetic engine whose requests hold KV blocks as a real one's do (prompt + output)."""

    def __init__(self, max_num_seqs: int, step_s: float, num_blocks: int) -> None:
        super().__init__(max_num_seqs, step_s)
        self.num_blocks = num_blocks

    def num_free_kv_blocks(self) -> int:
        used = sum(math.ceil((r.num_prompt_tokens + r.num_output_tokens + 1) / BLOCK_SIZE)
                   for r in self._requests.values() if not r.is_aborted)
        return max(0, self.num_blocks - used)


def wait_for(condition: Callable[[], T], timeout: float = 30.0) -> T:
    """The condition's first truthy value, polled every 10 ms."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.01)
    raise AssertionError("timed out")


@contextmanager
def running_worker(redis: fakeredis.FakeRedis, engine: SyntheticEngine, name: str,
                   **settings: Any) -> Iterator[BatchingWorker]:
    """A worker serving `engine` in a thread (10 s leases, a 50 ms idle wait, no drain), asked to
    stop and joined on leaving."""
    worker = BatchingWorker(
        WorkerSettings(model="synthetic", redis_url="redis://unused", name=name,
                       block_size=BLOCK_SIZE, drain_seconds=0, lease_seconds=10,
                       idle_block_seconds=0.05, **settings),
        engine, redis, register_presence=False)  # type: ignore[arg-type]
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        yield worker
    finally:
        worker.request_stop(15, None)
        thread.join(30)
