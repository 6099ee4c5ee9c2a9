"""POST /v1/jobs answers 422 for every invalid input, naming the field and the limit."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from api_support import CONTEXT, Harness

pytestmark = pytest.mark.anyio

CHAT = [{"role": "user", "content": "hello"}]


def _field_error(response: httpx.Response) -> tuple[list[Any], str]:
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert isinstance(detail, list) and detail
    return detail[0]["loc"], detail[0]["msg"]


@pytest.mark.parametrize(("body", "loc", "words"), [
    ({"prompt": ""}, ["body", "prompt"], "at least 1 character"),
    ({"prompt": 5}, ["body", "prompt"], "valid string"),
    ({"messages": []}, ["body", "messages"], "at least 1 item"),
    ({"messages": [{"role": "robot", "content": "x"}]}, ["body", "messages", 0, "role"], "'user'"),
    ({"messages": "hello"}, ["body", "messages"], "valid list"),
    ({"prompt": "x", "max_tokens": 0}, ["body", "max_tokens"], "greater than or equal to 1"),
    ({"prompt": "x", "max_tokens": "10"}, ["body", "max_tokens"], "valid integer"),
    ({"prompt": "x", "max_tokens": 2.5}, ["body", "max_tokens"], "valid integer"),
    ({"prompt": "x", "temperature": 2.5}, ["body", "temperature"], "less than or equal to 2"),
    ({"prompt": "x", "temperature": -0.1}, ["body", "temperature"], "greater than or equal to 0"),
    ({"prompt": "x", "temperature": "hot"}, ["body", "temperature"], "valid number"),
    ({"prompt": "x", "top_p": 0}, ["body", "top_p"], "greater than 0"),
    ({"prompt": "x", "top_p": 1.5}, ["body", "top_p"], "less than or equal to 1"),
    ({"prompt": "x", "top_k": -1}, ["body", "top_k"], "greater than or equal to 0"),
    ({"prompt": "x", "stop": [str(i) for i in range(17)]}, ["body", "stop"], "at most 16 items"),
    ({"prompt": "x", "stop": [""]}, ["body", "stop", 0], "at least 1 character"),
    ({"prompt": "x", "seed": 2**64}, ["body", "seed"], "less than or equal to"),
    # The worker refuses seeds outside 0..2**63-1 and stop strings over 256 characters: the API
    # must refuse them too, rather than answer 202 for a job that can only fail.
    ({"prompt": "x", "seed": -1}, ["body", "seed"], "greater than or equal to 0"),
    ({"prompt": "x", "seed": 2**63}, ["body", "seed"], "less than or equal to 9223372036854775807"),
    ({"prompt": "x", "stop": ["x" * 257]}, ["body", "stop", 0], "at most 256 characters"),
    ({"prompt": "x", "priority": "urgent"}, ["body", "priority"], "'high', 'normal', 'low' or 'batch'"),
    ({"prompt": "x", "ignore_eos": "yes"}, ["body", "ignore_eos"], "valid boolean"),
    ({"prompt": "x", "include_stop_str_in_output": 1}, ["body", "include_stop_str_in_output"],
     "valid boolean"),
    ({"prompt": "x", "skip_special_tokens": "no"}, ["body", "skip_special_tokens"], "valid boolean"),
    ({"prompt": "x", "n": 0}, ["body", "n"], "greater than or equal to 1"),
    ({"prompt": "x", "n": 17}, ["body", "n"], "'n' must be at most 16 (got 17)"),
])
async def test_invalid_field_answers_422_naming_it(client: httpx.AsyncClient, body: dict[str, Any],
                                                   loc: list[Any], words: str) -> None:
    got_loc, message = _field_error(await client.post("/v1/jobs", json=body))
    assert got_loc == loc
    assert words in message


@pytest.mark.parametrize("body", [{}, {"prompt": "x", "messages": CHAT}])
async def test_exactly_one_of_prompt_and_messages(client: httpx.AsyncClient,
                                                  body: dict[str, Any]) -> None:
    loc, message = _field_error(await client.post("/v1/jobs", json=body))
    assert loc == ["body"]
    assert message == "give exactly one of 'prompt' and 'messages'"


async def test_a_model_never_served_is_404(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/jobs", json={"prompt": "x", "model": "gpt-9"})
    assert response.status_code == 404
    assert response.json() == {"detail": "The model 'gpt-9' does not exist; known models: tiny"}


async def test_prompt_longer_than_the_context(client: httpx.AsyncClient) -> None:
    # The test tokenizer makes one token of each word.
    response = await client.post("/v1/jobs", json={"prompt": "hello " * CONTEXT})
    loc, message = _field_error(response)
    assert loc == ["body", "prompt"]
    assert f"'prompt' is {CONTEXT} tokens long" in message
    assert f"context length of {CONTEXT} tokens" in message


async def test_chat_longer_than_the_context_counts_the_template(client: httpx.AsyncClient) -> None:
    # 27 words fit in 32 tokens, but the template adds 5: <|im_start|> user ... <|im_end|>
    # <|im_start|> assistant.
    messages = [{"role": "user", "content": "hello " * 27}]
    loc, message = _field_error(await client.post("/v1/jobs", json={"messages": messages}))
    assert loc == ["body", "messages"]
    assert message.startswith("'messages' is 32 tokens long")
    shorter = [{"role": "user", "content": "hello " * 26}]
    response = await client.post("/v1/jobs", json={"messages": shorter, "max_tokens": 1})
    assert response.status_code == 202
    assert response.json()["prompt_tokens"] == 31


async def test_truncate_prompt_tokens_counts_what_the_model_will_see(client: httpx.AsyncClient) -> None:
    # vLLM's: the prompt's last k tokens. 40 words do not fit the 32-token context; 10 do.
    long = {"prompt": "hello " * 40, "max_tokens": 4}
    assert (await client.post("/v1/jobs", json=long)).status_code == 422
    response = await client.post("/v1/jobs", json={**long, "truncate_prompt_tokens": 10})
    assert response.status_code == 202, response.text
    assert response.json()["prompt_tokens"] == 10
    # -1: as many as the context holds, which leaves nothing to generate here: said so.
    loc, message = _field_error(await client.post("/v1/jobs", json={**long, "truncate_prompt_tokens": -1}))
    assert loc == ["body", "prompt"] and "nothing would be left to generate" in message
    loc, message = _field_error(await client.post("/v1/jobs", json={**long, "truncate_prompt_tokens": 0}))
    assert loc == ["body", "truncate_prompt_tokens"] and "0 would keep no prompt" in message


async def test_max_tokens_above_the_context(client: httpx.AsyncClient) -> None:
    loc, message = _field_error(
        await client.post("/v1/jobs", json={"prompt": "hello", "max_tokens": CONTEXT + 1}))
    assert loc == ["body", "max_tokens"]
    assert message == (f"'max_tokens' must be at most {CONTEXT}, the context length of model "
                       f"'tiny' (got {CONTEXT + 1})")


async def test_prompt_plus_max_tokens_above_the_context(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/jobs", json={"prompt": "hello " * 20, "max_tokens": 13})
    loc, message = _field_error(response)
    assert loc == ["body", "max_tokens"]
    assert "the prompt takes 20, so 'max_tokens' can be at most 12 (got 13)" in message
    ok = await client.post("/v1/jobs", json={"prompt": "hello " * 20, "max_tokens": 12})
    assert ok.status_code == 202


async def test_without_a_tokenizer_only_the_worker_can_check_lengths(harness: Harness) -> None:
    harness.register_model("blind", tokenizer=False, created_at=2.0)
    async with harness.client() as client:
        response = await client.post("/v1/jobs", json={"prompt": "hello " * 100, "model": "blind"})
    assert response.status_code == 202
    assert response.json()["prompt_tokens"] is None


async def test_malformed_json(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/jobs", content=b'{"prompt": ',
                                 headers={"Content-Type": "application/json"})
    assert response.status_code == 422
    detail = response.json()["detail"][0]
    assert detail["type"] == "json_invalid"
    assert detail["msg"] == "The request body is not valid JSON (Expecting value at character 11)"


@pytest.mark.parametrize(("raw", "reason"), [
    # FastAPI answered these 400 "There was an error parsing the body", naming nothing.
    (b'{"prompt": "\xff\xfe"}', "byte 0xff at position 12 is not UTF-8; encode the JSON as UTF-8"),
    (b'{"prompt": "x", "stop": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
     "it is nested too deeply"),
    (b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}",
     "a number has more than 4300 digits"),
])
async def test_json_that_does_not_decode_says_why(client: httpx.AsyncClient, raw: bytes,
                                                  reason: str) -> None:
    response = await client.post("/v1/jobs", content=raw,
                                 headers={"Content-Type": "application/json"})
    assert response.status_code == 422
    assert response.json()["detail"] == [{
        "type": "json_invalid", "loc": ["body"], "input": None,
        "msg": f"The request body is not valid JSON ({reason})", "ctx": {"error": reason}}]


async def test_deeply_nested_json_is_a_422_not_a_500(client: httpx.AsyncClient) -> None:
    # 900 levels parse, and the 422 echoes the input: rendering it overflowed the stack.
    raw = b'{"prompt": "x", "stop": ' + b"[" * 900 + b"]" * 900 + b"}"
    response = await client.post("/v1/jobs", content=raw,
                                 headers={"Content-Type": "application/json"})
    got_loc, message = _field_error(response)
    assert got_loc == ["body", "stop", 0]
    assert message == "Input should be a valid string"
    assert "..." in json.dumps(response.json()["detail"][0]["input"])


@pytest.mark.parametrize(("headers", "got"), [
    ({"Content-Type": "text/plain"}, "'text/plain'"),
    ({}, "none"),
])
async def test_body_not_sent_as_json_names_the_content_type(
        client: httpx.AsyncClient, headers: dict[str, str], got: str) -> None:
    response = await client.post("/v1/jobs", content=b'{"prompt": "x"}', headers=headers)
    loc, message = _field_error(response)
    assert loc == ["body"]
    assert message == ("The request body must be a JSON object sent with 'Content-Type: "
                       f"application/json' (got Content-Type {got})")


async def test_missing_body_says_so(client: httpx.AsyncClient) -> None:
    loc, message = _field_error(await client.post("/v1/jobs"))
    assert loc == ["body"]
    assert message == "The request body is missing: send a JSON object"


@pytest.mark.parametrize(("raw", "loc", "words"), [
    (b'{"prompt": "x", "temperature": NaN}', ["body", "temperature"], "less than or equal to 2"),
    (b'{"prompt": "x", "top_p": Infinity}', ["body", "top_p"], "less than or equal to 1"),
    (b'{"prompt": "\\ud800"}', ["body", "prompt"], "unicode string"),
    (b'{"prompt": "x", "stop": ["\\udfff"]}', ["body", "stop", 0], "unicode string"),
])
async def test_inputs_json_allows_but_text_models_cannot_take(
        client: httpx.AsyncClient, raw: bytes, loc: list[Any], words: str) -> None:
    response = await client.post("/v1/jobs", content=raw,
                                 headers={"Content-Type": "application/json"})
    got_loc, message = _field_error(response)
    assert got_loc == loc
    assert words in message


async def test_body_that_is_not_an_object(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/jobs", json=["hello"])
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body"]


async def test_chat_template_refusal_is_the_clients_error(harness: Harness) -> None:
    template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('the first message must "
                "come from the user') }}{% endif %}{{ messages[0]['content'] }}")
    harness.register_model("strict", chat_template=template, created_at=3.0)
    async with harness.client() as client:
        response = await client.post("/v1/jobs", json={
            "model": "strict", "messages": [{"role": "assistant", "content": "hi"}]})
    loc, message = _field_error(response)
    assert loc == ["body", "messages"]
    assert message == ("The model's chat template rejects these messages: the first message must "
                       "come from the user")
