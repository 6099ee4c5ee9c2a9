"""The Idempotency-Key header on every submitting route: a repeated key (same API key, within its
TTL) answers with the first job, concurrent twins make one job, bad keys are a 4xx naming it."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from api_support import KEY_A, KEY_B, MODEL, Harness, make_harness

from protocol import FinishReason, JobStatus, Priority
from protocol.rq_keys import RQKeys

pytestmark = pytest.mark.anyio


def _queued(harness: Harness) -> list[str]:
    return [job_id for name in harness.keys.queue_names(MODEL)
            for job_id in harness.sync.lrange(RQKeys.queue(name), 0, -1)]


async def test_a_repeated_key_answers_with_the_first_job(harness: Harness,
                                                         client: httpx.AsyncClient) -> None:
    headers = {"Idempotency-Key": "order-42"}
    first = await client.post("/v1/jobs", json={"prompt": "hello"}, headers=headers)
    assert first.status_code == 202 and "idempotent-replayed" not in first.headers
    job_id = first.json()["job_id"]
    harness.sync.lpop(RQKeys.queue(harness.keys.queue_name(MODEL, Priority.NORMAL)))
    harness.publish_tokens(job_id, ["x"])  # a worker took it and is running it
    again = await client.post("/v1/jobs", json={"prompt": "hello"}, headers=headers)
    assert again.status_code == 202
    assert again.headers["idempotent-replayed"] == "true"
    assert again.json() == {**first.json(), "status": "running"}
    assert again.headers["location"] == first.headers["location"]
    other = await client.post("/v1/jobs", json={"prompt": "hello"},
                              headers={"Idempotency-Key": "order-43"})
    assert other.json()["job_id"] != job_id
    assert _queued(harness) == [other.json()["job_id"]]


async def test_a_key_reused_for_a_different_number_of_jobs_is_409(
        client: httpx.AsyncClient) -> None:
    headers = {"Idempotency-Key": "pair"}
    first = await client.post("/v1/jobs", json={"prompt": "hello", "n": 2}, headers=headers)
    assert first.status_code == 202 and len(first.json()["job_ids"]) == 2
    again = await client.post("/v1/jobs", json={"prompt": "hello", "n": 2}, headers=headers)
    assert again.json()["job_ids"] == first.json()["job_ids"]
    for n in (1, 3):
        other = await client.post("/v1/jobs", json={"prompt": "hello", "n": n}, headers=headers)
        assert other.status_code == 409
        assert other.json() == {"detail": (
            f"This Idempotency-Key was first used for 2 jobs, this request makes {n}; use a new "
            "key for a different request")}


async def test_concurrent_posts_with_one_key_make_one_job(harness: Harness,
                                                          client: httpx.AsyncClient) -> None:
    responses = await asyncio.gather(*(
        client.post("/v1/jobs", json={"prompt": "hello"}, headers={"Idempotency-Key": "burst"})
        for _ in range(20)))
    assert [r.status_code for r in responses] == [202] * 20
    job_ids = {r.json()["job_id"] for r in responses}
    assert len(job_ids) == 1
    assert _queued(harness) == list(job_ids)
    assert sum(r.headers.get("idempotent-replayed") == "true" for r in responses) == 19


async def test_the_key_is_scoped_to_the_api_key(keyed_harness: Harness) -> None:
    async with keyed_harness.client(KEY_A) as a, keyed_harness.client(KEY_B) as b:
        headers = {"Idempotency-Key": "same"}
        job_a = (await a.post("/v1/jobs", json={"prompt": "hi"}, headers=headers)).json()["job_id"]
        job_b = (await b.post("/v1/jobs", json={"prompt": "hi"}, headers=headers)).json()["job_id"]
        again = (await a.post("/v1/jobs", json={"prompt": "hi"}, headers=headers)).json()["job_id"]
    assert job_a != job_b and again == job_a


async def test_a_replay_is_answered_even_when_the_queue_is_full() -> None:
    harness = make_harness(max_queue_depth=1)
    harness.register_model()
    async with harness.client() as client:
        headers = {"Idempotency-Key": "k"}
        first = await client.post("/v1/jobs", json={"prompt": "hi"}, headers=headers)
        assert (await client.post("/v1/jobs", json={"prompt": "hi"})).status_code == 429
        again = await client.post("/v1/jobs", json={"prompt": "hi"}, headers=headers)
    assert again.status_code == 202 and again.json()["job_id"] == first.json()["job_id"]


async def test_a_key_whose_job_is_gone_is_409(harness: Harness, client: httpx.AsyncClient) -> None:
    headers = {"Idempotency-Key": "old"}
    job_id = (await client.post("/v1/jobs", json={"prompt": "hi"}, headers=headers)).json()["job_id"]
    harness.sync.delete(RQKeys.job(job_id))  # its retention ran out before the key's
    response = await client.post("/v1/jobs", json={"prompt": "hi"}, headers=headers)
    assert response.status_code == 409
    assert response.json() == {"detail": f"This Idempotency-Key made job '{job_id}', which is no "
                                         "longer kept; use a new key to submit again"}


@pytest.mark.parametrize("key", ["", "has space", "x" * 256, "caf\u00e9"])
async def test_bad_keys_are_422_naming_the_header(client: httpx.AsyncClient, key: str) -> None:
    response = await client.post("/v1/jobs", json={"prompt": "hi"},
                                 headers={"Idempotency-Key": key.encode()})
    assert response.status_code == 422, response.text
    (detail,) = response.json()["detail"]
    assert detail["loc"] == ["header", "Idempotency-Key"]
    assert detail["msg"].startswith("'Idempotency-Key' must be 1 to 255 visible ASCII characters")


def _openai_client(harness: Harness) -> openai.AsyncOpenAI:
    transport = httpx.ASGITransport(app=harness.app, raise_app_exceptions=False)
    return openai.AsyncOpenAI(base_url="http://carpool.test/v1", api_key="none", max_retries=0,
                              http_client=httpx.AsyncClient(transport=transport))


async def test_openai_routes_replay_the_first_job(harness: Harness) -> None:
    client = _openai_client(harness)
    headers = {"Idempotency-Key": "chat-1"}
    worker = asyncio.create_task(harness.serve_next_job(["4"], FinishReason.STOP, 9))
    first = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "2+2?"}], extra_headers=headers)
    job_id = await worker
    again = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "2+2?"}], extra_headers=headers)
    assert again.headers["idempotent-replayed"] == "true"
    assert again.headers["x-carpool-job-id"] == first.headers["x-carpool-job-id"] == job_id
    assert again.parse().model_dump() == first.parse().model_dump()
    assert harness.state(job_id).status is JobStatus.FINISHED and _queued(harness) == []
    with pytest.raises(openai.BadRequestError) as caught:
        await client.completions.create(model=MODEL, prompt="x",
                                        extra_headers={"Idempotency-Key": "a b"})
    assert caught.value.body["param"] == "Idempotency-Key"  # type: ignore[index]
