"""QueueAdmission: the depth limit holds over several API processes and under bursts; the check
and the enqueue are one script, so a refused submission writes nothing."""

from __future__ import annotations

import asyncio
import dataclasses

import anyio.to_thread
import fakeredis
import pytest
import redis

from api.errors import QueueFullError
from api.key_policies import KeyPolicy
from api.queue_admission import Admission, QueueAdmission
from protocol import JobSpec, Keys, Priority, SamplingParams, submit_job, submit_jobs
from protocol.job_submission import SubmissionRefused
from protocol.rq_keys import RQKeys

pytestmark = pytest.mark.anyio
KEYS = Keys()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _spec(job_id: str, model: str = "tiny", priority: Priority = Priority.NORMAL) -> JobSpec:
    return JobSpec(job_id=job_id, model=model, prompt="hello", sampling=SamplingParams(),
                   priority=priority)


def _queued(sync: redis.Redis, model: str = "tiny") -> int:
    return sum(int(sync.llen(RQKeys.queue(name))) for name in KEYS.queue_names(model))


def _refusal(sync: redis.Redis, specs: list[JobSpec], admission: Admission) -> Exception:
    """What submitting `specs` under `admission` raises (it must be refused)."""
    with pytest.raises(SubmissionRefused) as refused:
        submit_jobs(sync, specs, check=admission.check)
    return admission.refusal(refused.value.verdict)


def test_refuses_at_the_limit_with_retry_after_and_writes_nothing() -> None:
    sync = fakeredis.FakeRedis()
    submit_job(sync, _spec("a"))
    submit_job(sync, _spec("b"))
    before = sorted(sync.keys())
    error = _refusal(sync, [_spec("c")], QueueAdmission(KEYS, 2, 5).admission("tiny"))
    assert isinstance(error, QueueFullError)
    assert error.message == ("The job queue of model 'tiny' is full (2 jobs waiting, the limit is 2); "
                             "retry later")
    assert error.headers == {"Retry-After": "5"}
    assert sorted(sync.keys()) == before  # no job hash, state, wake-up or index entry for c
    assert not sync.exists(RQKeys.job("c"))


def test_each_model_has_its_own_limit() -> None:
    sync = fakeredis.FakeRedis()
    submit_job(sync, _spec("a"))
    submit_job(sync, _spec("b"))
    admission = QueueAdmission(KEYS, 2, 5)
    # tiny's queues are full; a model whose jobs wait elsewhere is not held back by them.
    submit_job(sync, _spec("c", model="other"), check=admission.admission("other").check)
    assert sync.llen(RQKeys.queue(KEYS.queue_name("other", Priority.NORMAL))) == 1
    assert isinstance(_refusal(sync, [_spec("d")], admission.admission("tiny")), QueueFullError)


def test_the_batch_tier_has_a_depth_of_its_own() -> None:
    sync = fakeredis.FakeRedis()
    submit_jobs(sync, [_spec(f"b{i}", priority=Priority.BATCH) for i in range(3)])
    admission = QueueAdmission(KEYS, 2, 5, max_background_depth=3)
    # Three batch jobs wait: interactive tiers are not held back by them...
    submit_job(sync, _spec("a"), check=admission.admission("tiny").check)
    # ...but the batch queue is full at its own limit.
    error = _refusal(sync, [_spec("b3", priority=Priority.BATCH)],
                     admission.admission("tiny", priority=Priority.BATCH))
    assert isinstance(error, QueueFullError)
    assert error.message == ("The batch queue of model 'tiny' is full (3 jobs waiting, the "
                             "limit is 3); retry later")
    submit_job(sync, _spec("z"))
    # The interactive tiers reached theirs: 2.
    assert isinstance(_refusal(sync, [_spec("y")], admission.admission("tiny")), QueueFullError)


def test_the_key_weight_is_written_only_for_an_admitted_submission() -> None:
    sync = fakeredis.FakeRedis(decode_responses=True)
    admission = QueueAdmission(KEYS, 1, 1)
    submit_job(sync, dataclasses.replace(_spec("a"), owner="k1"),
               check=admission.admission("tiny", owner="k1", policy=KeyPolicy(weight=3.0)).check)
    assert sync.hgetall(KEYS.fair_weights()) == {"k1": "3.0"}
    _refusal(sync, [dataclasses.replace(_spec("b"), owner="k2")],
             admission.admission("tiny", owner="k2", policy=KeyPolicy(weight=2.0)))
    assert sync.hgetall(KEYS.fair_weights()) == {"k1": "3.0"}


async def test_a_burst_over_several_api_processes_stops_exactly_at_the_limit(
        redis_url: str) -> None:
    # Three "processes": each its own client and its own QueueAdmission on one Redis.
    clients = [redis.Redis.from_url(redis_url) for _ in range(3)]
    admissions = [QueueAdmission(KEYS, 7, 1) for _ in clients]
    outcomes: list[str] = []

    async def submit(number: int) -> None:
        process = number % 3
        admission = admissions[process].admission("tiny")
        try:
            await anyio.to_thread.run_sync(
                lambda: submit_job(clients[process], _spec(f"job-{number}"),
                                   check=admission.check))
            outcomes.append("queued")
        except SubmissionRefused as refused:
            assert isinstance(admission.refusal(refused.verdict), QueueFullError)
            outcomes.append("full")

    await asyncio.gather(*(submit(number) for number in range(30)))
    sync = clients[0]
    assert sorted(outcomes) == ["full"] * 23 + ["queued"] * 7
    assert _queued(sync) == 7
    # The refused wrote nothing: seven job hashes, seven states.
    assert len(sync.keys("rq:job:*")) == 7
    assert sum(sync.exists(KEYS.state(f"job-{n}")) for n in range(30)) == 7
    for client in clients:
        client.close()


def test_the_jobs_of_one_request_get_in_together_or_not_at_all() -> None:
    sync = fakeredis.FakeRedis()
    submit_job(sync, _spec("a"))
    admission = QueueAdmission(KEYS, 3, 1)
    error = _refusal(sync, [_spec("b"), _spec("c"), _spec("d")], admission.admission("tiny", 3))
    assert isinstance(error, QueueFullError)
    assert error.message == ("The job queue of model 'tiny' is full (1 jobs waiting, the limit is 3) for 3 "
                             "more jobs; retry later")
    assert _queued(sync) == 1
    submit_jobs(sync, [_spec("b"), _spec("c")], KEYS, check=admission.admission("tiny", 2).check)
    assert _queued(sync) == 3
