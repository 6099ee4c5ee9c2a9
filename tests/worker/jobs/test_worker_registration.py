"""A worker whose Redis lost its data (restarted without an append-only file, or flushed) under it
registers again: its model card and tokenizer (without which the API refuses the model: "no model
is registered") and its rq registration (`rq info`, rq-dashboard, the API's live workers), while
it keeps running; then it serves the jobs submitted after.
"""

from __future__ import annotations

import json
import threading

from rq import Worker

from protocol import JobReader, JobStatus
from protocol.rq_keys import RQKeys
from tests.worker.jobs.job_support import BLOCK_SIZE, KEYS, fake_redis, submit
from tests.worker.jobs.synthetic_worker import wait_for
from worker.engine.synthetic_engine import SyntheticEngine
from worker.jobs.batching_worker import BatchingWorker
from worker.jobs.settings import WorkerSettings

MODEL = "tiny"


def _card_fields(card: bytes) -> dict[str, object]:
    fields = json.loads(card)
    del fields["created_at"]
    return fields


def _rq_workers(redis) -> list[tuple[str, str]]:  # type: ignore[no-untyped-def]
    return [(worker.name, worker.get_state()) for worker in Worker.all(connection=redis)]


def test_a_worker_registers_again_after_redis_lost_its_data() -> None:
    redis = fake_redis()
    settings = WorkerSettings(model=MODEL, redis_url="redis://unused", name="w1",
                              block_size=BLOCK_SIZE, drain_seconds=0, lease_seconds=10,
                              idle_block_seconds=0.05, metrics_interval_ms=50)
    worker = BatchingWorker(settings, SyntheticEngine(4, 0.005), redis,  # type: ignore[arg-type]
                            presence_redis=redis)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        card = wait_for(lambda: redis.hget(KEYS.models(), MODEL))
        assert _rq_workers(redis) == [("w1", "idle")]

        redis.flushall()  # what a Redis restarted without its data holds: nothing

        again = wait_for(lambda: redis.hget(KEYS.models(), MODEL), timeout=10)
        assert _card_fields(again) == _card_fields(card)  # the same card, its time new
        wait_for(lambda: _rq_workers(redis) == [("w1", "idle")], timeout=10)
        # Another worker registered the card again first: this one still registers with rq.
        redis.delete(RQKeys.workers_set(), RQKeys.worker("w1"))
        wait_for(lambda: _rq_workers(redis) == [("w1", "idle")], timeout=10)
        submit(redis, "after", max_tokens=5)
        reader = JobReader(redis)
        wait_for(lambda: reader.state("after").status == JobStatus.FINISHED, timeout=10)
        assert [token.index for token in reader.read("after").tokens] == [0, 1, 2, 3, 4]
    finally:
        worker.request_stop(15, None)
        thread.join(30)
    assert not thread.is_alive()
