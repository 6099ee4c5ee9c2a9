"""The OpenAI routes answer invalid input with 400 in OpenAI's error shape, naming the field."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from api_support import CONTEXT

pytestmark = pytest.mark.anyio

CHAT = [{"role": "user", "content": "hello"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def _error(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    return error


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"prompt": ""}, "prompt", "the prompt is empty"),
    ({"prompt": 5}, "prompt", "give text, a list of texts, a list of token ids or a list of"),
    ({"prompt": []}, "prompt", "give text, a list of texts"),
    ({}, "prompt", "Missing required parameter: 'prompt'"),
    ({"prompt": ["a", ""]}, "prompt", "prompt 1: the prompt is empty"),
    ({"prompt": [1, "a"]}, "prompt", "prompt 0: a prompt is text or a list of token ids (got int)"),
    ({"prompt": [[]]}, "prompt", "the list of token ids is empty"),
    ({"prompt": [3, -1]}, "prompt", "token ids must be non-negative ints (got -1)"),
    ({"prompt": [[3], [True]]}, "prompt", "prompt 1: token ids must be non-negative ints (got True)"),
    ({"prompt": [3, 4, 10]}, "prompt",
     "'prompt' holds token id 10, outside the vocabulary of model 'tiny' (ids 0 to 9)"),
    ({"prompt": ["x"] * 65}, "prompt", "at most 64 prompts per request are accepted (got 65)"),
    ({"prompt": ["one"], "max_tokens": 0}, "max_tokens", "0 is accepted with echo: true"),
    ({"prompt": ["one"], "max_tokens": -1, "echo": True}, "max_tokens",
     "greater than or equal to 0 (got -1)"),
    ({"prompt": "x", "max_tokens": CONTEXT + 1}, "max_tokens", f"must be at most {CONTEXT}"),
    ({"prompt": "hello " * CONTEXT}, "prompt", f"is {CONTEXT} tokens long"),
    ({"prompt": "x", "temperature": 2.1}, "temperature", "less than or equal to 2 (got 2.1)"),
    ({"prompt": "x", "top_p": 0.0}, "top_p", "greater than 0"),
    ({"prompt": "x", "top_k": -1}, "top_k", "greater than or equal to 0"),
    ({"prompt": "x", "stop": [str(i) for i in range(17)]}, "stop", "at most 16 items"),
    ({"prompt": "x", "n": 17}, "n", "at most 16 choices per prompt are accepted (got 17)"),
    ({"prompt": "x", "n": 0}, "n", "greater than or equal to 1"),
    ({"prompt": "x", "best_of": 2}, "best_of", "only best_of = 1"),
    ({"prompt": "x", "logprobs": 21}, "logprobs", "must be at most 20 (this server's max_logprobs)"),
    ({"prompt": "x", "logprobs": -1}, "logprobs", "greater than or equal to 0"),
    ({"prompt": "x", "suffix": "end"}, "suffix", "a suffix (text insertion) is not accepted"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
    ({"prompt": "x", "frequency_penalty": -2.5}, "frequency_penalty", "greater than or equal to -2"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty", "greater than or equal to 0.01"),
    ({"prompt": "x", "min_p": 1.5}, "min_p", "less than or equal to 1"),
    ({"prompt": "x", "typical_p": 0}, "typical_p", "greater than 0"),
    ({"prompt": "x", "min_tokens": -1}, "min_tokens", "greater than or equal to 0"),
    ({"prompt": "x", "max_tokens": 4, "min_tokens": 5}, "min_tokens", "must be at most max_tokens (4)"),
    ({"prompt": "x", "logit_bias": {"50256": -100}}, "logit_bias",
     "token id 50256, outside the vocabulary of model 'tiny' (ids 0 to 99)"),
    ({"prompt": "x", "logit_bias": {"cat": 1}}, "logit_bias", "keys must be token ids"),
    ({"prompt": "x", "logit_bias": {"7": 1, "07": 2}}, "logit_bias", "token id 7 is given twice"),
    ({"prompt": "x", "logit_bias": {"7": 101}}, "logit_bias.7", "less than or equal to 100"),
    ({"prompt": "x", "stop_token_ids": [3, 100]}, "stop_token_ids", "token id 100, outside"),
    ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids.0", "greater than or equal to 0"),
    ({"prompt": "x", "stream": "yes"}, "stream", "valid boolean"),
    ({"prompt": "x", "frobnicate": 1}, "frobnicate", "Unrecognized request argument supplied"),
])
async def test_completions_rejects(client: httpx.AsyncClient, body: dict[str, Any], param: str,
                                   words: str) -> None:
    error = _error(await client.post("/v1/completions", json=body))
    assert error["param"] == param
    assert words in error["message"]


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"messages": []}, "messages", "at least 1 item"),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages.0.role", "'tool'"),
    ({"messages": [{"role": "user"}]}, "messages.0", "content may be null only in an assistant"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages.0.content", "only text content parts are supported (got 'image_url')"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages.0.content", "a text content part needs a string 'text'"),
    ({"messages": [{"role": "user", "content": []}]},
     "messages.0.content", "content given as a list needs at least one text part"),
    ({"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens", "greater than"),
    ({"messages": CHAT, "max_completion_tokens": CONTEXT}, "max_completion_tokens",
     "can be at most 26"),
    ({"messages": [{"role": "user", "content": "hello " * 30}]}, "messages", "tokens long"),
    ({"messages": CHAT, "n": 17}, "n", "at most 16 choices"),
    ({"messages": CHAT, "top_logprobs": 3}, "top_logprobs", "top_logprobs needs logprobs set to true"),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "must be at most 20"),
    ({"messages": CHAT, "logprobs": 1}, "logprobs", "valid boolean"),
    ({"messages": CHAT, "tools": [{"type": "code", "function": {"name": "f"}}]}, "tools[0].type",
     "'tools[0].type' must be 'function'"),
    ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "a b"}}]},
     "tools[0].function.name", "must be 1 to 64 letters, digits"),
    ({"messages": CHAT, "tools": [TOOL, {"type": "function", "function": {
        "name": "g", "parameters": {"type": "object", "properties": {"x": {"type": "nosuch"}}}}}]},
     "tools[1].function.parameters", "does not compile to a grammar"),
    ({"messages": CHAT, "tools": [TOOL, TOOL]}, "tools", "names the function 'f' twice"),
    ({"messages": CHAT, "tool_choice": "required"}, "tool_choice", "'tool_choice' required needs 'tools'"),
    ({"messages": CHAT, "tools": [TOOL], "tool_choice": "always"}, "tool_choice",
     "must be none, auto, required"),
    ({"messages": CHAT, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice.function.name", "names 'g', which is not in 'tools'"),
    ({"messages": CHAT, "tools": [TOOL], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice", "cannot be combined"),
    ({"messages": [{"role": "tool", "content": "1"}]}, "messages.0", "a tool message needs tool_call_id"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0", "content may be null only"),
    ({"messages": CHAT, "response_format": {"type": "xml"}}, "response_format.type",
     "must be text, json_object or json_schema (or TGI's json and regex, with 'value'); got 'xml'"),
    ({"messages": CHAT, "frequency_penalty": -3}, "frequency_penalty", "greater than or equal to -2"),
    ({"messages": CHAT, "max_completion_tokens": 2, "min_tokens": 3}, "min_tokens",
     "must be at most max_completion_tokens (2)"),
    ({"messages": CHAT, "stop": 7}, "stop", "valid list"),
    ({"messages": CHAT, "seed": "1"}, "seed", "valid integer"),
    ({"messages": CHAT, "functions": []}, "functions", "deprecated form of tools, not served"),
    # Strict like every other number and flag (lax pydantic took 0.0 as false, and as 0).
    ({"messages": CHAT, "store": 0.0}, "store", "valid boolean"),
    ({"messages": CHAT, "top_logprobs": 0.0}, "top_logprobs", "valid integer"),
    ({"messages": CHAT, "presence_penalty": "0"}, "presence_penalty", "valid number"),
])
async def test_chat_rejects(client: httpx.AsyncClient, body: dict[str, Any], param: str,
                            words: str) -> None:
    error = _error(await client.post("/v1/chat/completions", json=body))
    assert error["param"] == param
    assert words in error["message"]


async def test_malformed_json_is_400(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/chat/completions", content=b"{'messages': }",
                                 headers={"Content-Type": "application/json"})
    error = _error(response)
    assert error["param"] is None
    assert error["message"].startswith("The request body is not valid JSON")


@pytest.mark.parametrize(("raw", "param", "words"), [
    (b'{"prompt": "x", "temperature": NaN}', "temperature", "(got NaN)"),
    (b'{"prompt": "\\ud800"}', "prompt", "unicode string"),
    (b"", None, "The request body is missing"),
])
async def test_inputs_json_allows_but_text_models_cannot_take(
        client: httpx.AsyncClient, raw: bytes, param: str | None, words: str) -> None:
    response = await client.post("/v1/completions", content=raw,
                                 headers={"Content-Type": "application/json"})
    error = _error(response)
    assert error["param"] == param
    assert words in error["message"]


async def test_json_that_is_not_utf8_is_400_saying_so(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/completions", content=b'{"prompt": "\xc3\x28"}',
                                 headers={"Content-Type": "application/json"})
    error = _error(response)
    assert error["param"] is None
    assert error["message"] == ("The request body is not valid JSON (byte 0xc3 at position 12 is "
                                "not UTF-8; encode the JSON as UTF-8)")


async def test_body_not_sent_as_json_is_400_naming_the_content_type(
        client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/chat/completions", content=b"{}",
                                 headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert _error(response)["message"] == (
        "The request body must be a JSON object sent with 'Content-Type: application/json' "
        "(got Content-Type 'application/x-www-form-urlencoded')")


async def test_a_model_never_served_is_404_in_openais_shape(client: httpx.AsyncClient) -> None:
    for path, body in (("/v1/completions", {"prompt": "x", "model": "gpt-4"}),
                       ("/v1/chat/completions", {"messages": CHAT, "model": "gpt-4"})):
        response = await client.post(path, json=body)
        assert response.status_code == 404, response.text
        assert response.json() == {"error": {
            "message": "The model 'gpt-4' does not exist; known models: tiny",
            "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}


async def test_unknown_model_echo_is_escaped_json(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v1/chat/completions", headers={"Content-Type": "application/json"},
        content=b'{"model": "\\ud800", "messages": [{"role": "user", "content": "x"}]}')
    assert response.status_code == 404
    assert response.json()["error"]["param"] == "model"
    assert b"\\ud800" in response.content


async def test_body_that_is_not_an_object_is_400(client: httpx.AsyncClient) -> None:
    error = _error(await client.post("/v1/completions", json=[1, 2]))
    assert error["message"].startswith("Invalid request body:")
