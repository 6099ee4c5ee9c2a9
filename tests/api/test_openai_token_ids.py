"""vLLM's token-id extras on the OpenAI routes, whole and streamed: return_token_ids (the prompt's
ids as the model saw them, each choice's generated ids), return_tokens_as_token_ids (logprobs
naming tokens `token_id:<id>`), add_special_tokens and truncation_side (the API then decides the
prompt's ids and queues them), and the accepted no-op fields.

The model's tokenizer here is the word tokenizer with a BOS: "<|im_start|>" (id 1) before every
text it encodes with special tokens. Words: 3 hello, 4 world, 6 user, 7 assistant, 8 the;
2 is "<|im_end|>". The chat template renders CHAT as
"<|im_start|>user\\nhello<|im_end|>\\n<|im_start|>assistant\\n": ids 1 6 3 2 1 7."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from api_support import MODEL, Harness, make_harness, parse_sse, word_tokenizer
from tokenizers.processors import TemplateProcessing

from protocol import FinishReason, TokenLogprobs

pytestmark = pytest.mark.anyio

CHAT = [{"role": "user", "content": "hello"}]
CHAT_IDS = [1, 6, 3, 2, 1, 7]
PROMPT = "hello world the"
PROMPT_IDS = [1, 3, 4, 8]  # with the BOS
# (token id, text released, logprobs): the second token's text is held back, then released.
TOKENS = [
    (8, "the", TokenLogprobs(-0.5, ((8, -0.5), (4, -1.25)))),
    (4, "", TokenLogprobs(-2.0, ((3, -0.125), (4, -2.0)))),
    (3, " world hello", TokenLogprobs(-0.25, ((3, -0.25), (8, -3.0)))),
]


@pytest.fixture
def bos_harness() -> Harness:
    harness = make_harness()
    harness.register_model()
    tokenizer = word_tokenizer()
    tokenizer.post_processor = TemplateProcessing(single="<|im_start|> $A",
                                                  special_tokens=[("<|im_start|>", 1)])
    harness.sync.set(harness.keys.model_tokenizer(MODEL), tokenizer.to_str())
    return harness


async def _serve(harness: Harness, reason: FinishReason = FinishReason.LENGTH) -> dict[str, Any]:
    """Play the worker for the next job (TOKENS, then its end); the job's spec."""
    return await harness.serve_entries(TOKENS, reason, prompt_tokens=4)


async def _post(harness: Harness, route: str, body: dict[str, Any],
                ) -> tuple[httpx.Response, dict[str, Any]]:
    """POST /v1/<route> while a worker serves its job: the answer and the job's spec."""
    worker = asyncio.create_task(_serve(harness))
    async with harness.client() as client:
        response = await client.post(f"/v1/{route}", json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return response, await worker


def _chunk_choices(response: httpx.Response) -> list[dict[str, Any]]:
    """Every streamed chunk's choice (chunk-level prompt_token_ids folded in as `chunk_prompt`)."""
    choices = []
    for event in parse_sse(response.text):
        if event.get("data", "[DONE]") == "[DONE]":
            continue
        chunk = json.loads(event["data"])
        (choice,) = chunk["choices"]
        if "prompt_token_ids" in chunk:
            choice["chunk_prompt"] = chunk["prompt_token_ids"]
        choices.append(choice)
    return choices


async def test_completion_returns_token_ids(bos_harness: Harness) -> None:
    response, spec = await _post(bos_harness, "completions",
                                 {"prompt": PROMPT, "max_tokens": 3, "return_token_ids": True})
    assert spec["prompt_token_ids"] == PROMPT_IDS and spec.get("prompt") is None
    assert response.json()["choices"] == [{
        "index": 0, "text": "the world hello", "logprobs": None, "finish_reason": "length",
        "prompt_token_ids": PROMPT_IDS, "token_ids": [8, 4, 3]}]
    assert "prompt_token_ids" not in response.json()


async def test_streamed_completion_returns_token_ids(bos_harness: Harness) -> None:
    response, _ = await _post(bos_harness, "completions", {
        "prompt": PROMPT, "max_tokens": 3, "return_token_ids": True, "stream": True})
    # The prompt's ids on the choice's first chunk (null after, as vLLM's); each chunk's new ids,
    # a held-back token's with the next chunk that carries text.
    assert _chunk_choices(response) == [
        {"index": 0, "text": "the", "logprobs": None, "finish_reason": None,
         "prompt_token_ids": PROMPT_IDS, "token_ids": [8]},
        {"index": 0, "text": " world hello", "logprobs": None, "finish_reason": None,
         "prompt_token_ids": None, "token_ids": [4, 3]},
        {"index": 0, "text": "", "logprobs": None, "finish_reason": "length",
         "prompt_token_ids": None, "token_ids": []},
    ]


async def test_streamed_completion_echo_carries_the_prompt_ids(bos_harness: Harness) -> None:
    response, _ = await _post(bos_harness, "completions", {
        "prompt": PROMPT, "max_tokens": 3, "return_token_ids": True, "stream": True,
        "echo": True})
    assert _chunk_choices(response)[:2] == [
        {"index": 0, "text": PROMPT, "logprobs": None, "finish_reason": None,
         "prompt_token_ids": PROMPT_IDS, "token_ids": []},
        {"index": 0, "text": "the", "logprobs": None, "finish_reason": None,
         "prompt_token_ids": None, "token_ids": [8]},
    ]


async def test_chat_returns_token_ids(bos_harness: Harness) -> None:
    response, spec = await _post(bos_harness, "chat/completions",
                                 {"messages": CHAT, "max_tokens": 3, "return_token_ids": True})
    assert spec["prompt_token_ids"] == CHAT_IDS and spec.get("messages") is None
    answer = response.json()
    assert answer["prompt_token_ids"] == CHAT_IDS  # the response's, as vLLM's chat has it
    assert answer["choices"] == [{
        "index": 0, "logprobs": None, "finish_reason": "length",
        "message": {"role": "assistant", "content": "the world hello"}, "token_ids": [8, 4, 3]}]


async def test_streamed_chat_returns_token_ids(bos_harness: Harness) -> None:
    response, _ = await _post(bos_harness, "chat/completions", {
        "messages": CHAT, "max_tokens": 3, "return_token_ids": True, "stream": True})
    assert _chunk_choices(response) == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
         "finish_reason": None, "chunk_prompt": CHAT_IDS},
        {"index": 0, "delta": {"content": "the"}, "logprobs": None, "finish_reason": None,
         "token_ids": [8]},
        {"index": 0, "delta": {"content": " world hello"}, "logprobs": None,
         "finish_reason": None, "token_ids": [4, 3]},
        {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length", "token_ids": []},
    ]


