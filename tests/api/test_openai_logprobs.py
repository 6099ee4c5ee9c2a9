"""Logprobs in OpenAI's shapes (completions and chat, streamed and not, through the official
client) and on the jobs API, from token entries a stand-in worker writes; and the sampling fields
reaching the job spec. The word tokenizer decodes id 3 as "hello", 4 as "world", 8 as "the"."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest
from api_support import MODEL, Harness, parse_sse

from protocol import FinishReason, TokenLogprobs

pytestmark = pytest.mark.anyio

CHAT = [{"role": "user", "content": "hello"}]
# (token id, text released, logprobs): the second token's text is held back, then released.
TOKENS = [
    (3, "hello", TokenLogprobs(-0.5, ((3, -0.5), (4, -1.25)))),
    (4, "", TokenLogprobs(-2.0, ((8, -0.125), (4, -2.0)))),
    (8, " world the", TokenLogprobs(-0.25, ((8, -0.25), (3, -3.0)))),
]


def _client(harness: Harness) -> openai.AsyncOpenAI:
    transport = httpx.ASGITransport(app=harness.app, raise_app_exceptions=False)
    return openai.AsyncOpenAI(base_url="http://carpool.test/v1", api_key="none", max_retries=0,
                              http_client=httpx.AsyncClient(transport=transport))


async def _serve(harness: Harness, tokens: list[tuple[int, str, TokenLogprobs]] = TOKENS,
                 reason: FinishReason = FinishReason.LENGTH) -> dict[str, Any]:
    """Play the worker for the next job: its tokens with logprobs, then its end; the job's spec."""
    return await harness.serve_entries(tokens, reason)


COMPLETION_LOGPROBS = {
    "tokens": ["hello", "world", "the"],
    "token_logprobs": [-0.5, -2.0, -0.25],
    "top_logprobs": [{"hello": -0.5, "world": -1.25}, {"the": -0.125, "world": -2.0},
                     {"the": -0.25, "hello": -3.0}],
    "text_offset": [0, 5, 10],
}


def _chat_token(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


CHAT_CONTENT = [
    {**_chat_token("hello", -0.5), "top_logprobs": [_chat_token("hello", -0.5)]},
    {**_chat_token("world", -2.0), "top_logprobs": [_chat_token("the", -0.125)]},
    {**_chat_token("the", -0.25), "top_logprobs": [_chat_token("the", -0.25)]},
]


async def test_completion_logprobs(harness: Harness) -> None:
    worker = asyncio.create_task(_serve(harness))
    completion = await _client(harness).completions.create(
        model=MODEL, prompt="hello world", max_tokens=3, logprobs=2)
    spec = await worker
    assert spec["sampling"]["logprobs"] == 2
    assert completion.choices[0].text == "hello world the"
    assert completion.choices[0].logprobs is not None
    assert completion.choices[0].logprobs.model_dump() == COMPLETION_LOGPROBS


async def test_streamed_completion_logprobs_wait_for_held_text(harness: Harness) -> None:
    worker = asyncio.create_task(_serve(harness))
    stream = await _client(harness).completions.create(
        model=MODEL, prompt="hello world", max_tokens=3, logprobs=2, stream=True)
    chunks = [chunk async for chunk in stream]
    await worker
    texts = [chunk.choices[0].text for chunk in chunks]
    assert texts == ["hello", " world the", ""]
    first, second, last = (chunk.choices[0].logprobs for chunk in chunks)
    assert first is not None and second is not None and last is None
    assert first.model_dump() == {key: value[:1] for key, value in COMPLETION_LOGPROBS.items()}
    assert second.model_dump() == {key: value[1:] for key, value in COMPLETION_LOGPROBS.items()}


async def test_chat_logprobs(harness: Harness) -> None:
    worker = asyncio.create_task(_serve(harness))
    completion = await _client(harness).chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=3, logprobs=True, top_logprobs=1)  # type: ignore[arg-type]
    spec = await worker
    assert spec["sampling"]["logprobs"] == 1
    assert completion.choices[0].logprobs is not None
    assert completion.choices[0].logprobs.model_dump()["content"] == CHAT_CONTENT


