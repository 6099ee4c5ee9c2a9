"""Tool calling through the chat route with a scripted worker: what the job carries (messages or
the template's token ids, the forcing grammar) and the answer's tool_calls, whole and streamed."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from api_support import Harness, parse_sse, word_tokenizer
from rq.job import Job
from rq.serializers import JSONSerializer

from api.tool_calls import tool_calling_of, tools_system_prompt

pytestmark = pytest.mark.anyio

ASK = [{"role": "user", "content": "hello"}]
TOOL = {"type": "function", "function": {"name": "f", "description": "d",
                                         "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}
CALL_TEXT = ['<tool_call>{"name": "f", ', '"arguments": {"a": 1}}', "</tool_call>"]
# A template that renders tools itself, as Qwen's and Hermes' do.
TOOLS_TEMPLATE = ("{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t.function.name }} "
                  "{% endfor %}<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
                  "{{ m.content }}{% for c in m.tool_calls or [] %}call {{ c.function.name }} "
                  "{{ c.function.arguments.a }}{% endfor %}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _spec(harness: Harness, job_id: str) -> dict[str, Any]:
    spec: dict[str, Any] = Job.fetch(job_id, connection=harness.context.sync,
                                     serializer=JSONSerializer).args[0]
    return spec


async def test_hermes_prompt_grammar_and_parsed_answer(harness: Harness) -> None:
    harness.register_model(context=4096)
    worker = asyncio.create_task(harness.serve_next_job(CALL_TEXT))
    async with harness.client() as client:
        response = await client.post("/v1/chat/completions", json={
            "messages": ASK, "tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False})
    job_id = await worker
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    call = choice["message"]["tool_calls"][0]
    assert choice["message"]["content"] is None and call["id"].startswith("call_")
    assert (call["type"], call["function"]) == ("function", {"name": "f", "arguments": '{"a": 1}'})
    spec = _spec(harness, job_id)
    calling = tool_calling_of([TOOL], "required", False)
    assert spec["messages"] == [{"role": "system", "content": tools_system_prompt(calling.tools)}, *ASK]
    constraint = calling.constraint()
    assert constraint is not None
    assert spec["sampling"]["structured_output"] == {"kind": "grammar", "spec": constraint.spec}


async def test_a_template_that_reads_tools_renders_them_and_the_job_carries_its_tokens(
        harness: Harness) -> None:
    harness.register_model(context=4096, chat_template=TOOLS_TEMPLATE)
    worker = asyncio.create_task(harness.serve_next_job(["hello"]))
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 7}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "world"}]
    async with harness.client() as client:
        response = await client.post("/v1/chat/completions", json={"messages": history, "tools": [TOOL]})
    job_id = await worker
    assert response.json()["choices"][0]["message"] == {"role": "assistant", "content": "hello"}
    spec = _spec(harness, job_id)
    rendered = ("<|im_start|>system\nf <|im_end|>\n<|im_start|>user\nhello<|im_end|>\n"
                "<|im_start|>assistant\ncall f 7<|im_end|>\n<|im_start|>tool\nworld<|im_end|>\n"
                "<|im_start|>assistant\n")
    assert spec.get("messages") is None
    assert spec["prompt_token_ids"] == word_tokenizer().encode(rendered, add_special_tokens=False).ids
    assert spec["sampling"].get("structured_output") is None  # auto: free output


async def test_streamed_tool_calls_arrive_as_deltas(harness: Harness) -> None:
    harness.register_model(context=4096)
    worker = asyncio.create_task(harness.serve_next_job(["Sure. ", *CALL_TEXT]))
    async with harness.client() as client:
        response = await client.post("/v1/chat/completions", json={
            "messages": ASK, "tools": [TOOL], "stream": True})
    await worker
    chunks = [json.loads(e["data"]) for e in parse_sse(response.text) if e.get("data", "[DONE]") != "[DONE]"]
    deltas = [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) for c in chunks]
    call_id = deltas[2][0]["tool_calls"][0]["id"]
    assert call_id.startswith("call_")
    assert deltas == [
        ({"role": "assistant", "content": ""}, None),
        ({"content": "Sure. "}, None),
        ({"tool_calls": [{"index": 0, "id": call_id, "type": "function",
                          "function": {"name": "f", "arguments": ""}}]}, None),
        ({"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]}, None),
        ({}, "tool_calls"),
    ]


async def test_tool_choice_none_leaves_tools_out_and_the_text_alone(harness: Harness,
                                                                   client: httpx.AsyncClient) -> None:
    worker = asyncio.create_task(harness.serve_next_job(CALL_TEXT))
    response = await client.post("/v1/chat/completions", json={
        "messages": ASK, "tools": [TOOL], "tool_choice": "none"})
    job_id = await worker
    choice = response.json()["choices"][0]
    assert (choice["message"], choice["finish_reason"]) == (
        {"role": "assistant", "content": "".join(CALL_TEXT)}, "stop")
    assert _spec(harness, job_id)["messages"] == ASK