async def test_without_the_fields_the_worker_tokenizes_as_before(bos_harness: Harness) -> None:
    response, spec = await _post(bos_harness, "completions", {"prompt": PROMPT, "max_tokens": 3})
    assert spec["prompt"] == PROMPT and spec.get("prompt_token_ids") is None
    assert response.json()["choices"] == [{
        "index": 0, "text": "the world hello", "logprobs": None, "finish_reason": "length"}]
    response, spec = await _post(bos_harness, "chat/completions",
                                 {"messages": CHAT, "max_tokens": 3, "stream": True})
    assert spec["messages"] == CHAT and spec.get("prompt_token_ids") is None
    assert all("token_ids" not in c and "chunk_prompt" not in c
               for c in _chunk_choices(response))


@pytest.mark.parametrize(("route", "body", "ids"), [
    # vLLM's defaults, each route's opposite: the API tokenizes and queues the ids.
    ("completions", {"prompt": PROMPT, "add_special_tokens": False}, [3, 4, 8]),
    ("chat/completions", {"messages": CHAT, "add_special_tokens": True}, [1, *CHAT_IDS]),
    # Right truncation keeps the first k tokens; left (the default) the last k.
    ("completions", {"prompt": PROMPT, "truncate_prompt_tokens": 2, "truncation_side": "right"},
     [1, 3]),
    ("chat/completions", {"messages": CHAT, "truncate_prompt_tokens": 3,
                          "truncation_side": "right"}, [1, 6, 3]),
    ("completions", {"prompt": PROMPT, "truncate_prompt_tokens": 2, "truncation_side": "left",
                     "return_token_ids": True}, [4, 8]),
    ("completions", {"prompt": [3, 4, 8], "truncate_prompt_tokens": 2,
                     "truncation_side": "right", "add_special_tokens": True}, [3, 4]),
])
async def test_prompt_ids_decided_as_asked(bos_harness: Harness, route: str,
                                           body: dict[str, Any], ids: list[int]) -> None:
    _, spec = await _post(bos_harness, route, {"max_tokens": 3, **body})
    assert spec["prompt_token_ids"] == ids


async def test_right_truncated_echo_is_the_tokens_seen(bos_harness: Harness) -> None:
    response, _ = await _post(bos_harness, "completions", {
        "prompt": PROMPT, "max_tokens": 3, "echo": True, "truncate_prompt_tokens": 2,
        "truncation_side": "right"})
    assert response.json()["choices"][0]["text"] == "<|im_start|> hello" + "the world hello"


async def test_completion_logprobs_as_token_ids(bos_harness: Harness) -> None:
    body = {"prompt": PROMPT, "max_tokens": 3, "logprobs": 1, "return_tokens_as_token_ids": True}
    expected = {
        "tokens": ["token_id:8", "token_id:4", "token_id:3"],
        "token_logprobs": [-0.5, -2.0, -0.25],
        "top_logprobs": [{"token_id:8": -0.5}, {"token_id:3": -0.125, "token_id:4": -2.0},
                         {"token_id:3": -0.25}],
        "text_offset": [0, 10, 20],  # each written token is 10 characters long (as vLLM counts)
    }
    response, _ = await _post(bos_harness, "completions", body)
    assert response.json()["choices"][0]["logprobs"] == expected
    response, _ = await _post(bos_harness, "completions", {**body, "stream": True})
    streamed = [c["logprobs"] for c in _chunk_choices(response)]
    assert streamed == [
        {"tokens": ["token_id:8"], "token_logprobs": [-0.5], "top_logprobs": [{"token_id:8": -0.5}],
         "text_offset": [0]},
        {"tokens": ["token_id:4", "token_id:3"], "token_logprobs": [-2.0, -0.25],
         "top_logprobs": expected["top_logprobs"][1:], "text_offset": [10, 20]},
        None]


