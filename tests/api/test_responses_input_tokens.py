"""POST /v1/responses/input_tokens: the prompt tokens of the response a request would make, as
the chat it means renders (instructions, a conversation's items or a previous response's chat,
the input), through the official client; bad requests are 400s naming the field."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest
from api_support import MODEL, Harness, make_harness

pytestmark = pytest.mark.anyio

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}


def _openai(harness: Harness) -> openai.AsyncOpenAI:
    transport = httpx.ASGITransport(app=harness.app, raise_app_exceptions=False)
    return openai.AsyncOpenAI(base_url="http://carpool.test/v1", api_key="none", max_retries=0,
                              http_client=httpx.AsyncClient(transport=transport))


async def _tokenized(client: httpx.AsyncClient, messages: list[dict[str, Any]]) -> int:
    """The chat's tokens as /tokenize counts them, with the prompt for the answer after it."""
    answer = await client.post("/tokenize", json={"model": MODEL, "messages": messages,
                                                  "add_generation_prompt": True})
    assert answer.status_code == 200, answer.text
    count: int = answer.json()["count"]
    return count


async def test_the_count_is_the_chat_the_request_means(harness: Harness,
                                                       client: httpx.AsyncClient) -> None:
    official = _openai(harness)
    counted = await official.responses.input_tokens.count(model=MODEL, input="what is the sea",
                                                          instructions="be brief")
    assert counted.object == "response.input_tokens"
    assert counted.input_tokens == await _tokenized(client, [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "what is the sea"}])
    # A conversation's items count before the input; instructions alone count too.
    conversation = await official.conversations.create(items=[
        {"type": "message", "role": "user", "content": "hello"},
        {"type": "message", "role": "assistant", "content": "hi there"}])
    with_history = await official.responses.input_tokens.count(
        model=MODEL, input="and the sky", conversation=conversation.id)
    assert with_history.input_tokens == await _tokenized(client, [
        {"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"},
        {"role": "user", "content": "and the sky"}])
    history_only = await official.responses.input_tokens.count(model=MODEL,
                                                               conversation=conversation.id)
    assert history_only.input_tokens == await _tokenized(client, [
        {"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"}])
    # Function tools are written into the prompt (the tool prompt): they count.
    plain = await official.responses.input_tokens.count(model=MODEL, input="weather in Paris")
    with_tools = await official.responses.input_tokens.count(model=MODEL, input="weather in Paris",
                                                             tools=[WEATHER])  # type: ignore[list-item]
    assert with_tools.input_tokens > plain.input_tokens


async def test_a_previous_response_counts(harness: Harness, client: httpx.AsyncClient) -> None:
    worker = asyncio.create_task(harness.serve_next_job(["Blue"]))
    earlier = (await client.post("/v1/responses", json={"input": "sky colour"})).json()
    await worker
    answer = await client.post("/v1/responses/input_tokens", json={
        "input": "and the sea", "previous_response_id": earlier["id"]})
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"object": "response.input_tokens",
                             "input_tokens": await _tokenized(client, [
                                 {"role": "user", "content": "sky colour"},
                                 {"role": "assistant", "content": "Blue"},
                                 {"role": "user", "content": "and the sea"}])}


@pytest.mark.parametrize(("body", "status", "param", "words"), [
    ({}, 400, "input", "Nothing to count"),
    ({"input": ""}, 400, "input", "empty"),
    ({"input": "x", "stream": True}, 400, "stream", "Unrecognized request argument"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools[0].type",
     "only function tools"),
    ({"input": "x", "conversation": "conv_nope"}, 404, "conversation", "No conversation"),
    ({"input": "x", "previous_response_id": "resp_nope"}, 404, "previous_response_id",
     "No response"),
    ({"input": "x", "model": "nope"}, 404, "model", "nope"),
])
async def test_bad_requests_name_the_field(client: httpx.AsyncClient, body: dict[str, Any],
                                           status: int, param: str, words: str) -> None:
    answer = await client.post("/v1/responses/input_tokens", json=body)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and words in error["message"], error


async def test_no_tokenizer_yet_is_a_503() -> None:
    harness = make_harness()
    harness.register_model(tokenizer=False)
    async with harness.client() as client:
        answer = await client.post("/v1/responses/input_tokens", json={"input": "x"})
    assert answer.status_code == 503, answer.text
    assert "No tokenizer is published" in answer.json()["error"]["message"]
