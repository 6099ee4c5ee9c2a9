"""Tool calling end to end: the official openai client and langchain-openai against the real API
and a real worker. The tiny model's weights are random: only the grammar makes its calls valid."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from tests.integration.test_api_e2e import KEY_A, ApiServer, api  # noqa: F401 (the fixture)

pytestmark = pytest.mark.slow

CITIES = ["Paris", "Rome", "Oslo"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city for the next days",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": CITIES},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time now",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS: list[Any] = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _valid_arguments(name: str, arguments: str) -> bool:
    value = json.loads(arguments)
    if name == "get_weather":
        return (set(value) == {"city", "days"} and value["city"] in CITIES
                and isinstance(value["days"], int) and 1 <= value["days"] <= 7)
    return name == "get_time" and value in ({"zone": "UTC"}, {"zone": "CET"})


def _streamed_calls(stream: Any) -> tuple[list[dict[str, Any]], str | None, str]:
    """The calls put together from tool_calls deltas, the finish reason, and the content."""
    calls: dict[int, dict[str, Any]] = {}
    reason, content = None, ""
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or delta.id
                if delta.function is not None:
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
            reason = choice.finish_reason or reason
    return [calls[i] for i in sorted(calls)], reason, content


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_calls_are_valid_streamed_or_not(api: ApiServer, tool_choice: Any) -> None:  # noqa: F811
    client = api.openai()
    for seed in range(2):
        completion = client.chat.completions.create(
            model=api.model, messages=ASK, tools=TOOLS, tool_choice=tool_choice,  # type: ignore[arg-type]
            parallel_tool_calls=False, max_tokens=300, temperature=0.8, seed=seed)
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        calls = choice.message.tool_calls or []
        assert len(calls) == 1
        call = calls[0]
        assert call.type == "function" and call.id.startswith("call_")
        if tool_choice != "required":
            assert call.function.name == "get_time"
        assert _valid_arguments(call.function.name, call.function.arguments), call

        stream = client.chat.completions.create(
            model=api.model, messages=ASK, tools=TOOLS, tool_choice=tool_choice,  # type: ignore[arg-type]
            parallel_tool_calls=False, max_tokens=300, temperature=0.8, seed=seed, stream=True)
        streamed, reason, content = _streamed_calls(stream)
        assert (reason, content) == ("tool_calls", "")
        # Same seed, same tokens: the streamed call is the one answered whole.
        assert [(c["name"], c["arguments"]) for c in streamed] == [(call.function.name, call.function.arguments)]
        assert streamed[0]["id"].startswith("call_")


def test_required_with_parallel_calls_gives_only_valid_calls(api: ApiServer) -> None:  # noqa: F811
    completion = api.openai().chat.completions.create(
        model=api.model, messages=ASK, tools=TOOLS, tool_choice="required",  # type: ignore[arg-type]
        max_tokens=400, temperature=0.8, seed=3)
    calls = completion.choices[0].message.tool_calls or []
    assert calls
    assert all(_valid_arguments(c.function.name, c.function.arguments) for c in calls)
    assert len({c.id for c in calls}) == len(calls)


def test_a_conversation_with_a_tool_result_in_the_history(api: ApiServer) -> None:  # noqa: F811
    history: list[Any] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    ]
    client = api.openai()
    answer = client.chat.completions.create(model=api.model, messages=history, tools=TOOLS,
                                            max_tokens=8, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answer.usage is not None and answer.usage.prompt_tokens > 0
    named = client.chat.completions.create(
        model=api.model, messages=history, tools=TOOLS, max_tokens=300, seed=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls = named.choices[0].message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_weather"]
    assert _valid_arguments("get_weather", calls[0].function.arguments)


def test_bad_tool_fields_are_400_naming_the_field(api: ApiServer) -> None:  # noqa: F811
    client = api.openai()
    for kwargs, param in (({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                           "tool_choice.function.name"),
                          ({"tool_choice": "required"}, "tool_choice"),
                          ({"tools": [{"type": "function", "function": {
                              "name": "f", "parameters": {"type": "frob"}}}]}, "tools[0].function.parameters")):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=api.model, messages=ASK, max_tokens=4, **kwargs)  # type: ignore[arg-type]
        assert caught.value.param == param, kwargs


def test_langchain_bind_tools_returns_tool_calls(api: ApiServer) -> None:  # noqa: F811
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(base_url=f"{api.url}/v1", api_key=KEY_A, model=api.model,
                                      max_tokens=300, temperature=0.8, seed=1, max_retries=0)
    message = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke("Weather in Oslo?")
    assert [call["name"] for call in message.tool_calls] == ["get_weather"]
    arguments = message.tool_calls[0]["args"]
    assert _valid_arguments("get_weather", json.dumps(arguments)), arguments
    assert message.tool_calls[0]["id"].startswith("call_")
