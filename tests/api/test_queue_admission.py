"""QueueAdmission: the depth limit holds over several API processes and under bursts."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import anyio.to_thread
import fakeredis
import pytest
import redis
import redis.asyncio as aioredis

from api.errors import QueueFullError
from api.queue_admission import QueueAdmission
from protocol import JobSpec, Keys, Priority, SamplingParams, submit_job, submit_jobs
from protocol.rq_keys import RQKeys

pytestmark = pytest.mark.anyio
KEYS = Keys()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _fake() -> tuple[aioredis.Redis, fakeredis.FakeRedis]:
    server = fakeredis.FakeServer()
    return (fakeredis.FakeAsyncRedis(server=server, decode_responses=True),
            fakeredis.FakeRedis(server=server))


def _spec(job_id: str) -> JobSpec:
    return JobSpec(job_id=job_id, model="tiny", prompt="hello", sampling=SamplingParams(),
                   priority=Priority.NORMAL)


def _queued(sync: redis.Redis) -> int:
    return sum(int(sync.llen(RQKeys.queue(name))) for name in KEYS.queue_names("tiny"))


async def test_refuses_at_the_limit_with_retry_after() -> None:
    aio, sync = _fake()
    submit_job(sync, _spec("a"))
    submit_job(sync, _spec("b"))
    admission = QueueAdmission(aio, KEYS, 2, 5)
    with pytest.raises(QueueFullError) as caught:
        async with admission.admit("tiny"):
            pytest.fail("admitted past the limit")
    assert caught.value.message == ("The job queue of model 'tiny' is full (2 jobs waiting, the limit is 2); "
                                    "retry later")
    assert caught.value.headers == {"Retry-After": "5"}


async def test_each_model_has_its_own_limit() -> None:
    aio, sync = _fake()
    submit_job(sync, _spec("a"))
    submit_job(sync, _spec("b"))
    admission = QueueAdmission(aio, KEYS, 2, 5)
    # tiny's queues are full; a model whose jobs wait elsewhere is not held back by them.
    async with admission.admit("other") as place:
        submit_job(sync, dataclasses.replace(_spec("c"), model="other"), admission=place)
    assert sync.llen(RQKeys.queue(KEYS.queue_name("other", Priority.NORMAL))) == 1
    assert sync.zcard(KEYS.admissions("other")) == 0
    with pytest.raises(QueueFullError):
        async with admission.admit("tiny"):
            pytest.fail("admitted past the limit")


async def test_the_batch_tier_has_a_depth_of_its_own() -> None:
    aio, sync = _fake()
    batch = [dataclasses.replace(_spec(f"b{i}"), priority=Priority.BATCH) for i in range(3)]
    submit_jobs(sync, batch)
    admission = QueueAdmission(aio, KEYS, 2, 5, max_background_depth=3)
    # Three batch jobs wait: interactive tiers are not held back by them...
    async with admission.admit("tiny") as place:
        submit_job(sync, _spec("a"), admission=place)
    # ...but the batch queue is full at its own limit.
    with pytest.raises(QueueFullError) as caught:
        async with admission.admit("tiny", priority=Priority.BATCH):
            pytest.fail("admitted past the batch limit")
    assert caught.value.message == ("The batch queue of model 'tiny' is full (3 jobs waiting, the "
                                    "limit is 3); retry later")
    submit_job(sync, _spec("z"))
    with pytest.raises(QueueFullError):  # the interactive tiers reached theirs: 2
        async with admission.admit("tiny"):
            pytest.fail("admitted past the limit")


async def test_admissions_not_enqueued_yet_count_toward_the_depth() -> None:
    aio, sync = _fake()
    admission = QueueAdmission(aio, KEYS, 2, 1)
    async with admission.admit("tiny") as first, admission.admit("tiny") as second:
        assert first != second
        with pytest.raises(QueueFullError):
            async with admission.admit("tiny"):
                pass
        submit_job(sync, _spec("a"), admission=first)
        submit_job(sync, _spec("b"), admission=second)
    assert _queued(sync) == 2
    assert sync.zcard(KEYS.admissions("tiny")) == 0  # each left with its enqueue


async def test_a_submission_that_failed_gives_its_place_back() -> None:
    aio, sync = _fake()
    admission = QueueAdmission(aio, KEYS, 1, 1)
    with pytest.raises(RuntimeError):
        async with admission.admit("tiny"):
            raise RuntimeError("enqueue failed")
    assert sync.zcard(KEYS.admissions("tiny")) == 0
    async with admission.admit("tiny") as place:
        submit_job(sync, _spec("a"), admission=place)
    assert _queued(sync) == 1


async def test_an_admission_never_enqueued_lapses() -> None:
    aio, sync = _fake()
    admission = QueueAdmission(aio, KEYS, 1, 1, ttl_ms=100)
    async with admission.admit("tiny"):
        pass  # a process that died here: no enqueue, no release
    assert sync.zcard(KEYS.admissions("tiny")) == 1
    with pytest.raises(QueueFullError):
        async with admission.admit("tiny"):
            pass
    time.sleep(0.15)
    async with admission.admit("tiny") as place:
        submit_job(sync, _spec("a"), admission=place)
    assert _queued(sync) == 1


async def test_a_burst_over_several_api_processes_stops_exactly_at_the_limit(
        redis_url: str) -> None:
    # Three "processes": each its own clients and its own QueueAdmission on one Redis.
    clients = [(aioredis.Redis.from_url(redis_url, decode_responses=True),
                redis.Redis.from_url(redis_url)) for _ in range(3)]
    admissions = [QueueAdmission(aio, KEYS, 7, 1) for aio, _ in clients]
    outcomes: list[str] = []

    async def submit(number: int) -> None:
        process = number % 3
        try:
            async with admissions[process].admit("tiny") as place:
                await anyio.to_thread.run_sync(
                    lambda: submit_job(clients[process][1], _spec(f"job-{number}"),
                                       admission=place))
            outcomes.append("queued")
        except QueueFullError:
            outcomes.append("full")

    await asyncio.gather(*(submit(number) for number in range(30)))
    sync = clients[0][1]
    assert sorted(outcomes) == ["full"] * 23 + ["queued"] * 7
    assert _queued(sync) == 7
    assert sync.zcard(KEYS.admissions("tiny")) == 0
    for aio, sync_client in clients:
        await aio.aclose()
        sync_client.close()


async def test_the_jobs_of_one_request_get_in_together_or_not_at_all() -> None:
    aio, sync = _fake()
    submit_job(sync, _spec("a"))
    admission = QueueAdmission(aio, KEYS, 3, 1)
    with pytest.raises(QueueFullError) as caught:
        async with admission.admit("tiny", 3):
            pytest.fail("admitted 3 jobs with 2 places left")
    assert caught.value.message == ("The job queue of model 'tiny' is full (1 jobs waiting, the limit is 3) for 3 "
                                    "more jobs; retry later")
    assert sync.zcard(KEYS.admissions("tiny")) == 0
    async with admission.admit("tiny", 2) as places:
        assert len(places) == 2
        submit_jobs(sync, [_spec("b"), _spec("c")], KEYS, admission=places)
    assert _queued(sync) == 3
    assert sync.zcard(KEYS.admissions("tiny")) == 0
