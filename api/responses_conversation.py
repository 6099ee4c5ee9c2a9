"""A Responses request as the chat it means, and a response's output as items.

Responses input items (api/responses_schemas.py normalizes them) become chat messages in
OpenAI's chat shape, which the chat route's machinery (api/openai_requests.py, the tool calling
of api/tool_calls.py) already renders: a function_call item joins the assistant message before
it as a tool call, a function_call_output item is a tool message. A stored response keeps the
chat it continued plus its own output as messages (`conversation`), so a request naming it as
previous_response_id starts from there.
"""

from __future__ import annotations

import uuid
from typing import Any


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of normalized input items, in order."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if item["type"] == "message":
            messages.append({"role": item["role"], "content": item["content"]})
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            # The calls of one assistant turn (after its text, if it wrote any) are one message.
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:  # function_call_output
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": item["output"]})
    return messages


def with_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input items as input_items lists them: each with an id (its own, or a new one) and a
    message's content as an input_text part (output_text for the assistant's)."""
    listed = []
    for item in items:
        if item["type"] == "message":
            part = "output_text" if item["role"] == "assistant" else "input_text"
            listed.append({"id": item.get("id") or new_item_id("msg"), "type": "message",
                           "role": item["role"], "status": "completed",
                           "content": [{"type": part, "text": item["content"]}]})
        else:
            prefix = "fc" if item["type"] == "function_call" else "fco"
            listed.append({**item, "id": item.get("id") or new_item_id(prefix),
                           "status": "completed"})
    return listed


def output_items(message: dict[str, Any], *, message_id: str, status: str,
                 logprobs: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """A chat answer's message as Responses output items: the text as a message (unless the
    answer is only tool calls), then each call as a function_call item."""
    items: list[dict[str, Any]] = []
    calls = message.get("tool_calls") or []
    if message.get("content") is not None or not calls:
        items.append(message_item(message_id, message.get("content") or "", status, logprobs))
    for call in calls:
        items.append(function_call_item(call["id"], call["function"]["name"],
                                        call["function"]["arguments"], "completed"))
    return items


def message_item(item_id: str, text: str, status: str,
                 logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": [part]}


def function_call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    # The item's id and the call's id differ in OpenAI's API: a function_call_output names call_id.
    return {"id": "fc_" + call_id.removeprefix("call_"), "type": "function_call", "status": status,
            "call_id": call_id, "name": name, "arguments": arguments}


def output_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages a continuation starts from."""
    return chat_messages([
        {"type": "message", "role": "assistant",
         "content": "".join(part["text"] for part in item["content"])}
        if item["type"] == "message" else item
        for item in items])
