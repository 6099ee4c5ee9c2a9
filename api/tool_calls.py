"""The tool-calling fields of a chat request (`tools`, `tool_choice`, `parallel_tool_calls`), checked
and turned into what a job carries: plain chat messages and, when a call is required, a grammar.

A model whose chat template reads `tools` gets them through it (the job service renders that
prompt, see `template_messages`); for the others, tools reach the prompt through a system message
in the Hermes style (the signatures inside
<tools></tools> and the instruction to answer with <tool_call>{...}</tool_call>); earlier calls and
their results in the history become Hermes text too (<tool_call> in the assistant's turn, a
<tool_response> user turn). Every chat template can render that, so the job's messages stay plain
{role, content} pairs and the worker needs to know nothing of tools.

`tool_choice` required or a named function is enforced by a Lark grammar (llguidance, as the other
output constraints): `<tool_call>` + JSON matching {"name": const, "arguments": <its parameters>}
+ `</tool_call>`, so even a tiny model answers with a valid call. `auto` leaves the output free and
the parser (api/tool_parsers.py) picks out whatever calls the model wrote.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from api.errors import InvalidRequestError
from api.structured_output import check_compiles
from protocol import StructuredOutput, StructuredOutputKind
from protocol.closed_objects import close_objects
from protocol.generation import MAX_STRUCTURED_OUTPUT_CHARS

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True, slots=True)
class FunctionTool:
    name: str
    description: str
    parameters: dict[str, Any]  # a JSON schema of the arguments object


@dataclass(frozen=True, slots=True)
class ToolCalling:
    """What a request asked of tools: the tools offered and how the model must use them."""

    tools: tuple[FunctionTool, ...]
    choice: str  # none, auto, required, or "function" (then `function` names it)
    function: str | None = None
    parallel: bool = True

    @property
    def parses_calls(self) -> bool:
        """Whether the output is read for tool calls (not with tool_choice none)."""
        return bool(self.tools) and self.choice != "none"

    def constraint(self) -> StructuredOutput | None:
        """The grammar that forces a call (required, named), or None (auto, none)."""
        if self.choice == "required":
            return call_grammar(self.tools, parallel=self.parallel)
        if self.choice == "function":
            named = next(tool for tool in self.tools if tool.name == self.function)
            return call_grammar((named,), parallel=False)
        return None


NO_TOOLS = ToolCalling((), "none")


def tool_calling_of(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
                    parallel_tool_calls: bool | None) -> ToolCalling:
    """The checked tool fields; 400 naming the field at fault."""
    parsed = tuple(_tool(tool, number) for number, tool in enumerate(tools or []))
    names = [tool.name for tool in parsed]
    duplicate = next((name for name in names if names.count(name) > 1), None)
    if duplicate is not None:
        raise InvalidRequestError(f"'tools' names the function '{duplicate}' twice", param="tools")
    choice, function = _choice(tool_choice, names)
    return ToolCalling(parsed, choice, function, parallel=parallel_tool_calls is not False)


def _tool(tool: Any, number: int) -> FunctionTool:
    where = f"tools[{number}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise InvalidRequestError(f"'{where}.type' must be 'function' (the only kind of tool)",
                                  param=f"{where}.type")
    unknown = sorted(set(tool) - {"type", "function"})
    if unknown:
        raise InvalidRequestError(f"'{where}' has unknown keys: {', '.join(unknown)}", param=where)
    function = tool.get("function")
    if not isinstance(function, dict):
        raise InvalidRequestError(f"'{where}.function' must be an object with a 'name'",
                                  param=f"{where}.function")
    name = function.get("name")
    # OpenAI's rule for function names: letters, digits, '_' and '-', at most 64.
    if (not isinstance(name, str) or not name or len(name) > 64
            or not all(c.isascii() and (c.isalnum() or c in "_-") for c in name)):
        raise InvalidRequestError(f"'{where}.function.name' must be 1 to 64 letters, digits, '_' or "
                                  f"'-' (got {name!r})", param=f"{where}.function.name")
    description = function.get("description", "")
    if not isinstance(description, str):
        raise InvalidRequestError(f"'{where}.function.description' must be a string",
                                  param=f"{where}.function.description")
    parameters = function.get("parameters", _ANY_OBJECT)
    param = f"{where}.function.parameters"
    if not isinstance(parameters, dict):
        raise InvalidRequestError(f"'{param}' must be a JSON schema (an object)", param=param)
    # A schema llguidance cannot compile would only fail once a call is forced: refuse it now.
    check_compiles(StructuredOutput(StructuredOutputKind.JSON_SCHEMA, json.dumps(parameters)), param)
    return FunctionTool(name, description, parameters)


def _choice(tool_choice: str | dict[str, Any] | None, names: list[str]) -> tuple[str, str | None]:
    if tool_choice is None:
        return ("auto" if names else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise InvalidRequestError("'tool_choice' must be none, auto, required or "
                                      f"{{'type': 'function', 'function': {{'name': ...}}}} (got "
                                      f"{tool_choice!r})", param="tool_choice")
        if tool_choice != "none" and not names:
            raise InvalidRequestError(f"'tool_choice' {tool_choice} needs 'tools'", param="tool_choice")
        return tool_choice, None
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if tool_choice.get("type") != "function" or not isinstance(name, str):
        raise InvalidRequestError("'tool_choice' as an object must be {'type': 'function', "
                                  "'function': {'name': ...}}", param="tool_choice")
    if name not in names:
        raise InvalidRequestError(f"'tool_choice.function.name' names '{name}', which is not in "
                                  "'tools'", param="tool_choice.function.name")
    return "function", name


def call_schema(tool: FunctionTool) -> dict[str, Any]:
    """The JSON of one call of `tool`, as the Hermes format writes it: only the arguments its
    parameters name, unless they say otherwise (protocol.closed_objects)."""
    arguments = close_objects(tool.parameters)
    return {"type": "object", "properties": {"name": {"const": tool.name}, "arguments": arguments},
            "required": ["name", "arguments"], "additionalProperties": False}


def call_grammar(tools: tuple[FunctionTool, ...], *, parallel: bool) -> StructuredOutput:
    """A Lark grammar for one `<tool_call>` (of any of `tools`), or one or more with `parallel`."""
    schema: dict[str, Any] = (call_schema(tools[0]) if len(tools) == 1
                              else {"anyOf": [call_schema(t) for t in tools]})
    # Compact JSON: free whitespace would let a weak model pad a call until max_tokens.
    schema["x-guidance"] = {"whitespace_flexible": False}
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    grammar = (f"{start}\ncall: {json.dumps(CALL_OPEN)} call_json {json.dumps(CALL_CLOSE)}\n"
               f"call_json: %json {json.dumps(schema)}\n")
    if len(grammar) > MAX_STRUCTURED_OUTPUT_CHARS:
        raise InvalidRequestError(f"'tools' make a grammar over {MAX_STRUCTURED_OUTPUT_CHARS} "
                                  "characters: offer fewer or smaller tools", param="tools")
    constraint = StructuredOutput(StructuredOutputKind.GRAMMAR, grammar)
    check_compiles(constraint, "tools")
    return constraint


def tools_system_prompt(tools: tuple[FunctionTool, ...]) -> str:
    """The Hermes-style system prompt that offers `tools` to the model."""
    signatures = "\n".join(json.dumps({"type": "function", "function": {
        "name": t.name, "description": t.description, "parameters": t.parameters}}, ensure_ascii=False)
        for t in tools)
    return ("You are a function calling AI model. You are provided with function signatures within "
            "<tools></tools> XML tags. You may call one or more functions to assist with the user "
            "query. Don't make assumptions about what values to plug into functions.\n"
            f"<tools>\n{signatures}\n</tools>\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n"
            f'{CALL_OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CALL_CLOSE}')


def plain_messages(messages: list[dict[str, Any]], calling: ToolCalling) -> list[dict[str, str]]:
    """The conversation as {role, content} text messages any chat template renders: the tools in
    the system prompt (after the client's own system text), assistant tool calls as <tool_call>
    text, tool results as <tool_response> user turns."""
    out: list[dict[str, str]] = []
    for message in messages:
        role = message["role"]
        content = message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            calls = [f"{CALL_OPEN}\n{json.dumps(_history_call(call), ensure_ascii=False)}\n{CALL_CLOSE}"
                     for call in message["tool_calls"]]
            content = "\n".join(([content] if content else []) + calls)
        elif role == "tool":
            # Hermes (and Qwen's templates) put tool results in a user turn.
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": role, "content": content})
    if calling.tools and calling.choice != "none":
        prompt = tools_system_prompt(calling.tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def template_tools(calling: ToolCalling) -> list[dict[str, Any]]:
    """The tools as a chat template reads them (transformers' `tools`: OpenAI's function specs)."""
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": t.parameters}} for t in calling.tools]


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as a template that renders tools reads it: calls' arguments as objects
    (what the templates' `tojson` expects, as vLLM passes them), null content as ""."""
    out = []
    for message in messages:
        item: dict[str, Any] = {"role": message["role"], "content": message.get("content") or ""}
        if message.get("tool_calls"):
            item["tool_calls"] = [{"id": call["id"], "type": "function", "function": _history_call(call)}
                                  for call in message["tool_calls"]]
        if message.get("tool_call_id"):
            item["tool_call_id"] = message["tool_call_id"]
        out.append(item)
    return out


def _history_call(call: dict[str, Any]) -> dict[str, Any]:
    function = call["function"]
    arguments = function["arguments"]
    try:  # OpenAI sends arguments as JSON text; the model saw (and should write) an object
        arguments = json.loads(arguments)
    except json.JSONDecodeError:
        pass
    return {"name": function["name"], "arguments": arguments}
