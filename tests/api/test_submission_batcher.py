"""api/submission_batcher.py: a submission that finds a request slot free goes alone, at once;
those that arrive while every slot is taken go together in the next request, each with its own
outcome."""

from __future__ import annotations

import asyncio
import threading
from functools import partial

import fakeredis
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from rq import Queue
from rq.serializers import JSONSerializer

from api.submission_batcher import SubmissionBatcher
from protocol import JobSpec, Keys, Priority
from protocol.job_submission import SubmissionCheck, SubmissionRefused, prepare_submission

KEYS = Keys()


def _spec(job_id: str) -> JobSpec:
    return JobSpec.from_dict(dict(job_id=job_id, model="tiny", prompt="Hello", max_tokens=8,
                                  priority=Priority.NORMAL, owner="key-1", created_at=1000.0))


def _queued(redis: fakeredis.FakeRedis) -> list[str]:
    return Queue(KEYS.queue_name("tiny", Priority.NORMAL), connection=redis,
                 serializer=JSONSerializer).job_ids


def test_a_burst_goes_in_a_few_requests_each_submission_with_its_own_outcome() -> None:
    redis = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    batcher = SubmissionBatcher(redis, max_in_flight=1)
    refuse = SubmissionCheck("return {0, 9}", keys=(), args=())

    def broken() -> None:
        raise ValueError("this one could not be built")

    async def burst() -> list[object]:
        calls = [partial(prepare_submission, redis, [_spec(f"job-{i}")],
                         check=refuse if i == 7 else None) for i in range(20)]
        calls[12] = broken  # type: ignore[call-overload]
        return await asyncio.gather(*(batcher.submit(call) for call in calls),
                                    return_exceptions=True)

    outcomes = asyncio.run(burst())
    assert isinstance(outcomes[7], SubmissionRefused) and outcomes[7].verdict == [0, 9]
    assert isinstance(outcomes[12], ValueError)
    expected = [f"job-{i}" for i in range(20) if i not in (7, 12)]
    assert [jobs[0].id for i, jobs in enumerate(outcomes) if i not in (7, 12)] == expected
    assert _queued(redis) == expected  # in arrival order
    # The first took the one slot; the nineteen that came while it was out went in one request.
    assert batcher.requests_sent == 2


def test_max_batch_bounds_a_request_and_a_lone_submission_goes_at_once() -> None:
    redis = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    batcher = SubmissionBatcher(redis, max_in_flight=1, max_batch=4)

    async def burst() -> None:
        await asyncio.gather(*(batcher.submit(partial(prepare_submission, redis,
                                                      [_spec(f"job-{i}")])) for i in range(9)))

    asyncio.run(burst())
    assert batcher.requests_sent == 3  # the first alone, then the eight waiting: 4 and 4
    assert _queued(redis) == [f"job-{i}" for i in range(9)]
    jobs = asyncio.run(batcher.submit(partial(prepare_submission, redis, [_spec("late")])))
    assert [job.id for job in jobs] == ["late"] and batcher.requests_sent == 4


def test_below_the_slot_limit_each_submission_goes_alone() -> None:
    redis = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    batcher = SubmissionBatcher(redis, max_in_flight=8)

    async def few() -> None:
        await asyncio.gather(*(batcher.submit(partial(prepare_submission, redis,
                                                      [_spec(f"job-{i}")])) for i in range(5)))

    asyncio.run(few())
    assert batcher.requests_sent == 5
    assert sorted(_queued(redis)) == [f"job-{i}" for i in range(5)]


def test_a_redis_error_reaches_every_submission_of_its_request() -> None:
    server = fakeredis.FakeServer()
    redis = fakeredis.FakeRedis(server=server)
    batcher = SubmissionBatcher(redis, max_in_flight=1)
    server.connected = False

    async def burst() -> list[object]:
        return await asyncio.gather(*(batcher.submit(partial(prepare_submission, redis,
                                                             [_spec(f"job-{i}")]))
                                      for i in range(3)), return_exceptions=True)

    outcomes = asyncio.run(burst())
    assert all(isinstance(outcome, RedisConnectionError) for outcome in outcomes)
    server.connected = True
    jobs = asyncio.run(batcher.submit(partial(prepare_submission, redis, [_spec("after")])))
    assert [job.id for job in jobs] == ["after"] and _queued(redis) == ["after"]


def test_a_waiting_submission_whose_caller_goes_away_is_still_sent() -> None:
    """Once waiting for a slot, a submission goes with the next request even if its caller is
    gone (a closed connection): as for a request already out, whether it is queued does not
    depend on the caller."""
    redis = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    batcher = SubmissionBatcher(redis, max_in_flight=1)
    out = threading.Event()

    def slow_first() -> object:
        out.wait(10)
        return prepare_submission(redis, [_spec("first")])

    async def leave_early() -> None:
        first = asyncio.create_task(batcher.submit(slow_first))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        orphan = asyncio.create_task(batcher.submit(partial(prepare_submission, redis,
                                                            [_spec("orphan")])))
        await asyncio.sleep(0.01)
        orphan.cancel()
        with pytest.raises(asyncio.CancelledError):
            await orphan
        out.set()
        await first
        await batcher.submit(partial(prepare_submission, redis, [_spec("next")]))

    asyncio.run(leave_early())
    assert _queued(redis) == ["first", "orphan", "next"]


def test_submissions_that_arrive_while_a_request_is_out_go_together_in_the_next() -> None:
    redis = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    batcher = SubmissionBatcher(redis, max_in_flight=1)
    out = threading.Event()

    def slow_first() -> object:
        out.wait(10)  # the request stays out until the others have arrived
        return prepare_submission(redis, [_spec("first")])

    async def scenario() -> None:
        first = asyncio.create_task(batcher.submit(slow_first))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        later = [asyncio.create_task(batcher.submit(partial(prepare_submission, redis,
                                                            [_spec(f"later-{i}")])))
                 for i in range(5)]
        await asyncio.sleep(0.05)
        assert batcher.requests_sent == 0
        out.set()
        await asyncio.gather(first, *later)

    asyncio.run(scenario())
    assert batcher.requests_sent == 2
    assert _queued(redis) == ["first", *(f"later-{i}" for i in range(5))]
