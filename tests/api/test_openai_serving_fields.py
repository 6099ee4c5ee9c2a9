"""OpenAI's newer request fields on chat completions and responses: the service tier picks the
queue and is named in the answer; reasoning_effort reaches the chat template; the fields that
cannot change an answer are accepted; audio, web search, moderation and the deprecated
functions are refused naming the field."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest
from api_support import CHAT_TEMPLATE, MODEL, Harness, parse_sse
from rq.job import Job
from rq.serializers import JSONSerializer

from protocol import FinishReason

pytestmark = pytest.mark.anyio

CHAT = [{"role": "user", "content": "hello"}]
# A template that reads reasoning_effort, as gpt-oss's and other thinking models' do.
EFFORT_TEMPLATE = ("{% if reasoning_effort %}Reasoning: {{ reasoning_effort }}\n{% endif %}"
                   + CHAT_TEMPLATE)


def _spec(harness: Harness, job_id: str) -> dict[str, Any]:
    spec: dict[str, Any] = Job.fetch(job_id, connection=harness.context.sync,
                                     serializer=JSONSerializer).args[0]
    return spec


async def _chat(harness: Harness, client: httpx.AsyncClient,
                **fields: Any) -> tuple[httpx.Response, dict[str, Any]]:
    worker = asyncio.create_task(harness.serve_next_job(["ok"]))
    response = await client.post("/v1/chat/completions", json={"messages": CHAT, **fields})
    job_id = await worker
    assert response.status_code == 200, response.text
    return response, _spec(harness, job_id)


@pytest.mark.parametrize(("tier", "queue", "served"), [
    ("priority", "high", "priority"), ("fast", "high", "priority"), ("flex", "low", "flex"),
    ("auto", "normal", "default"), ("default", "normal", "default"), ("scale", "normal", "default"),
])
async def test_the_service_tier_picks_the_queue_and_the_answer_names_it(
        harness: Harness, client: httpx.AsyncClient, tier: str, queue: str, served: str) -> None:
    response, spec = await _chat(harness, client, service_tier=tier)
    assert spec["priority"] == queue
    assert response.json()["service_tier"] == served


async def test_an_answer_without_a_tier_asked_names_none(harness: Harness,
                                                         client: httpx.AsyncClient) -> None:
    response, spec = await _chat(harness, client, priority="low")
    assert spec["priority"] == "low"
    assert "service_tier" not in response.json()


async def test_a_standard_tier_keeps_the_priority_given(harness: Harness,
                                                        client: httpx.AsyncClient) -> None:
    response, spec = await _chat(harness, client, service_tier="auto", priority="low")
    assert spec["priority"] == "low"
    _, spec = await _chat(harness, client, service_tier="priority", priority="high")
    assert spec["priority"] == "high"  # the two agree


async def test_a_tier_and_a_priority_that_disagree_are_a_400(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/chat/completions", json={
        "messages": CHAT, "service_tier": "flex", "priority": "high"})
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": "'service_tier' 'flex' waits in the low queue but 'priority' asks for high: "
                   "send one of them",
        "type": "invalid_request_error", "param": "service_tier", "code": "invalid_value"}


async def test_streamed_chunks_name_the_tier(harness: Harness, client: httpx.AsyncClient) -> None:
    worker = asyncio.create_task(harness.serve_next_job(["a", "b"]))
    response = await client.post("/v1/chat/completions", json={
        "messages": CHAT, "stream": True, "service_tier": "flex"})
    await worker
    chunks = [json.loads(event["data"]) for event in parse_sse(response.text)
              if event.get("data", "[DONE]") != "[DONE]"]
    assert len(chunks) == 4  # the role, two texts, the finish
    assert [chunk["service_tier"] for chunk in chunks] == ["flex"] * 4


async def test_the_official_client_sends_the_newer_fields(harness: Harness) -> None:
    transport = httpx.ASGITransport(app=harness.app, raise_app_exceptions=False)
    client = openai.AsyncOpenAI(base_url="http://carpool.test/v1", api_key="none", max_retries=0,
                                http_client=httpx.AsyncClient(transport=transport))
    worker = asyncio.create_task(harness.serve_next_job(["4"]))
    chat = await client.chat.completions.create(
        model=MODEL, messages=CHAT, service_tier="priority",  # type: ignore[arg-type]
        prompt_cache_key="session-7", prompt_cache_retention="24h", safety_identifier="user-hash",
        verbosity="low", modalities=["text"], reasoning_effort="low",
        prediction={"type": "content", "content": "4"})
    job_id = await worker
    assert chat.choices[0].message.content == "4"
    assert chat.service_tier == "priority"
    spec = _spec(harness, job_id)
    assert spec["priority"] == "high"
    assert spec["messages"] == CHAT
    assert "chat_template_kwargs" not in spec  # this model's template reads no reasoning_effort


async def test_harmless_fields_leave_the_job_as_it_was(harness: Harness,
                                                       client: httpx.AsyncClient) -> None:
    _, plain = await _chat(harness, client)
    _, given = await _chat(
        harness, client, prompt_cache_key="k", prompt_cache_retention="in_memory",
        prompt_cache_options={"mode": "implicit"}, safety_identifier="s", verbosity="high",
        modalities=["text"], prediction={"type": "content", "content": [{"type": "text",
                                                                          "text": "ok"}]},
        audio=None, web_search_options=None, functions=None, function_call=None, moderation=None)
    for spec in (plain, given):
        del spec["job_id"], spec["created_at"]
    assert given == plain


async def test_reasoning_effort_reaches_a_template_that_reads_it(harness: Harness,
                                                                 client: httpx.AsyncClient) -> None:
    harness.register_model(name="thinker", chat_template=EFFORT_TEMPLATE)

    async def serve() -> str:
        job_id = await harness.take_job(model="thinker")
        harness.finish_job(job_id, ["!"])
        return job_id

    bodies: list[dict[str, Any]] = [
        {"reasoning_effort": "high"},
        {"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "low"}},
        {"chat_template_kwargs": {"reasoning_effort": "medium"}},
    ]
    efforts = []
    for extra in bodies:
        worker = asyncio.create_task(serve())
        response = await client.post("/v1/chat/completions", json={
            "model": "thinker", "messages": CHAT, "max_tokens": 2, **extra})
        job_id = await worker
        assert response.status_code == 200, response.text
        efforts.append(_spec(harness, job_id)["chat_template_kwargs"])
    assert efforts == [{"reasoning_effort": "high"}, {"reasoning_effort": "low"},
                       {"reasoning_effort": "medium"}]


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}},
     "reasoning_effort", "'reasoning_effort' is 'low' but chat_template_kwargs' reasoning_effort "
                         "is 'high': send one of them"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort", "'none', 'minimal', 'low'"),
    ({"service_tier": "turbo"}, "service_tier", "'auto', 'default', 'flex'"),
    ({"modalities": ["text", "audio"]}, "modalities", "audio output is not available"),
    ({"modalities": ["video"]}, "modalities.0", "'text' or 'audio'"),
    ({"audio": {"voice": "alloy", "format": "mp3"}}, "audio", "audio output is not available"),
    ({"web_search_options": {}}, "web_search_options", "web search is a hosted tool"),
    ({"functions": [{"name": "f"}]}, "functions", "deprecated form of tools, not served: send tools"),
    ({"function_call": "auto"}, "function_call", "send tools and tool_choice"),
    ({"moderation": {"input": {"mode": "block"}}}, "moderation", "moderation is not available"),
    ({"prediction": {"type": "code", "content": "x"}}, "prediction.type", "'content'"),
    ({"prediction": {"type": "content"}}, "prediction.content", "Missing required parameter"),
    ({"prompt_cache_retention": "1h"}, "prompt_cache_retention", "'in_memory' or '24h'"),
    ({"verbosity": "loud"}, "verbosity", "'low', 'medium' or 'high'"),
])
async def test_chat_refuses(client: httpx.AsyncClient, body: dict[str, Any], param: str,
                            words: str) -> None:
    response = await client.post("/v1/chat/completions", json={"messages": CHAT, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert words in error["message"], error["message"]


async def test_a_response_waits_in_its_tiers_queue_and_names_it(harness: Harness,
                                                                client: httpx.AsyncClient) -> None:
    worker = asyncio.create_task(harness.serve_next_job(["Hi"], FinishReason.STOP, 7))
    response = await client.post("/v1/responses", json={
        "input": "hello", "service_tier": "flex", "max_tool_calls": 3, "prompt_cache_key": "k",
        "prompt_cache_retention": "24h", "safety_identifier": "s"})
    job_id = await worker
    assert response.status_code == 200, response.text
    assert response.json()["service_tier"] == "flex"
    assert _spec(harness, job_id)["priority"] == "low"
    refused = await client.post("/v1/responses", json={
        "input": "hello", "service_tier": "priority", "priority": "low"})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "service_tier"
    moderated = await client.post("/v1/responses", json={"input": "hello", "moderation": {}})
    assert moderated.status_code == 400
    assert moderated.json()["error"]["param"] == "moderation"
