"""Deadlines and retention at submission: the jobs API's queue_timeout_s / deadline_s fields and the OpenAI
routes' X-Carpool-* headers become the JobSpec's and JobState's absolute deadlines; bad values are
a 4xx naming the field or header."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import openai
import pytest
from api_support import MODEL, Harness
from rq.job import Job
from rq.serializers import JSONSerializer

from protocol import FinishReason

pytestmark = pytest.mark.anyio


async def test_job_deadlines_are_stored_and_shown(harness: Harness,
                                                  client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/jobs", json={"prompt": "hello", "queue_timeout_s": 2.5,
                                                    "deadline_s": 30})
    assert response.status_code == 202, response.text
    job_id = response.json()["job_id"]
    state = harness.state(job_id)
    assert state.queue_deadline_at == pytest.approx(state.created_at + 2.5, abs=1e-6)
    assert state.deadline_at == pytest.approx(state.created_at + 30, abs=1e-6)
    spec = Job.fetch(job_id, connection=harness.context.sync, serializer=JSONSerializer).args[0]
    assert (spec["queue_deadline_at"], spec["deadline_at"]) == (state.queue_deadline_at,
                                                                state.deadline_at)
    timings = (await client.get(f"/v1/jobs/{job_id}")).json()["timings"]
    assert (timings["queue_deadline_at"], timings["deadline_at"]) == (state.queue_deadline_at,
                                                                      state.deadline_at)
    # Without them: no deadline (0 in Redis, null in the view).
    plain = (await client.post("/v1/jobs", json={"prompt": "hello"})).json()["job_id"]
    assert (harness.state(plain).queue_deadline_at, harness.state(plain).deadline_at) == (0, 0)
    view = (await client.get(f"/v1/jobs/{plain}")).json()["timings"]
    assert (view["queue_deadline_at"], view["deadline_at"]) == (None, None)


async def test_an_expired_job_reads_as_expired(harness: Harness,
                                               client: httpx.AsyncClient) -> None:
    job_id = (await client.post("/v1/jobs", json={"prompt": "hello", "deadline_s": 1})).json()[
        "job_id"]
    harness.finish_job(job_id, ["a", "b"], FinishReason.EXPIRED)
    view = (await client.get(f"/v1/jobs/{job_id}")).json()
    assert (view["status"], view["finish_reason"], view["text"]) == ("finished", "expired", "ab")
    events = (await client.get(f"/v1/jobs/{job_id}/stream")).text
    assert '"finish_reason": "expired"' in events


@pytest.mark.parametrize(("field", "value", "message"), [
    ("queue_timeout_s", 0, "Input should be greater than 0"),
    ("deadline_s", -1.0, "Input should be greater than 0"),
    ("deadline_s", 7 * 24 * 3600 + 1, "Input should be less than or equal to 604800"),
    ("deadline_s", "10", "Input should be a valid number"),
    ("queue_timeout_s", True, "Input should be a valid number"),
])
async def test_bad_deadline_fields_are_422_naming_them(client: httpx.AsyncClient, field: str,
                                                       value: Any, message: str) -> None:
    response = await client.post("/v1/jobs", json={"prompt": "hello", field: value})
    assert response.status_code == 422, response.text
    (detail,) = response.json()["detail"]
    assert (detail["loc"], detail["msg"]) == (["body", field], message)


def _openai_client(harness: Harness) -> openai.AsyncOpenAI:
    transport = httpx.ASGITransport(app=harness.app, raise_app_exceptions=False)
    return openai.AsyncOpenAI(base_url="http://carpool.test/v1", api_key="none", max_retries=0,
                              http_client=httpx.AsyncClient(transport=transport))


async def test_openai_routes_take_the_deadline_headers(harness: Harness) -> None:
    client = _openai_client(harness)
    worker = asyncio.create_task(harness.serve_next_job(["so", " far"], FinishReason.EXPIRED, 2))
    completion = await client.completions.create(
        model=MODEL, prompt="hello world", max_tokens=8,
        extra_headers={"X-Carpool-Deadline-S": "12.5", "X-Carpool-Queue-Timeout-S": "3"})
    job_id = await worker
    assert completion.choices[0].text == "so far"
    assert completion.choices[0].finish_reason == "expired"  # type: ignore[comparison-overlap]
    state = harness.state(job_id)
    assert state.deadline_at == pytest.approx(state.created_at + 12.5, abs=1e-6)
    assert state.queue_deadline_at == pytest.approx(state.created_at + 3, abs=1e-6)


@pytest.mark.parametrize(("header", "value"), [
    ("X-Carpool-Deadline-S", "soon"), ("X-Carpool-Deadline-S", "0"),
    ("X-Carpool-Queue-Timeout-S", "nan"), ("X-Carpool-Queue-Timeout-S", "604801"),
])
async def test_bad_deadline_headers_are_400_naming_them(harness: Harness, header: str,
                                                        value: str) -> None:
    client = _openai_client(harness)
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}],
            extra_headers={header: value})
    assert caught.value.status_code == 400
    assert caught.value.body == {
        "message": f"'{header}' must be a number of seconds, more than 0 and at most 604800 "
                   f"(got {value!r})",
        "type": "invalid_request_error", "param": header, "code": "invalid_value"}


async def test_retention_per_job_and_by_default(harness: Harness, client: httpx.AsyncClient) -> None:
    def ttls(job_id: str) -> tuple[int, int]:
        job = Job.fetch(job_id, connection=harness.context.sync, serializer=JSONSerializer)
        return job.result_ttl, job.failure_ttl

    plain = (await client.post("/v1/jobs", json={"prompt": "hi"})).json()["job_id"]
    assert ttls(plain) == (24 * 3600, 7 * 24 * 3600)  # CARPOOL_RESULT_TTL_S / _FAILURE_TTL_S
    short = (await client.post("/v1/jobs", json={"prompt": "hi", "retention_s": 60})).json()
    assert ttls(short["job_id"]) == (60, 60)
    bad = await client.post("/v1/jobs", json={"prompt": "hi", "retention_s": 0})
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["body", "retention_s"]


async def test_retention_defaults_come_from_the_settings() -> None:
    from api_support import make_harness

    harness = make_harness(result_ttl_s=120, failure_ttl_s=300)
    harness.register_model()
    async with harness.client() as client:
        job_id = (await client.post("/v1/jobs", json={"prompt": "hi"})).json()["job_id"]
    job = Job.fetch(job_id, connection=harness.context.sync, serializer=JSONSerializer)
    assert (job.result_ttl, job.failure_ttl) == (120, 300)


async def test_the_owner_index_drops_jobs_whose_retention_ended(
        harness: Harness, client: httpx.AsyncClient) -> None:
    ids = [(await client.post("/v1/jobs", json={"prompt": "hi"})).json()["job_id"]
           for _ in range(4)]
    index = harness.keys.jobs_by_owner("")
    # Created more than a retention (24 h) ago, but for the last one; all four gone now.
    day_ago = time.time() - 24 * 3600
    harness.sync.zadd(index, {ids[0]: day_ago - 3, ids[1]: day_ago - 2, ids[2]: day_ago - 1})
    harness.sync.delete(*(harness.keys.state(job_id) for job_id in ids))
    newest = (await client.post("/v1/jobs", json={"prompt": "hi"})).json()["job_id"]
    # The next submission trimmed the old ones, without anyone listing; a job younger than its
    # retention cannot have expired, and is not looked at.
    assert harness.sync.zrange(index, 0, -1) == [ids[3], newest]
    (await client.post("/v1/jobs", json={"prompt": "hi", "retention_s": 60})).json()
    assert harness.sync.zcard(index) == 3  # 60 s: ids[3] (a second old) is still not looked at
