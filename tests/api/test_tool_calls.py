"""Tool calling's request side (checks, grammar, prompt) and the Hermes parser, whole and streamed."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from api.errors import InvalidRequestError
from api.tool_calls import NO_TOOLS, call_schema, plain_messages, tool_calling_of, tools_system_prompt
from api.tool_parsers import CallIds, HermesToolParser, chat_message, get_parser, parser_names
from protocol import StructuredOutputKind

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def test_named_choice_forces_one_call_of_that_function() -> None:
    calling = tool_calling_of([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, None)
    constraint = calling.constraint()
    assert constraint is not None and constraint.kind is StructuredOutputKind.GRAMMAR
    time_schema = {"type": "object", "properties": {"name": {"const": "get_time"},
                                                    "arguments": {"type": "object"}},
                   "required": ["name", "arguments"], "additionalProperties": False,
                   "x-guidance": {"whitespace_flexible": False}}
    assert constraint.spec == ('start: call\ncall: "<tool_call>" call_json "</tool_call>"\n'
                               f"call_json: %json {json.dumps(time_schema)}\n")


def test_required_allows_any_tool_and_several_calls_unless_parallel_is_false() -> None:
    parallel = tool_calling_of([WEATHER, TIME], "required", None).constraint()
    assert parallel is not None
    schema = {"anyOf": [call_schema(t) for t in tool_calling_of([WEATHER, TIME], None, None).tools],
              "x-guidance": {"whitespace_flexible": False}}
    assert parallel.spec == ('start: call ("\\n" call)*\ncall: "<tool_call>" call_json "</tool_call>"\n'
                             f"call_json: %json {json.dumps(schema)}\n")
    single = tool_calling_of([WEATHER, TIME], "required", False).constraint()
    assert single is not None and single.spec.startswith("start: call\n")


def test_a_call_carries_only_the_arguments_its_parameters_name_unless_they_allow_more() -> None:
    # SmolLM2 called get_weather with {"city": ..., "weather": "LA"} while the parameters' open
    # object was compiled as written (protocol.closed_objects).
    (weather,) = tool_calling_of([WEATHER], None, None).tools
    assert call_schema(weather)["properties"]["arguments"] == {
        **WEATHER["function"]["parameters"], "additionalProperties": False}
    open_parameters = {"type": "object", "properties": {"q": {}}, "additionalProperties": True}
    (search,) = tool_calling_of([{"type": "function", "function": {
        "name": "search", "parameters": open_parameters}}], None, None).tools
    assert call_schema(search)["properties"]["arguments"] == open_parameters


@pytest.mark.parametrize(("choice", "expected"), [(None, "auto"), ("auto", "auto"), ("none", "none")])
def test_auto_and_none_leave_the_output_free(choice: str | None, expected: str) -> None:
    calling = tool_calling_of([WEATHER], choice, None)
    assert (calling.choice, calling.constraint()) == (expected, None)
    assert calling.parses_calls is (expected == "auto")


def test_no_tools_means_none() -> None:
    calling = tool_calling_of(None, None, None)
    assert (calling.choice, calling.parses_calls) == ("none", False)


@pytest.mark.parametrize(("tools", "choice", "param"), [
    ([{"type": "function"}], None, "tools[0].function"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], None,
     "tools[0].function.description"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], None,
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f"}, "strict": True}], None, "tools[0]"),
    ([WEATHER], {"type": "function"}, "tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name"),
    (None, "auto", "tool_choice"),
])
def test_bad_tool_fields_name_the_field(tools: list[dict[str, Any]] | None, choice: Any, param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        tool_calling_of(tools, choice, None)
    assert caught.value.param == param


def test_messages_carry_tools_calls_and_results_as_hermes_text() -> None:
    calling = tool_calling_of([WEATHER], "auto", None)
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    assert plain_messages(history, calling) == [
        {"role": "system", "content": "Be brief.\n\n" + tools_system_prompt(calling.tools)},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant",
         "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'},
        {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"},
    ]
    assert plain_messages(history[1:2], NO_TOOLS) == [{"role": "user", "content": "Weather in Paris?"}]
    prompt = tools_system_prompt(calling.tools)
    assert f"<tools>\n{json.dumps(WEATHER)}\n</tools>" in prompt
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in prompt


def test_parser_registry() -> None:
    assert parser_names() == ["hermes"]
    assert isinstance(get_parser("hermes"), HermesToolParser)
    with pytest.raises(ValueError, match="unknown tool parser 'x'"):
        get_parser("x")


def _plain(calls: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    return [(c["type"], c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_hermes_parses_calls_and_keeps_the_text_outside() -> None:
    text = ('Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    parsed = HermesToolParser().parse(text, CallIds("job1"))
    assert parsed.content == "Let me look."
    assert _plain(parsed.tool_calls) == [("function", "get_weather", '{"city": "Paris"}'),
                                         ("function", "get_time", "{}")]
    assert all(re.fullmatch("call_[0-9a-f]{24}", c["id"]) for c in parsed.tool_calls)
    assert len({c["id"] for c in parsed.tool_calls}) == 2
    # A job's calls are named alike at every reading of its output, and unlike another job's.
    ids = [c["id"] for c in parsed.tool_calls]
    assert [c["id"] for c in HermesToolParser().parse(text, CallIds("job1")).tool_calls] == ids
    assert not {c["id"] for c in HermesToolParser().parse(text, CallIds("job2")).tool_calls} & set(ids)


def test_hermes_leaves_text_without_valid_calls_alone() -> None:
    for text in ("just words", "<tool_call>not json</tool_call>", '<tool_call>{"name": "f"'):
        parsed = HermesToolParser().parse(text, CallIds("job1"))
        assert (parsed.content, parsed.tool_calls) == (text, [])


def test_chat_message_and_finish_reason() -> None:
    parser = HermesToolParser()
    message, reason = chat_message(parser, '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>', "stop",
                                   "job1")
    assert reason == "tool_calls"
    assert message["content"] is None and _plain(message["tool_calls"]) == [("function", "f", '{"a": 1}')]
    assert message["tool_calls"][0]["id"] == CallIds("job1").next()
    assert chat_message(parser, "hi", "stop", "job1") == ({"role": "assistant", "content": "hi"}, "stop")
    assert chat_message(None, "<tool_call>{}</tool_call>", "length", "job1")[1] == "length"


def test_hermes_streams_content_then_call_deltas_whatever_the_split() -> None:
    text = 'Sure. <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\n<tool_call>{"name": "g"}</tool_call>'
    for size in (1, 3, 7, len(text)):
        stream = HermesToolParser().stream(CallIds("job1"))
        deltas = [d for i in range(0, len(text), size) for d in stream.feed(text[i:i + size])]
        deltas += stream.finish()
        content = "".join(d.get("content", "") for d in deltas)
        assert content == "Sure. "
        calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
        assert [(c["index"], c.get("type"), c["function"].get("name"), c["function"]["arguments"])
                for c in calls] == [(0, "function", "f", ""), (0, None, None, '{"a": 1}'),
                                    (1, "function", "g", ""), (1, None, None, "{}")]
        # The stream names the calls as the whole answer's parse does.
        assert [calls[0]["id"], calls[2]["id"]] == [
            c["id"] for c in HermesToolParser().parse(text, CallIds("job1")).tool_calls]
        assert "id" not in calls[1]
        assert stream.called


def test_hermes_stream_gives_back_held_text_and_unclosed_calls_as_content() -> None:
    stream = HermesToolParser().stream(CallIds("job1"))
    assert stream.feed("a <tool") == [{"content": "a "}]
    assert stream.finish() == [{"content": "<tool"}]
    stream = HermesToolParser().stream(CallIds("job1"))
    assert stream.feed('<tool_call>{"name"') == []
    assert stream.finish() == [{"content": '<tool_call>{"name"'}]
    assert not stream.called
