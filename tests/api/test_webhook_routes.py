"""webhook_url at submission (jobs API field, OpenAI extension field or X-Carpool-Webhook-Url),
checked against CARPOOL_WEBHOOK_ALLOWED_HOSTS; GET /v1/webhooks/dead-letters."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import openai
import pytest
from api_support import KEY_A, KEY_B, MODEL, Harness, make_harness
from rq.job import Job
from rq.serializers import JSONSerializer

from protocol.webhook_events import DeadLetter, WebhookEvent

pytestmark = pytest.mark.anyio

LOCAL = "http://127.0.0.1:9000/hooks"
SETTING = "CARPOOL_WEBHOOK_ALLOWED_HOSTS"


@pytest.fixture
def allowing() -> Iterator[Harness]:
    h = make_harness(webhook_allowed_hosts=["127.0.0.1", "*.hooks.test"])
    h.register_model()
    yield h


def _openai(harness: Harness, key: str = "none") -> openai.AsyncOpenAI:
    transport = httpx.ASGITransport(app=harness.app, raise_app_exceptions=False)
    return openai.AsyncOpenAI(base_url="http://carpool.test/v1", api_key=key, max_retries=0,
                              http_client=httpx.AsyncClient(transport=transport))


def _spec(harness: Harness, job_id: str) -> dict:
    return Job.fetch(job_id, connection=harness.context.sync, serializer=JSONSerializer).args[0]


async def test_a_loopback_url_is_refused_naming_the_setting(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/jobs", json={"prompt": "hello", "webhook_url": LOCAL})
    assert response.status_code == 422  # the jobs API's invalid input (400 on the OpenAI routes)
    assert response.json() == {"detail": [{
        "loc": ["body", "webhook_url"], "type": "invalid_value",
        "msg": "webhook_url host '127.0.0.1' is a non-public address (127.0.0.1: private, "
               f"loopback or link-local); allow it in {SETTING}"}]}


@pytest.mark.parametrize(("url", "message"), [
    ("ftp://127.0.0.1/x", "webhook_url must be an http:// or https:// URL"),
    ("http://[fe80::1]/x", "webhook_url host 'fe80::1' (fe80::1) is not in the webhook allow-list; "
                           f"add it to {SETTING}"),
    ("http://10.0.0.1/x", "webhook_url host '10.0.0.1' (10.0.0.1) is not in the webhook "
                          f"allow-list; add it to {SETTING}"),
])
async def test_urls_outside_the_allow_list_are_refused(allowing: Harness, url: str,
                                                       message: str) -> None:
    async with allowing.client() as client:
        response = await client.post("/v1/jobs", json={"prompt": "hello", "webhook_url": url})
    assert response.status_code == 422
    assert response.json()["detail"][0]["msg"] == message


async def test_an_allowed_url_travels_in_the_spec_and_the_state(allowing: Harness) -> None:
    async with allowing.client() as client:
        response = await client.post("/v1/jobs", json={"prompt": "hello", "webhook_url": LOCAL,
                                                        "n": 2})
    assert response.status_code == 202, response.text
    for job_id in response.json()["job_ids"]:
        assert _spec(allowing, job_id)["webhook_url"] == LOCAL
        assert allowing.state(job_id).webhook_url == LOCAL
    # A name matching a pattern needs no resolution.
    async with allowing.client() as client:
        named = await client.post("/v1/jobs", json={"prompt": "hello",
                                                     "webhook_url": "https://a.hooks.test/x"})
    assert named.status_code == 202, named.text


async def test_openai_routes_take_the_field_or_the_header(allowing: Harness) -> None:
    client = _openai(allowing)
    worker = asyncio.create_task(allowing.serve_next_job(["ok"]))
    await client.completions.create(model=MODEL, prompt="hello", max_tokens=2,
                                    extra_body={"webhook_url": LOCAL})
    assert allowing.state(await worker).webhook_url == LOCAL
    worker = asyncio.create_task(allowing.serve_next_job(["ok"]))
    await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        extra_headers={"X-Carpool-Webhook-Url": "http://127.0.0.1:9001/h"})
    assert allowing.state(await worker).webhook_url == "http://127.0.0.1:9001/h"


async def test_openai_refusals_are_400_in_openai_shape(harness: Harness) -> None:
    client = _openai(harness)
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}],
            extra_headers={"X-Carpool-Webhook-Url": "http://localhost:1/x"})
    assert caught.value.status_code == 400
    body = caught.value.body
    assert body["param"] == "X-Carpool-Webhook-Url"
    assert body["message"].startswith("webhook_url host 'localhost' is a non-public address")
    assert body["message"].endswith(f"allow it in {SETTING}")
    with pytest.raises(openai.BadRequestError) as both:
        await client.completions.create(
            model=MODEL, prompt="hi", extra_body={"webhook_url": "http://a.test/1"},
            extra_headers={"X-Carpool-Webhook-Url": "http://a.test/2"})
    assert both.value.body["message"] == ("give the webhook URL once: the body's webhook_url or "
                                          "the X-Carpool-Webhook-Url header")


async def test_dead_letters_list_the_callers_own_newest_first() -> None:
    h = make_harness(api_keys=[KEY_A, KEY_B])
    h.register_model()
    async with h.client(KEY_A) as client:
        job_id = (await client.post("/v1/jobs", json={"prompt": "hello"})).json()["job_id"]
    owner_a = h.state(job_id).owner
    for i, owner in enumerate([owner_a, "someone-else", owner_a]):
        event = WebhookEvent(event_id=f"1-{i}", type="job.failed", url=f"https://h.test/{i}",
                             at=100.0 + i, data=f'{{"id": "job-{i}"}}', owner=owner)
        letter = DeadLetter.of(event, attempts=8, status_code=500 if i else 0,
                               error="HTTP 500" if i else "ConnectTimeout", dead_at=200.0 + i)
        h.sync.xadd(h.keys.webhook_dead_letters(), letter.to_fields())
    async with h.client(KEY_A) as client:
        listed = (await client.get("/v1/webhooks/dead-letters")).json()
        assert (await client.get("/v1/webhooks/dead-letters?limit=0")).status_code == 422
    assert listed == {"object": "list", "data": [
        {"webhook_id": "msg_1-2", "type": "job.failed", "url": "https://h.test/2",
         "data": {"id": "job-2"}, "attempts": 8, "status_code": 500, "error": "HTTP 500",
         "created_at": 102.0, "dead_at": 202.0},
        {"webhook_id": "msg_1-0", "type": "job.failed", "url": "https://h.test/0",
         "data": {"id": "job-0"}, "attempts": 8, "status_code": None, "error": "ConnectTimeout",
         "created_at": 100.0, "dead_at": 200.0}]}
    async with h.client(KEY_B) as client:
        assert (await client.get("/v1/webhooks/dead-letters")).json()["data"] == []
    async with h.client() as client:
        assert (await client.get("/v1/webhooks/dead-letters")).status_code == 401
