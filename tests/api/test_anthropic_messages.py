"""Anthropic's Messages API through the official `anthropic` client, a test playing the worker
(api_support.Harness): the message object and its stream of events (text and tool_use blocks,
stop reasons, the stop sequence that ended the text, usage), what the job is asked (system,
content blocks, tool results, prefill, tools and tool_choice as the chat route's), token
counting, keys as x-api-key, and errors in Anthropic's shape."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import anthropic
import httpx2
import pytest
from api_support import KEY_A, MODEL, Harness, make_harness
from rq.job import Job
from rq.serializers import JSONSerializer

from protocol import FinishReason

pytestmark = pytest.mark.anyio

CALL_TEXT = ['<tool_call>{"name": "get_weather", ', '"arguments": {"city": "Paris"}}', "</tool_call>"]
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}


@pytest.fixture
def harness() -> Harness:
    h = make_harness(api_keys=[KEY_A])
    h.register_model(context=4096)  # room for the tools' system prompt
    return h


def _client(harness: Harness, key: str = KEY_A) -> anthropic.AsyncAnthropic:
    # The anthropic client runs on httpx2 (its fork of httpx), ASGI transport included.
    transport = httpx2.ASGITransport(app=harness.app, raise_app_exceptions=False)
    return anthropic.AsyncAnthropic(base_url="http://carpool.test", api_key=key, max_retries=0,
                                    http_client=httpx2.AsyncClient(transport=transport))


def _spec(harness: Harness, job_id: str) -> dict[str, Any]:
    spec: dict[str, Any] = Job.fetch(job_id, connection=harness.context.sync,
                                     serializer=JSONSerializer).args[0]
    return spec


async def test_a_message_is_the_chat_answer_in_anthropics_shape(harness: Harness) -> None:
    worker = asyncio.create_task(harness.serve_next_job(["hello", " world"], prompt_tokens=7))
    message = await _client(harness).messages.create(
        model=MODEL, max_tokens=20, system="Be brief.", extra_body={"temperature": 0.5},
        messages=[{"role": "user", "content": [{"type": "text", "text": "hello"}]}])
    job_id = await worker
    assert message.model_dump(exclude_none=True) == {
        "id": f"msg_{job_id}", "type": "message", "role": "assistant", "model": MODEL,
        "content": [{"type": "text", "text": "hello world"}], "stop_reason": "end_turn",
        "usage": {"input_tokens": 7, "output_tokens": 2, "cache_creation_input_tokens": 0,
                  "cache_read_input_tokens": 0}}
    spec = _spec(harness, job_id)
    assert spec["messages"] == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "hello"}]
    assert spec["sampling"]["temperature"] == 0.5 and spec["sampling"]["max_tokens"] == 20


async def test_max_tokens_is_its_stop_reason(harness: Harness) -> None:
    worker = asyncio.create_task(harness.serve_next_job(["hello"], FinishReason.LENGTH))
    message = await _client(harness).messages.create(
        model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "hello"}])
    await worker
    assert message.stop_reason == "max_tokens"


async def test_the_stop_sequence_that_ended_the_text_is_named_and_cut_off(harness: Harness) -> None:
    worker = asyncio.create_task(harness.serve_next_job(["hello", " world", "\n\nuser"]))
    message = await _client(harness).messages.create(
        model=MODEL, max_tokens=20, stop_sequences=["user", "\n\nuser"],
        messages=[{"role": "user", "content": "hello"}])
    spec = _spec(harness, await worker)
    assert (message.content[0].text, message.stop_reason, message.stop_sequence) == (  # type: ignore[union-attr]
        "hello world", "stop_sequence", "\n\nuser")
    assert spec["sampling"]["stop"] == ["user", "\n\nuser"]
    assert spec["sampling"]["include_stop_str_in_output"] is True


async def test_a_stream_is_anthropics_events_with_the_stop_sequence_held_back(harness: Harness) -> None:
    worker = asyncio.create_task(harness.serve_next_job(["hel", "lo wor", "ld", "EN", "D"],
                                                        prompt_tokens=4))
    client = _client(harness)
    async with client.messages.stream(model=MODEL, max_tokens=20, stop_sequences=["END"],
                                      messages=[{"role": "user", "content": "hello"}]) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_message()
    job_id = await worker
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "".join(e.delta.text for e in events  # type: ignore[union-attr]
                   if e.type == "content_block_delta") == "hello world"
    assert final.id == f"msg_{job_id}"
    assert [block.model_dump() for block in final.content] == [
        {"type": "text", "text": "hello world", "citations": None}]
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "END")
    # The job's own counts, in message_delta (message_start had the API's estimate).
    assert final.usage.output_tokens == 5 and final.usage.input_tokens == 4


async def test_a_raw_stream_opens_and_closes_each_block_in_order(harness: Harness) -> None:
    harness.register_model(context=4096, created_at=2.0)
    worker = asyncio.create_task(harness.serve_next_job(["Let me look. ", *CALL_TEXT]))
    async with harness.client(KEY_A) as http:
        response = await http.post("/v1/messages", json={
            "model": MODEL, "max_tokens": 50, "stream": True, "tools": [WEATHER],
            "messages": [{"role": "user", "content": "Weather in Paris?"}]})
    await worker
    events = [line.removeprefix("event: ") for line in response.text.splitlines()
              if line.startswith("event: ")]
    assert events == ["message_start", "ping", "content_block_start", "content_block_delta",
                      "content_block_stop", "content_block_start", "content_block_delta",
                      "content_block_stop", "message_delta", "message_stop"]
    data = [json.loads(line.removeprefix("data: ")) for line in response.text.splitlines()
            if line.startswith("data: ")]
    tool_start = data[5]["content_block"]
    assert (tool_start["type"], tool_start["name"], tool_start["input"]) == ("tool_use", "get_weather", {})
    assert json.loads(data[6]["delta"]["partial_json"]) == {"city": "Paris"}
    assert data[8]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}


async def test_tool_use_and_tool_results_round_trip_as_chat_tool_calls(harness: Harness) -> None:
    client = _client(harness)
    worker = asyncio.create_task(harness.serve_next_job(CALL_TEXT))
    message = await client.messages.create(
        model=MODEL, max_tokens=50, tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "any"}, messages=[{"role": "user", "content": "Weather in Paris?"}])
    spec = _spec(harness, await worker)
    assert message.stop_reason == "tool_use"
    call = message.content[0]
    assert (call.type, call.name, call.input) == ("tool_use", "get_weather", {"city": "Paris"})  # type: ignore[union-attr]
    assert spec["sampling"]["structured_output"]["kind"] == "grammar"  # any: a call is forced
    worker = asyncio.create_task(harness.serve_next_job(["Sunny."]))
    answer = await client.messages.create(model=MODEL, max_tokens=50, tools=[WEATHER], messages=[  # type: ignore[list-item]
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Looking."},
                                          {"type": "tool_use", "id": call.id, "name": "get_weather",  # type: ignore[union-attr]
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,  # type: ignore[union-attr]
                                      "content": [{"type": "text", "text": "sunny, 21C"}]},
                                     {"type": "text", "text": "Thanks"}]}])
    spec = _spec(harness, await worker)
    assert answer.content[0].text == "Sunny."  # type: ignore[union-attr]
    rendered = json.dumps(spec["messages"])
    assert "sunny, 21C" in rendered and "Thanks" in rendered and "Looking." in rendered


async def test_messages_parse_gets_its_output_format_as_a_constraint(harness: Harness) -> None:
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str

    worker = asyncio.create_task(harness.serve_next_job(['{"name": "Rome", ', '"country": "Italy"}']))
    message = await _client(harness).messages.parse(
        model=MODEL, max_tokens=30, output_format=City,
        messages=[{"role": "user", "content": "A city in Italy, as JSON."}])
    spec = _spec(harness, await worker)
    assert message.parsed_output == City(name="Rome", country="Italy")
    constraint = spec["sampling"]["structured_output"]
    assert constraint["kind"] == "json_schema"
    assert set(json.loads(constraint["spec"])["properties"]) == {"name", "country"}


async def test_a_last_assistant_message_is_continued(harness: Harness) -> None:
    worker = asyncio.create_task(harness.serve_next_job([" world"]))
    message = await _client(harness).messages.create(
        model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hello"},
                                             {"role": "assistant", "content": "hello"}])
    spec = _spec(harness, await worker)
    assert message.content[0].text == " world"  # type: ignore[union-attr]
    assert spec["messages"][-1] == {"role": "assistant", "content": "hello"}
    assert (spec["continue_final_message"], spec["add_generation_prompt"]) == (True, False)


async def test_count_tokens_is_what_the_job_would_run_on(harness: Harness) -> None:
    request = {"model": MODEL, "system": "a", "messages": [{"role": "user", "content": "hello world"}]}
    counted = await _client(harness).messages.count_tokens(**request)  # type: ignore[arg-type]
    async with harness.client(KEY_A) as http:
        tokenized = (await http.post("/tokenize", json={"model": MODEL, "messages": [
            {"role": "system", "content": "a"}, {"role": "user", "content": "hello world"}]})).json()
    assert counted.input_tokens == tokenized["count"] > 0


async def test_a_key_may_come_as_x_api_key(harness: Harness) -> None:
    """As Anthropic's documentation and older clients send it (this client sends a bearer)."""
    worker = asyncio.create_task(harness.serve_next_job(["hi"]))
    transport = httpx2.ASGITransport(app=harness.app, raise_app_exceptions=False)
    async with httpx2.AsyncClient(transport=transport, base_url="http://carpool.test") as http:
        body = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hello"}]}
        accepted = await http.post("/v1/messages", json=body, headers={"x-api-key": KEY_A})
        refused = await http.post("/v1/messages", json=body, headers={"x-api-key": "wrong"})
    await worker
    assert accepted.status_code == 200 and accepted.json()["content"] == [{"type": "text", "text": "hi"}]
    assert refused.status_code == 401
    assert refused.json()["error"]["type"] == "authentication_error"