def _as_id(token_id: int, logprob: float) -> dict[str, Any]:
    written = f"token_id:{token_id}"
    return {"token": written, "logprob": logprob, "bytes": list(written.encode())}


async def test_chat_logprobs_as_token_ids(bos_harness: Harness) -> None:
    body = {"messages": CHAT, "max_tokens": 3, "logprobs": True, "top_logprobs": 1,
            "return_tokens_as_token_ids": True}
    # The generated token's bytes stay its text's (vLLM's); its alternatives' are the id strings.
    expected = [
        {**_as_id(8, -0.5), "bytes": list(b"the"), "top_logprobs": [_as_id(8, -0.5)]},
        {**_as_id(4, -2.0), "bytes": list(b"world"), "top_logprobs": [_as_id(3, -0.125)]},
        {**_as_id(3, -0.25), "bytes": list(b"hello"), "top_logprobs": [_as_id(3, -0.25)]},
    ]
    response, _ = await _post(bos_harness, "chat/completions", body)
    assert response.json()["choices"][0]["logprobs"] == {"content": expected}
    response, _ = await _post(bos_harness, "chat/completions", {**body, "stream": True})
    streamed = [c["logprobs"] for c in _chunk_choices(response)]
    assert streamed == [None, {"content": expected[:1]}, {"content": expected[1:]}, None]


async def test_accepted_fields_change_nothing(bos_harness: Harness) -> None:
    plain, plain_spec = await _post(bos_harness, "chat/completions",
                                    {"messages": CHAT, "max_tokens": 3})
    extra, extra_spec = await _post(bos_harness, "chat/completions", {
        "messages": CHAT, "max_tokens": 3, "include_reasoning": False,
        "spaces_between_special_tokens": False, "add_special_tokens": False,
        "truncation_side": "right", "return_token_ids": False,
        "return_tokens_as_token_ids": False, "use_beam_search": False, "length_penalty": 0.5})
    assert {k: v for k, v in extra_spec.items() if k not in {"job_id", "created_at"}} \
        == {k: v for k, v in plain_spec.items() if k not in {"job_id", "created_at"}}
    assert extra.json()["choices"] == plain.json()["choices"]


def _error(response: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    return error


@pytest.mark.parametrize(("route", "body", "param", "words"), [
    ("completions", {"prompt": "x", "return_token_ids": "yes"}, "return_token_ids",
     "valid boolean"),
    ("chat/completions", {"messages": CHAT, "return_tokens_as_token_ids": 1},
     "return_tokens_as_token_ids", "valid boolean"),
    ("completions", {"prompt": "x", "truncation_side": "middle"}, "truncation_side",
     "'left' or 'right'"),
    ("chat/completions", {"messages": CHAT, "add_special_tokens": "false"},
     "add_special_tokens", "valid boolean"),
    ("chat/completions", {"messages": CHAT, "include_reasoning": 1}, "include_reasoning",
     "valid boolean"),
    ("completions", {"prompt": "x", "spaces_between_special_tokens": 0},
     "spaces_between_special_tokens", "valid boolean"),
    ("chat/completions", {"messages": CHAT, "use_beam_search": True}, "use_beam_search",
     "beam search is not served"),
    ("completions", {"prompt": "x", "length_penalty": "long"}, "length_penalty",
     "valid number"),
    # Nothing left to run once tokenized without the BOS.
    ("completions", {"prompt": "  ", "add_special_tokens": False}, "prompt",
     "'prompt' holds no tokens once tokenized"),
])
async def test_bad_values_are_named(bos_harness: Harness, route: str, body: dict[str, Any],
                                    param: str, words: str) -> None:
    async with bos_harness.client() as client:
        error = _error(await client.post(f"/v1/{route}", json={"model": MODEL, **body}))
    assert error["param"] == param
    assert words in error["message"], error["message"]


async def test_deciding_ids_needs_a_tokenizer(harness: Harness) -> None:
    harness.sync.delete(harness.keys.model_tokenizer(MODEL))
    async with harness.client() as client:
        response = await client.post("/v1/completions", json={
            "model": MODEL, "prompt": "hello", "return_token_ids": True})
        assert "'return_token_ids' needs the prompt tokenized here" in _error(response, 503)[
            "message"]
        # Token ids need none: they are the prompt as given.
        worker = asyncio.create_task(_serve(harness))
        response = await client.post("/v1/completions", json={
            "model": MODEL, "prompt": [3, 4], "max_tokens": 3, "return_token_ids": True})
        await worker
    assert response.json()["choices"][0]["prompt_token_ids"] == [3, 4]
