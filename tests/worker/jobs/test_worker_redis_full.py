"""A Redis at its maxmemory (a policy that evicts nothing, as a queue's should run), or one that
cannot save to disk (MISCONF), refuses every write for a while under a running job: the worker
keeps its batch and sends each publish again, as through an outage, and the job ends with every
token once. Before, the first refused write (an OOM error) ended the worker process, its jobs
with it; a MISCONF one first dropped the job from the batch as if its script had a bug.
"""

from __future__ import annotations

import threading
import time

import pytest
import redis

from protocol import JobReader, JobStatus
from tests.conftest import UnsavingRedis
from tests.worker.jobs.job_support import BLOCK_SIZE, submit
from tests.worker.jobs.synthetic_worker import wait_for
from worker.engine.synthetic_engine import SyntheticEngine, synthetic_token_id
from worker.jobs.batching_worker import BatchingWorker
from worker.jobs.settings import WorkerSettings

NUM_TOKENS = 60


@pytest.mark.parametrize("refusal", ["maxmemory", "cannot save"])
def test_a_worker_rides_out_a_redis_that_refuses_writes(redis_url: str, refusal: str,
                                                        unsaving_redis: UnsavingRedis) -> None:
    client = redis.Redis.from_url(redis_url)
    policy = client.config_get("maxmemory-policy")["maxmemory-policy"]

    def refuse_writes() -> None:
        if refusal == "maxmemory":
            client.config_set("maxmemory-policy", "noeviction")
            client.config_set("maxmemory", 1)  # under what any Redis holds: every write refused
        else:
            unsaving_redis.fail_saves()

    def allow_writes() -> None:
        client.config_set("maxmemory", 0)
        unsaving_redis.allow_writes()

    settings = WorkerSettings(model="tiny", redis_url=redis_url, name="w1", block_size=BLOCK_SIZE,
                              drain_seconds=0, lease_seconds=10, idle_block_seconds=0.05)
    worker = BatchingWorker(settings, SyntheticEngine(4, 0.02), client,  # type: ignore[arg-type]
                            presence_redis=redis.Redis.from_url(redis_url))
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    reader = JobReader(client)
    try:
        submit(client, "job", max_tokens=NUM_TOKENS)
        wait_for(lambda: reader.state("job").first_token_at)
        refuse_writes()
        time.sleep(0.5)
        assert thread.is_alive()
        assert reader.state("job").status == JobStatus.RUNNING  # nothing written meanwhile
        allow_writes()
        wait_for(lambda: reader.state("job").status == JobStatus.FINISHED, timeout=20)
        read = reader.read("job")
        assert [(token.index, token.token_id) for token in read.tokens] == [
            (i, synthetic_token_id(i)) for i in range(NUM_TOKENS)]
        assert read.is_done
    finally:
        client.config_set("maxmemory", 0)
        client.config_set("maxmemory-policy", policy)
        worker.request_stop(15, None)
        thread.join(30)
    assert not thread.is_alive()
