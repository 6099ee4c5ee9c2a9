"""submit_job with an Idempotency: one job per key however many submissions race, on a real
Redis (WATCH/MULTI is what makes the check and the enqueue one step)."""

from __future__ import annotations

import threading

import pytest
from redis import Redis

from protocol import JobReader, Keys, Priority
from protocol.job_submission import DuplicateSubmission, Idempotency, submit_job
from protocol.rq_keys import RQKeys
from tests.protocol.conftest import make_spec

KEYS = Keys()


def test_racing_submissions_with_one_key_make_one_job(redis_url: str) -> None:
    idempotency = Idempotency(KEYS.idempotency("key-1", "retry-me"), ttl_s=60)
    barrier = threading.Barrier(16)
    outcomes: dict[str, str] = {}

    def submit(i: int) -> None:
        redis = Redis.from_url(redis_url)
        barrier.wait()
        try:
            submit_job(redis, make_spec(f"job-{i}"), idempotency=idempotency)
            outcomes[f"job-{i}"] = "enqueued"
        except DuplicateSubmission as duplicate:
            outcomes[f"job-{i}"] = duplicate.job_id

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    (winner,) = [job_id for job_id, outcome in outcomes.items() if outcome == "enqueued"]
    assert len(outcomes) == 16
    assert all(outcome == winner for job_id, outcome in outcomes.items() if job_id != winner)
    redis = Redis.from_url(redis_url)
    queue = RQKeys.queue(KEYS.queue_name("tiny", Priority.NORMAL))
    assert redis.lrange(queue, 0, -1) == [winner.encode()]
    assert redis.get(idempotency.key) == winner.encode()
    assert 0 < redis.ttl(idempotency.key) <= 60
    assert redis.llen(KEYS.wakeups(KEYS.queue_name("tiny", Priority.NORMAL))) == 1
    # The losers wrote nothing at all.
    reader = JobReader(redis)
    assert [job_id for job_id in outcomes if reader.state(job_id) is not None] == [winner]
    assert redis.zcard(KEYS.jobs_by_owner("key-1")) == 1


def test_another_key_or_owner_is_another_job(redis_url: str) -> None:
    redis = Redis.from_url(redis_url)
    submit_job(redis, make_spec("a"), idempotency=Idempotency(KEYS.idempotency("key-1", "k"), 60))
    submit_job(redis, make_spec("b"), idempotency=Idempotency(KEYS.idempotency("key-2", "k"), 60))
    submit_job(redis, make_spec("c"), idempotency=Idempotency(KEYS.idempotency("key-1", "k2"), 60))
    with pytest.raises(DuplicateSubmission) as caught:
        submit_job(redis, make_spec("d"), idempotency=Idempotency(KEYS.idempotency("key-1", "k"), 60))
    assert caught.value.job_id == "a"
    assert redis.llen(RQKeys.queue(KEYS.queue_name("tiny", Priority.NORMAL))) == 3
