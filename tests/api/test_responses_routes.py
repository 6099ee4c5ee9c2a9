"""OpenAI's Responses API (/v1/responses): exact bodies and event sequences, the official client's
create, stream helper and input_items, stored responses and continuations, the chat the job
runs, and the 400s/404s. A background task plays the worker (api_support.Harness)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest
from api_support import KEY_A, KEY_B, MODEL, Harness, parse_sse
from rq.job import Job
from rq.serializers import JSONSerializer

from protocol import FinishReason, JobStatus, ModelCard, Priority
from protocol.rq_keys import RQKeys

pytestmark = pytest.mark.anyio

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}


def _openai(harness: Harness, key: str = "none") -> openai.AsyncOpenAI:
    transport = httpx.ASGITransport(app=harness.app, raise_app_exceptions=False)
    return openai.AsyncOpenAI(base_url="http://carpool.test/v1", api_key=key, max_retries=0,
                              http_client=httpx.AsyncClient(transport=transport))


def _spec(harness: Harness, job_id: str) -> dict[str, Any]:
    return Job.fetch(job_id, connection=harness.context.sync, serializer=JSONSerializer).args[0]


def _events(text: str) -> list[dict[str, Any]]:
    out = []
    for event in parse_sse(text):
        if "data" in event:
            data = json.loads(event["data"])
            assert event["event"] == data["type"]  # the SSE event name is the event's type
            out.append(data)
    return out


async def test_a_text_input_answers_a_response_object(harness: Harness,
                                                      client: httpx.AsyncClient) -> None:
    worker = asyncio.create_task(harness.serve_next_job(["Hi", " there"], FinishReason.STOP, 7))
    response = await client.post("/v1/responses", json={
        "input": "hello", "instructions": "be brief", "max_output_tokens": 5,
        "metadata": {"ticket": "42"}})
    job_id = await worker
    assert response.status_code == 200
    assert response.headers["x-carpool-job-id"] == job_id
    body = response.json()
    assert isinstance(body["created_at"], int) and isinstance(body["completed_at"], int)
    assert body == {
        "id": f"resp_{job_id}", "object": "response", "created_at": body["created_at"],
        "completed_at": body["completed_at"], "status": "completed", "background": False,
        "error": None, "incomplete_details": None, "instructions": "be brief",
        "max_output_tokens": 5, "metadata": {"ticket": "42"}, "model": MODEL,
        "output": [{"id": f"msg_{job_id}", "type": "message", "status": "completed",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Hi there", "annotations": []}]}],
        "parallel_tool_calls": True, "previous_response_id": None, "store": True,
        "temperature": 1.0, "text": {"format": {"type": "text"}}, "tool_choice": "auto",
        "tools": [], "top_logprobs": None, "top_p": 1.0, "truncation": "disabled",
        "usage": {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": 2, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": 9},
        "user": None}
    spec = _spec(harness, job_id)
    # The instructions are a system message before the input; fields left out stay out, so the
    # model's generation defaults apply to them as on chat completions.
    assert spec["messages"] == [{"role": "system", "content": "be brief"},
                                {"role": "user", "content": "hello"}]
    assert spec["sampling"]["max_tokens"] == 5


async def test_the_models_generation_config_fills_what_a_response_leaves_out(
        harness: Harness, client: httpx.AsyncClient) -> None:
    card = ModelCard(name=MODEL, max_model_len=32, eos_token="<|im_end|>", created_at=1.0,
                     generation_defaults={"temperature": 0.3, "top_p": 0.8, "max_tokens": 5})
    harness.sync.hset(harness.keys.models(), MODEL, card.to_json())
    worker = asyncio.create_task(harness.serve_next_job(["x"]))
    body = (await client.post("/v1/responses", json={"input": "hello"})).json()
    sampling = _spec(harness, await worker)["sampling"]
    assert (sampling["temperature"], sampling["top_p"], sampling["max_tokens"]) == (0.3, 0.8, 5)
    assert (body["temperature"], body["top_p"]) == (0.3, 0.8)  # what it ran with
    worker = asyncio.create_task(harness.serve_next_job(["x"]))
    await client.post("/v1/responses", json={"input": "hello", "temperature": 0.9,
                                             "max_output_tokens": 9})
    sampling = _spec(harness, await worker)["sampling"]
    assert (sampling["temperature"], sampling["top_p"], sampling["max_tokens"]) == (0.9, 0.8, 9)


async def test_vllms_sampling_extras_reach_the_job(harness: Harness,
                                                  client: httpx.AsyncClient) -> None:
    # guidellm's fixed-length Responses load sends `stop: null, ignore_eos: true`, as vLLM takes.
    worker = asyncio.create_task(harness.serve_next_job(["x"]))
    response = await client.post("/v1/responses", json={
        "input": "hello", "max_output_tokens": 4, "stop": None, "ignore_eos": True})
    sampling = _spec(harness, await worker)["sampling"]
    assert response.status_code == 200, response.text
    assert (sampling["ignore_eos"], sampling["stop"], sampling["max_tokens"]) == (True, [], 4)
    worker = asyncio.create_task(harness.serve_next_job(["x"]))
    response = await client.post("/v1/responses", json={
        "input": "hello", "top_k": 5, "min_p": 0.1, "seed": 7, "repetition_penalty": 1.2,
        "presence_penalty": 0.5, "frequency_penalty": 0.25, "stop": "END", "stop_token_ids": [3],
        "logit_bias": {"5": 1.5}, "skip_special_tokens": False, "include_stop_str_in_output": True,
        "include_reasoning": False})
    sampling = _spec(harness, await worker)["sampling"]
    assert response.status_code == 200, response.text
    assert {name: sampling[name] for name in (
        "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty",
        "stop", "stop_token_ids", "logit_bias", "skip_special_tokens",
        "include_stop_str_in_output", "ignore_eos")} == {
        "top_k": 5, "min_p": 0.1, "seed": 7, "repetition_penalty": 1.2, "presence_penalty": 0.5,
        "frequency_penalty": 0.25, "stop": ["END"], "stop_token_ids": [3],
        "logit_bias": {"5": 1.5}, "skip_special_tokens": False,
        "include_stop_str_in_output": True, "ignore_eos": False}


async def test_the_official_client_reads_output_text_and_usage(harness: Harness) -> None:
    worker = asyncio.create_task(harness.serve_next_job(["4"], FinishReason.STOP, 6))
    response = await _openai(harness).responses.create(model=MODEL, input="what is 2+2",
                                                       temperature=0, top_p=0.5)
    job_id = await worker
    assert (response.id, response.output_text, response.status) == (f"resp_{job_id}", "4", "completed")
    assert response.usage is not None and (response.usage.input_tokens, response.usage.output_tokens) == (6, 1)
    assert (response.temperature, response.top_p) == (0.0, 0.5)
    sampling = _spec(harness, job_id)["sampling"]
    assert (sampling["temperature"], sampling["top_p"]) == (0.0, 0.5)


async def test_streamed_events_in_openai_order(harness: Harness, client: httpx.AsyncClient) -> None:
    worker = asyncio.create_task(harness.serve_next_job(["a", "", "b"], FinishReason.STOP, 2))
    response = await client.post("/v1/responses", json={"input": "hello", "stream": True})
    job_id = await worker
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    events = _events(response.text)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    item_id = f"msg_{job_id}"
    created = events[0]["response"]
    assert (created["id"], created["status"], created["output"], created["usage"]) == (
        f"resp_{job_id}", "in_progress", [], None)
    done_item = {"id": item_id, "type": "message", "status": "completed", "role": "assistant",
                 "content": [{"type": "output_text", "text": "ab", "annotations": []}]}
    at = {"item_id": item_id, "output_index": 0, "content_index": 0}
    assert [{k: v for k, v in e.items() if k not in ("sequence_number", "response")}
            for e in events] == [
        {"type": "response.created"}, {"type": "response.in_progress"},
        {"type": "response.output_item.added", "output_index": 0,
         "item": {"id": item_id, "type": "message", "status": "in_progress", "role": "assistant",
                  "content": []}},
        {"type": "response.content_part.added", **at,
         "part": {"type": "output_text", "text": "", "annotations": []}},
        {"type": "response.output_text.delta", **at, "delta": "a", "logprobs": []},
        {"type": "response.output_text.delta", **at, "delta": "b", "logprobs": []},
        {"type": "response.output_text.done", **at, "text": "ab", "logprobs": []},
        {"type": "response.content_part.done", **at, "part": done_item["content"][0]},
        {"type": "response.output_item.done", "output_index": 0, "item": done_item},
        {"type": "response.completed"}]
    final = events[-1]["response"]
    assert (final["status"], final["output"], final["usage"]["output_tokens"]) == (
        "completed", [done_item], 3)
    # What the stream ended with is what is stored.
    assert (await client.get(f"/v1/responses/resp_{job_id}")).json() == final


async def test_the_clients_stream_helper_builds_the_final_response(harness: Harness) -> None:
    worker = asyncio.create_task(harness.serve_next_job(["Hel", "lo"], FinishReason.STOP, 4))
    async with _openai(harness).responses.stream(model=MODEL, input="hello") as stream:
        deltas = [event.delta async for event in stream if event.type == "response.output_text.delta"]
        final = await stream.get_final_response()
    job_id = await worker
    assert deltas == ["Hel", "lo"]
    assert (final.id, final.output_text, final.status) == (f"resp_{job_id}", "Hello", "completed")


async def test_max_output_tokens_reached_is_incomplete(harness: Harness,
                                                       client: httpx.AsyncClient) -> None:
    worker = asyncio.create_task(harness.serve_next_job(["x", "y"], FinishReason.LENGTH, 3))
    body = (await client.post("/v1/responses", json={"input": "hello", "max_output_tokens": 2})).json()
    await worker
    assert (body["status"], body["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    assert body["output"][0]["status"] == "incomplete"
    worker = asyncio.create_task(harness.serve_next_job(["x", "y"], FinishReason.LENGTH, 3))
    events = _events((await client.post("/v1/responses", json={
        "input": "hello", "max_output_tokens": 2, "stream": True})).text)
    await worker
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-2]["item"]["status"] == "incomplete"


async def test_previous_response_id_continues_the_stored_chat(harness: Harness) -> None:
    client = _openai(harness)
    worker = asyncio.create_task(harness.serve_next_job(["Hi", "!"], FinishReason.STOP, 5))
    first = await client.responses.create(model=MODEL, input="hello", instructions="first rules")
    await worker
    worker = asyncio.create_task(harness.serve_next_job(["fine"], FinishReason.STOP, 9))
    second = await client.responses.create(model=MODEL, input="how are you",
                                           previous_response_id=first.id,
                                           instructions="second rules")
    job_id = await worker
    assert second.previous_response_id == first.id
    # The earlier input and output come first; the earlier instructions do not (as OpenAI).
    assert _spec(harness, job_id)["messages"] == [
        {"role": "system", "content": "second rules"}, {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "how are you"}]
    worker = asyncio.create_task(harness.serve_next_job(["ok"], FinishReason.STOP, 9))
    await client.responses.create(model=MODEL, input="and now", previous_response_id=second.id)
    job_id = await worker
    assert _spec(harness, job_id)["messages"] == [
        {"role": "user", "content": "hello"}, {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": "how are you"}, {"role": "assistant", "content": "fine"},
        {"role": "user", "content": "and now"}]


async def test_an_output_passed_back_as_input_makes_the_same_chat(harness: Harness) -> None:
    client = _openai(harness)
    worker = asyncio.create_task(harness.serve_next_job(["Hi"], FinishReason.STOP, 5))
    first = await client.responses.create(model=MODEL, input="hello", store=False)
    await worker
    worker = asyncio.create_task(harness.serve_next_job(["ok"], FinishReason.STOP, 9))
    await client.responses.create(model=MODEL, input=[
        {"role": "user", "content": "hello"}, *[item.to_dict() for item in first.output],
        {"role": "user", "content": [{"type": "input_text", "text": "and "},
                                     {"type": "input_text", "text": "you?"}]}])
    job_id = await worker
    assert _spec(harness, job_id)["messages"] == [
        {"role": "user", "content": "hello"}, {"role": "assistant", "content": "Hi"},
        {"role": "user", "content": "and you?"}]


async def test_stored_responses_get_delete_and_input_items(keyed_harness: Harness) -> None:
    harness = keyed_harness
    client = _openai(harness, KEY_A)
    worker = asyncio.create_task(harness.serve_next_job(["Hi"], FinishReason.STOP, 5))
    response = await client.responses.create(model=MODEL, input=[
        {"role": "developer", "content": "rules"}, {"role": "user", "content": "one"},
        {"role": "assistant", "content": "two"}, {"role": "user", "content": "three", "id": "msg_mine"}])
    await worker
    assert (await client.responses.retrieve(response.id)).output_text == "Hi"
    listed = await client.responses.input_items.list(response.id)
    assert [(item.role, item.content[0].text) for item in listed.data] == [  # type: ignore[union-attr]
        ("user", "three"), ("assistant", "two"), ("user", "one"), ("developer", "rules")]
    assert listed.data[0].id == "msg_mine" and listed.has_more is False
    ids = [item.id for item in listed.data]
    page = await client.responses.input_items.list(response.id, order="asc", limit=2, after=ids[3])
    assert ([item.id for item in page.data], page.has_more) == ([ids[2], ids[1]], True)
    # Another key's response is not there for this one; deleted, it is not there at all.
    with pytest.raises(openai.NotFoundError):
        await _openai(harness, KEY_B).responses.retrieve(response.id)
    await client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError) as caught:
        await client.responses.retrieve(response.id)
    assert caught.value.code == "response_not_found"


async def test_store_false_keeps_nothing(harness: Harness, client: httpx.AsyncClient) -> None:
    worker = asyncio.create_task(harness.serve_next_job(["Hi"], FinishReason.STOP, 5))
    body = (await client.post("/v1/responses", json={"input": "hello", "store": False})).json()
    await worker
    assert body["store"] is False
    assert (await client.get(f"/v1/responses/{body['id']}")).status_code == 404
    missing = await client.post("/v1/responses", json={"input": "hi", "previous_response_id": body["id"]})
    assert missing.status_code == 404
    assert missing.json()["error"]["param"] == "previous_response_id"


async def test_function_tools_answer_function_call_items(harness: Harness,
                                                         client: httpx.AsyncClient) -> None:
    harness.register_model(context=4096)  # room for the tools' system prompt
    worker = asyncio.create_task(harness.serve_next_job([CALL], FinishReason.STOP, 20))
    body = (await client.post("/v1/responses", json={
        "input": "weather in Paris?", "tools": [WEATHER], "tool_choice": "required"})).json()
    job_id = await worker
    spec = _spec(harness, job_id)
    assert spec["sampling"]["structured_output"]["kind"] == "grammar"  # the call is forced
    [call] = body["output"]
    assert call["call_id"].startswith("call_") and call["id"] == "fc_" + call["call_id"][5:]
    assert {k: call[k] for k in ("type", "status", "name", "arguments")} == {
        "type": "function_call", "status": "completed", "name": "get_weather",
        "arguments": '{"city": "Paris"}'}
    assert body["tools"] == [WEATHER] and body["tool_choice"] == "required"
    # The call's output goes back as an item; the chat the job gets has the call and its result.
    worker = asyncio.create_task(harness.serve_next_job(["Sunny"], FinishReason.STOP, 30))
    answer = (await client.post("/v1/responses", json={
        "tools": [WEATHER], "previous_response_id": body["id"], "input": [
            {"type": "function_call_output", "call_id": call["call_id"], "output": "21 C, sun"}]})).json()
    job_id = await worker
    assert answer["output"][0]["content"][0]["text"] == "Sunny"
    messages = _spec(harness, job_id)["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert CALL.replace(" ", "") in messages[2]["content"].replace(" ", "").replace("\n", "")
    assert "21 C, sun" in messages[3]["content"]


async def test_a_streamed_function_call(harness: Harness) -> None:
    harness.register_model(context=4096)
    worker = asyncio.create_task(harness.serve_next_job(
        ["<tool_call>", '{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}', "</tool_call>"],
        FinishReason.STOP, 20))
    async with _openai(harness).responses.stream(model=MODEL, input="weather?", tools=[WEATHER]) as stream:  # type: ignore[list-item]
        kinds = [event.type async for event in stream]
        final = await stream.get_final_response()
    await worker
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done",
                     "response.completed"]
    [call] = final.output
    assert call.type == "function_call" and (call.name, json.loads(call.arguments)) == (
        "get_weather", {"city": "Oslo"})


async def test_text_format_json_schema_becomes_the_jobs_constraint(harness: Harness,
                                                                  client: httpx.AsyncClient) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    worker = asyncio.create_task(harness.serve_next_job(['{"a": 1}'], FinishReason.STOP, 5))
    body = (await client.post("/v1/responses", json={"input": "json please", "text": {
        "format": {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}}})).json()
    job_id = await worker
    constraint = _spec(harness, job_id)["sampling"]["structured_output"]
    assert constraint["kind"] == "json_schema"
    assert json.loads(constraint["spec"])["properties"] == {"a": {"type": "integer"}}
    assert body["text"]["format"]["name"] == "thing" and body["output"][0]["content"][0]["text"] == '{"a": 1}'


async def test_a_failed_job_is_a_500_or_a_response_failed_event(harness: Harness,
                                                               client: httpx.AsyncClient) -> None:
    async def fail() -> None:
        job_id = await harness.take_job()
        harness.publish_done(job_id, 0, FinishReason.ERROR, error="worker exploded")

    task = asyncio.create_task(fail())
    response = await client.post("/v1/responses", json={"input": "hello"})
    await task
    assert response.status_code == 500 and "worker exploded" in response.json()["error"]["message"]
    task = asyncio.create_task(fail())
    events = _events((await client.post("/v1/responses", json={"input": "hello", "stream": True})).text)
    await task
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["status"] == "failed"
    assert "worker exploded" in events[-1]["response"]["error"]["message"]


@pytest.mark.parametrize("stream", [True, False])
async def test_a_client_leaving_cancels_its_job(harness: Harness, stream: bool) -> None:
    from test_openai_routes import _drive_asgi, _job_id

    sent = await _drive_asgi(harness, "/v1/responses", {"input": "hello", "stream": stream},
                             "2.3", 2 if stream else 0)  # streamed: after created, in_progress
    assert harness.state(_job_id(sent)).status is JobStatus.CANCELED


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"input": "hi", "background": True, "stream": "yes"}, "stream", "boolean"),
    ({"input": "hi", "background": True, "store": False}, "background", "must be stored"),
    ({"input": [{"type": "reasoning", "id": "rs_1"}]}, "input", "'reasoning'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input", "only text parts"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input",
     "input_text needs a string 'text'"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input", "role"),
    ({"input": ""}, "input", "empty"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input", "arguments"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type", "only function tools"),
    ({"input": "hi", "tools": [{**WEATHER, "name": "bad name"}]}, "tools[0].name", "letters"),
    ({"input": "hi", "tool_choice": {"type": "allowed_tools"}, "tools": [WEATHER]}, "tool_choice", "function"),
    ({"input": "hi", "tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]},
     "tool_choice.name", "nope"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "schema"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "schema": {"type": "frob"}}}},
     "text.format.schema", "does not compile"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format.type", "yaml"),
    ({"input": "hi", "max_output_tokens": 100}, "max_output_tokens", "context length"),
    ({"input": "hi", "include": ["message.output_text.everything"]}, "include", "unknown value"),
    ({"input": "hi", "temperature": 3}, "temperature", "2"),
    ({"input": "hi", "top_k": -1}, "top_k", "0"),
    ({"input": "hi", "prompt": {"id": "pmpt_1"}}, "prompt", "not available on this server"),
    ({"input": None}, "input", "give a text or a non-empty list"),
    ({"input": "hi", "stop": [""]}, "stop.0", "at least 1 character"),
    ({"input": "hi", "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs",
     "set by the request itself"),
    ({"input": "hi", "conversation": {"id": "conv_1", "name": "x"}}, "conversation",
     "conversation's id"),
])
async def test_bad_requests_are_400_naming_the_field(harness: Harness, client: httpx.AsyncClient,
                                                    body: dict[str, Any], param: str, words: str) -> None:
    response = await client.post("/v1/responses", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert harness.sync.llen(RQKeys.queue(harness.keys.queue_name(MODEL, Priority.NORMAL))) == 0  # nothing queued


async def test_unknown_ids_are_404(client: httpx.AsyncClient) -> None:
    for method, path in (("GET", "/v1/responses/resp_nope"), ("DELETE", "/v1/responses/resp_nope"),
                         ("GET", "/v1/responses/resp_nope/input_items")):
        response = await client.request(method, path)
        assert response.status_code == 404 and response.json()["error"]["code"] == "response_not_found"


def test_input_items_become_the_chat_they_mean() -> None:
    from api.responses_conversation import chat_messages

    items = [{"type": "message", "role": "user", "content": "weather and time?"},
             {"type": "message", "role": "assistant", "content": "Checking."},
             {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": "{}"},
             {"type": "function_call", "call_id": "call_2", "name": "time", "arguments": '{"z": 1}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sun"},
             {"type": "function_call_output", "call_id": "call_2", "output": "noon"},
             {"type": "function_call", "call_id": "call_3", "name": "time", "arguments": "{}"}]
    assert chat_messages(items) == [
        {"role": "user", "content": "weather and time?"},
        # One assistant turn: its text and both calls.
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{}"}},
            {"id": "call_2", "type": "function", "function": {"name": "time", "arguments": '{"z": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sun"},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
        # After the tool results, a call is a new assistant turn.
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_3", "type": "function", "function": {"name": "time", "arguments": "{}"}}]}]
