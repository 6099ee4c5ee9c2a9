"""An Anthropic Messages request as the chat completion request it means, so the chat route's
checks, tool calling and job service apply unchanged: `system` becomes a system message, content
blocks become chat messages (tool_use blocks an assistant's tool_calls, tool_result blocks tool
messages), tools and tool_choice their chat shapes, and a last assistant message is continued
(Anthropic's prefill)."""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from api.anthropic_schemas import AnthropicMessage, AnthropicTool, ConversationRequest, MessagesRequest, ToolChoice
from api.errors import InvalidRequestError, describe_validation_error
from api.openai_schemas import ChatCompletionRequest

# Blocks a model without thinking can pass over: what a client sends back of an earlier turn.
_IGNORED_BLOCKS = {"thinking", "redacted_thinking"}


def chat_body_of(body: ConversationRequest) -> ChatCompletionRequest:
    """The chat request `body` means; a 400 naming the Messages field for what it cannot be."""
    if body.thinking is not None and body.thinking.get("type") != "disabled":
        raise InvalidRequestError("'thinking': extended thinking is not served; leave it out or "
                                  "send {'type': 'disabled'}", param="thinking")
    messages = _system(body.system) + [
        message for number, given in enumerate(body.messages)
        for message in _chat_messages(given, f"messages[{number}]")]
    continues = body.messages[-1].role == "assistant"
    fields: dict[str, Any] = {"model": body.model, "messages": messages,
                              "continue_final_message": continues,
                              "add_generation_prompt": not continues}
    if isinstance(body, MessagesRequest):
        fields.update(max_tokens=body.max_tokens, stream=bool(body.stream))
        if body.stream:
            fields["stream_options"] = {"include_usage": True}
        if body.stop_sequences:
            # Kept in the text, so the answer can say which one ended it (then cut it off).
            fields.update(stop=body.stop_sequences, include_stop_str_in_output=True)
        for name in ("temperature", "top_p", "top_k", "seed"):
            if getattr(body, name) is not None:
                fields[name] = getattr(body, name)
        output_format = _output_format(body)
        if output_format is not None:
            fields["response_format"] = output_format
    if body.tools:
        fields["tools"] = [_chat_tool(tool) for tool in body.tools]
    if body.tool_choice is not None:
        fields.update(_chat_tool_choice(body.tool_choice, bool(body.tools)))
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        message, _ = describe_validation_error(exc.errors())
        raise InvalidRequestError(f"'messages' do not make a valid chat: {message}",
                                  param="messages") from None


def _output_format(body: MessagesRequest) -> dict[str, Any] | None:
    """output_config.format (or the earlier output_format) as the chat's response_format."""
    config = body.output_config or {}
    unknown = sorted(set(config) - {"format", "effort"})
    if unknown:
        raise InvalidRequestError(f"'output_config' has unknown keys: {', '.join(unknown)} (format "
                                  "and effort are taken)", param=f"output_config.{unknown[0]}")
    given = config.get("format") or body.output_format
    if given is None:
        return None
    param = "output_config.format" if config.get("format") else "output_format"
    if not isinstance(given, dict) or given.get("type") != "json_schema" \
            or not isinstance(given.get("schema"), dict):
        raise InvalidRequestError(f"'{param}' must be {{'type': 'json_schema', 'schema': {{...}}}}",
                                  param=param)
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": given["schema"]}}


def _system(system: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    if system is None or system == "":
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    return [{"role": "system", "content": "".join(
        _text_of(block, f"system[{number}]") for number, block in enumerate(system))}]


def _chat_messages(message: AnthropicMessage, where: str) -> list[dict[str, Any]]:
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for number, block in enumerate(message.content):
        at = f"{where}.content[{number}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_text_of(block, at))
        elif kind == "tool_use" and message.role == "assistant":
            calls.append(_tool_call(block, at))
        elif kind == "tool_result" and message.role == "user":
            results.append(_tool_result(block, at))
        elif kind not in _IGNORED_BLOCKS:
            allowed = "text, tool_use" if message.role == "assistant" else "text, tool_result"
            raise InvalidRequestError(f"'{at}.type' must be one of {allowed} in a {message.role} "
                                      f"message (got {kind!r}; this model reads text only)",
                                      param=f"{at}.type")
    if message.role == "assistant":
        if not texts and not calls:
            return [{"role": "assistant", "content": ""}]
        return [{"role": "assistant", "content": "".join(texts) if texts else None,
                 **({"tool_calls": calls} if calls else {})}]
    # A user turn's tool results answer the calls just before it; its text follows them.
    return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])


def _text_of(block: Any, at: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        raise InvalidRequestError(f"'{at}' must be a text block {{'type': 'text', 'text': ...}}",
                                  param=at)
    return str(block["text"])


def _tool_call(block: dict[str, Any], at: str) -> dict[str, Any]:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        raise InvalidRequestError(f"'{at}' (tool_use) needs a string 'id' and 'name'", param=at)
    if not isinstance(block.get("input", {}), dict):
        raise InvalidRequestError(f"'{at}.input' must be an object", param=f"{at}.input")
    return {"id": block["id"], "type": "function", "function": {
        "name": block["name"], "arguments": json.dumps(block.get("input", {}), ensure_ascii=False)}}


def _tool_result(block: dict[str, Any], at: str) -> dict[str, Any]:
    if not isinstance(block.get("tool_use_id"), str):
        raise InvalidRequestError(f"'{at}.tool_use_id' must be the id of the tool_use it answers",
                                  param=f"{at}.tool_use_id")
    content = block.get("content", "")
    if isinstance(content, list):
        content = "".join(_text_of(part, f"{at}.content[{number}]")
                          for number, part in enumerate(content))
    elif not isinstance(content, str):
        raise InvalidRequestError(f"'{at}.content' must be text or text blocks",
                                  param=f"{at}.content")
    if block.get("is_error"):
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}


def _chat_tool(tool: AnthropicTool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: ToolChoice, has_tools: bool) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    if choice.type == "tool":
        if not choice.name:
            raise InvalidRequestError("'tool_choice.name' names the tool to call when type is "
                                      "'tool'", param="tool_choice.name")
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif has_tools:
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    elif choice.type in ("any", "tool"):
        raise InvalidRequestError(f"'tool_choice' {choice.type!r} needs 'tools'", param="tool_choice")
    return fields
