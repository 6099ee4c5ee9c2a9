"""SageMaker's routes as vLLM and TGI serve them: POST /invocations answers a chat completion, a
completion or a TGI generate body as their own routes do (told apart by messages, prompt,
inputs), and refuses anything else with a 400 saying what it takes; /ping is /health."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from api_support import MODEL, Harness

pytestmark = pytest.mark.anyio


async def _invoke(harness: Harness, client: httpx.AsyncClient, body: dict[str, Any]) -> Any:
    worker = asyncio.create_task(harness.serve_next_job(["hello", " world"]))
    response = await client.post("/invocations", json=body)
    await worker
    assert response.status_code == 200, response.text
    return response.json()


async def test_each_kind_of_body_is_answered_by_its_own_route(harness: Harness,
                                                             client: httpx.AsyncClient) -> None:
    chat = await _invoke(harness, client, {"model": MODEL, "max_tokens": 4,
                                           "messages": [{"role": "user", "content": "hello"}]})
    assert (chat["object"], chat["choices"][0]["message"]["content"]) == ("chat.completion", "hello world")
    completion = await _invoke(harness, client, {"model": MODEL, "prompt": "hello", "max_tokens": 4})
    assert (completion["object"], completion["choices"][0]["text"]) == ("text_completion", "hello world")
    generated = await _invoke(harness, client, {"inputs": "hello", "parameters": {"max_new_tokens": 4}})
    assert generated == [{"generated_text": "hello world"}]


@pytest.mark.parametrize(("content", "says"), [
    ('{"model": "tiny"}', "'messages'"),
    ("[1, 2]", "must be a JSON object"),
    ("{not json", "not valid JSON"),
    ('{"prompt": "hello", "max_tokens": -1}', "'max_tokens'"),
])
async def test_other_bodies_are_400s_saying_what_it_takes(client: httpx.AsyncClient, content: str,
                                                          says: str) -> None:
    response = await client.post("/invocations", content=content,
                                 headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert says in response.json()["error"]["message"]


async def test_ping_is_the_health_check(harness: Harness, client: httpx.AsyncClient) -> None:
    harness.add_worker()
    health = (await client.get("/health")).json()
    for method in ("GET", "POST"):
        response = await client.request(method, "/ping")
        assert response.status_code == 200 and response.json() == health