async def test_errors_come_in_anthropics_shape(harness: Harness) -> None:
    with pytest.raises(anthropic.AuthenticationError) as refused:
        await _client(harness, key="wrong").messages.create(
            model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hello"}])
    assert refused.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as bad:
        await _client(harness).messages.create(
            model=MODEL, max_tokens=5, extra_body={"temperature": 1.5},
            messages=[{"role": "user", "content": "hi"}])
    assert "temperature" in bad.value.message
    with pytest.raises(anthropic.NotFoundError):
        await _client(harness).messages.create(
            model="nope", max_tokens=5, messages=[{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(("body", "field"), [
    ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "x"}}]}]},
     "messages[0].content[0].type"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "content": "x"}]}]}, "messages[0].content[0].tool_use_id"),
    ({"max_tokens": 5, "thinking": {"type": "enabled", "budget_tokens": 1024},
      "messages": [{"role": "user", "content": "hi"}]}, "thinking"),
    ({"max_tokens": 5, "tool_choice": {"type": "tool"}, "tools": [WEATHER],
      "messages": [{"role": "user", "content": "hi"}]}, "tool_choice.name"),
    ({"max_tokens": 5, "messages": []}, "messages"),
    ({"max_tokens": 5, "output_config": {"format": {"type": "json_object"}},
      "messages": [{"role": "user", "content": "hi"}]}, "output_config.format"),
    ({"max_tokens": 5, "output_config": {"verbosity": "low"},
      "messages": [{"role": "user", "content": "hi"}]}, "output_config"),
])
async def test_bad_requests_are_400s_naming_the_field(harness: Harness, body: dict[str, Any],
                                                      field: str) -> None:
    async with harness.client(KEY_A) as http:
        response = await http.post("/v1/messages", json={"model": MODEL, **body})
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert field in error["error"]["message"], error


async def test_the_anthropic_client_lists_and_retrieves_models(harness: Harness) -> None:
    # /v1/models is OpenAI's route; its objects carry Anthropic's fields too (tests/api/
    # test_openai_routes.py has the exact body).
    harness.register_model("second", context=64, created_at=9.0)
    harness.add_worker("w1")
    harness.add_worker("w2", model="second")
    client = _client(harness)
    listed = [m async for m in client.models.list()]  # every page, as the client walks them
    assert [(m.id, m.type, m.display_name, m.created_at.timestamp()) for m in listed] == [
        (MODEL, "model", MODEL, 1.0), ("second", "model", "second", 9.0)]
    assert (await client.models.retrieve("second")).display_name == "second"