async def test_chat_logprobs_without_top_logprobs(harness: Harness, client: httpx.AsyncClient) -> None:
    worker = asyncio.create_task(_serve(harness))
    response = await client.post("/v1/chat/completions", json={
        "messages": CHAT, "max_tokens": 3, "logprobs": True})
    spec = await worker
    assert spec["sampling"]["logprobs"] == 0
    content = response.json()["choices"][0]["logprobs"]["content"]
    # The stand-in worker sends alternatives anyway: the answer keeps as many as were asked.
    assert content == [{**entry, "top_logprobs": []} for entry in CHAT_CONTENT]


async def test_streamed_chat_logprobs(harness: Harness) -> None:
    worker = asyncio.create_task(_serve(harness))
    stream = await _client(harness).chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=3, logprobs=True, top_logprobs=1,  # type: ignore[arg-type]
        stream=True)
    chunks = [chunk async for chunk in stream]
    await worker
    contents = [[c.model_dump() for c in chunk.choices[0].logprobs.content]
                if chunk.choices[0].logprobs and chunk.choices[0].logprobs.content is not None else None
                for chunk in chunks]
    assert contents == [None, CHAT_CONTENT[:1], CHAT_CONTENT[1:], None]


async def test_no_logprobs_asked_none_sent(harness: Harness, client: httpx.AsyncClient) -> None:
    worker = asyncio.create_task(_serve(harness))
    response = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
    spec = await worker
    assert "logprobs" not in spec["sampling"]
    assert response.json()["choices"][0]["logprobs"] is None


async def test_jobs_api_stream_and_status_carry_logprobs(harness: Harness,
                                                         client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/jobs", json={"prompt": "hello", "max_tokens": 3, "logprobs": 2})
    assert response.status_code == 202
    spec = await _serve(harness)
    job_id = spec["job_id"]
    stream = await client.get(f"/v1/jobs/{job_id}/stream")
    tokens = [json.loads(e["data"]) for e in parse_sse(stream.text) if e.get("event") == "token"]
    assert tokens[1] == {"index": 1, "token_id": 4, "text": "", "logprob": -2.0,
                         "top_logprobs": [{"token_id": 8, "logprob": -0.125},
                                          {"token_id": 4, "logprob": -2.0}]}
    # Resuming after the first event returns the rest, logprobs included.
    resumed = await client.get(f"/v1/jobs/{job_id}/stream", headers={"Last-Event-ID": "0-1"})
    rest = [json.loads(e["data"]) for e in parse_sse(resumed.text) if e.get("event") == "token"]
    assert rest == tokens[1:]
    view = (await client.get(f"/v1/jobs/{job_id}")).json()
    assert view["logprobs"] == [
        {"index": i, "token_id": token_id, "logprob": logprobs.logprob,
         "top_logprobs": [{"token_id": t, "logprob": lp} for t, lp in logprobs.top]}
        for i, (token_id, _, logprobs) in enumerate(TOKENS)]
    assert view["text"] == "hello world the"


async def test_sampling_fields_reach_the_job_spec(harness: Harness, client: httpx.AsyncClient) -> None:
    fields = {"presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2,
              "logit_bias": {"7": -100, "3": 2.5}, "min_p": 0.1, "min_tokens": 2,
              "stop_token_ids": [9, 4], "top_k": 5, "seed": 11, "typical_p": 0.9}
    expected = {**fields, "logit_bias": {"3": 2.5, "7": -100.0}}
    for route, body in (("/v1/completions", {"prompt": "hello"}),
                        ("/v1/chat/completions", {"messages": CHAT}),
                        ("/v1/jobs", {"prompt": "hello"})):
        worker = asyncio.create_task(_serve(harness))
        response = await client.post(route, json={**body, "max_tokens": 3, **fields})
        assert response.status_code in (200, 202), response.text
        sampling = (await worker)["sampling"]
        assert {name: sampling[name] for name in expected} == expected, route
