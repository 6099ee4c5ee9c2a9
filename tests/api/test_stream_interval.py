"""vLLM's stream_interval on the OpenAI routes: a choice's first token goes out at once, then its
text every `stream_interval` tokens, the rest with its end; each chunk carries the ids and
logprobs of the tokens whose text it brings."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from api_support import MODEL, Harness, parse_sse

from protocol import FinishReason, TokenLogprobs

pytestmark = pytest.mark.anyio

# Five tokens; the third's text is held back by the worker (it comes with the fourth's).
TOKENS = [(3, "hello", None), (4, " world", None), (8, "", None), (9, " the a", None),
          (4, " world", None)]


async def _stream(harness: Harness, route: str, body: dict[str, Any],
                  tokens: list[tuple[int, str, TokenLogprobs | None]] = TOKENS,
                  ) -> list[dict[str, Any]]:
    """The streamed chunks' choices, while a stand-in worker serves `tokens`."""
    worker = asyncio.create_task(harness.serve_entries(tokens, FinishReason.LENGTH))
    async with harness.client() as client:
        response = await client.post(f"/v1/{route}", json={
            "model": MODEL, "stream": True, "max_tokens": len(tokens), **body})
    await worker
    assert response.status_code == 200, response.text
    return [json.loads(e["data"])["choices"][0] for e in parse_sse(response.text)
            if e.get("data", "[DONE]") != "[DONE]"]


@pytest.mark.parametrize(("interval", "texts", "ids"), [
    (1, ["hello", " world", " the a", " world", ""], [[3], [4], [8, 9], [4], []]),
    (2, ["hello", " world", " the a world", ""], [[3], [4, 8], [9, 4], []]),
    (3, ["hello", " world the a", " world", ""], [[3], [4, 8, 9], [4], []]),
    (4, ["hello", " world the a world", ""], [[3], [4, 8, 9, 4], []]),
    (50, ["hello", " world the a world", ""], [[3], [4, 8, 9, 4], []]),
])
async def test_completion_chunks_gather_interval_tokens(harness: Harness, interval: int,
                                                        texts: list[str], ids: list[list[int]]) -> None:
    choices = await _stream(harness, "completions", {"prompt": [3, 4], "stream_interval": interval,
                                                     "return_token_ids": True})
    assert [c["text"] for c in choices] == texts
    assert [c["token_ids"] for c in choices] == ids
    assert [c["finish_reason"] for c in choices] == [None] * (len(texts) - 1) + ["length"]


async def test_the_first_text_goes_at_once_even_when_the_first_token_held_it_back(
        harness: Harness) -> None:
    tokens: list[tuple[int, str, TokenLogprobs | None]] = [
        (8, "", None), (3, "the hello", None), (4, " world", None), (9, " the", None)]
    choices = await _stream(harness, "completions", {"prompt": [3, 4], "stream_interval": 3,
                                                     "return_token_ids": True}, tokens)
    assert [(c["text"], c["token_ids"]) for c in choices] == [
        ("the hello", [8, 3]), (" world the", [4, 9]), ("", [])]


async def test_chat_chunks_gather_interval_tokens_with_their_logprobs(harness: Harness) -> None:
    tokens: list[tuple[int, str, TokenLogprobs | None]] = [
        (token_id, text, TokenLogprobs(-0.5 * (i + 1), ((token_id, -0.5 * (i + 1)),)))
        for i, (token_id, text, _) in enumerate(TOKENS)]
    choices = await _stream(harness, "chat/completions", {
        "messages": [{"role": "user", "content": "hello"}], "stream_interval": 2,
        "logprobs": True}, tokens)
    assert [c["delta"].get("content") for c in choices] == ["", "hello", " world", " the a world",
                                                           None]
    assert [[t["logprob"] for t in (c["logprobs"] or {"content": []})["content"]]
            for c in choices] == [[], [-0.5], [-1.0, -1.5], [-2.0, -2.5], []]


@pytest.mark.parametrize("value", [0, -1, 1025, "2", 1.5])
async def test_bad_intervals_are_400s_naming_the_field(harness: Harness, value: object) -> None:
    async with harness.client() as client:
        response = await client.post("/v1/completions", json={
            "model": MODEL, "prompt": "hello", "stream": True, "stream_interval": value})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "stream_interval"
