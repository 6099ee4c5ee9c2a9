"""A chat completion's answer as the Responses API's: the whole answer as a response object, and
its stream of chunks as the Responses events (`event:` and `data:` lines, numbered).

The events follow OpenAI's order, which the openai client's stream helper checks: response.created
and response.in_progress; per output item output_item.added, then for the message
content_part.added, output_text.delta..., output_text.done, content_part.done, and for a
function call function_call_arguments.delta..., function_call_arguments.done; output_item.done;
last response.completed (response.incomplete when cut by max_output_tokens or cancelled,
response.failed when the job failed). An item's ids are the same in every event that names it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from api.responses_conversation import function_call_item, message_item, output_items

# Chat finish reasons as a response's status and incomplete_details.
_STATUS = {"stop": ("completed", None), "tool_calls": ("completed", None),
           "length": ("incomplete", {"reason": "max_output_tokens"}),
           "abort": ("cancelled", None)}
_FINAL_EVENT = {"completed": "response.completed", "incomplete": "response.incomplete",
                "cancelled": "response.incomplete", "failed": "response.failed"}


def usage_of(chat_usage: dict[str, Any]) -> dict[str, Any]:
    """Chat usage in the Responses API's names."""
    details = chat_usage.get("prompt_tokens_details") or {}
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": details.get("cached_tokens", 0)},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


def finished(response: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
    """The response with the status its finish reason means, and its end time."""
    status, details = _STATUS.get(finish_reason or "stop", ("completed", None))
    return {**response, "status": status, "incomplete_details": details,
            "completed_at": int(time.time())}


def response_of(base: dict[str, Any], chat_answer: dict[str, Any], message_id: str,
                with_logprobs: bool) -> dict[str, Any]:
    """A non-streamed chat.completion (n = 1) as the response object `base` describes."""
    choice = chat_answer["choices"][0]
    response = finished(base, choice["finish_reason"])
    logprobs = None
    if with_logprobs:
        logprobs = (choice.get("logprobs") or {}).get("content") or []
    item_status = "incomplete" if response["status"] != "completed" else "completed"
    response["output"] = output_items(choice["message"], message_id=message_id,
                                      status=item_status, logprobs=logprobs)
    response["usage"] = usage_of(chat_answer["usage"])
    return response


@dataclass(slots=True)
class _OpenItem:
    output_index: int
    item: dict[str, Any]  # as output_item.added sent it
    text: list[str] = field(default_factory=list)  # a message's text or a call's arguments


@dataclass(slots=True)
class ResponseEvents:
    """Turns the chunks of one streamed chat completion (n = 1, with include_usage) into the
    Responses events of `response` (the object as created: status in_progress, no output)."""

    response: dict[str, Any]
    message_id: str
    with_logprobs: bool
    _sequence: int = 0
    _output: list[dict[str, Any]] = field(default_factory=list)  # the items done
    _open: _OpenItem | None = None
    _logprobs: list[dict[str, Any]] = field(default_factory=list)
    _finish_reason: str | None = None
    _usage: dict[str, Any] | None = None
    _error: dict[str, Any] | None = None

    def start(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self.response),
                self._event("response.in_progress", response=self.response)]

    def chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The events one chat chunk means (none for the opening chunk or the usage's)."""
        if "error" in chunk:
            self._error = {"code": chunk["error"].get("code") or "server_error",
                           "message": chunk["error"]["message"]}
            return []
        if chunk.get("usage") is not None and not chunk["choices"]:
            self._usage = usage_of(chunk["usage"])
            return []
        events: list[dict[str, Any]] = []
        for choice in chunk["choices"]:
            logprobs = (choice.get("logprobs") or {}).get("content") or []
            self._logprobs.extend(logprobs)
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._text(delta["content"], logprobs)
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
            if choice.get("finish_reason") is not None:
                self._finish_reason = choice["finish_reason"]
        return events

    def end(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The closing events and the final response object (what a stored response keeps)."""
        if self._error is not None:
            events = self._close("incomplete")
            response = {**self.response, "status": "failed", "error": self._error,
                        "output": list(self._output), "completed_at": int(time.time())}
            return events + [self._event("response.failed", response=response)], response
        response = finished(self.response, self._finish_reason)
        item_status = "completed" if response["status"] == "completed" else "incomplete"
        events = []
        if not self._output and self._open is None:  # nothing generated: an empty message
            events += self._open_message()
        events += self._close(item_status)
        response["output"] = list(self._output)
        response["usage"] = self._usage
        return events + [self._event(_FINAL_EVENT[response["status"]], response=response)], response

    def _text(self, text: str, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open is None or self._open.item["type"] != "message":
            events += self._close("completed") + self._open_message()
        assert self._open is not None
        self._open.text.append(text)
        events.append(self._event("response.output_text.delta", item_id=self.message_id,
                                  output_index=self._open.output_index, content_index=0,
                                  delta=text, logprobs=logprobs))
        return events

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if "id" in call:  # a new call: its id and name come first (api/tool_parsers.py)
            events += self._close("completed")
            item = function_call_item(call["id"], call["function"]["name"], "", "in_progress")
            self._open = _OpenItem(len(self._output), item)
            events.append(self._event("response.output_item.added",
                                      output_index=self._open.output_index, item=item))
        arguments = (call.get("function") or {}).get("arguments")
        if arguments and self._open is not None:
            self._open.text.append(arguments)
            events.append(self._event("response.function_call_arguments.delta",
                                      item_id=self._open.item["id"],
                                      output_index=self._open.output_index, delta=arguments))
        return events

    def _open_message(self) -> list[dict[str, Any]]:
        item = {**message_item(self.message_id, "", "in_progress", None), "content": []}
        self._open = _OpenItem(len(self._output), item)
        part = {"type": "output_text", "text": "", "annotations": []}
        if self.with_logprobs:
            part["logprobs"] = []
        return [self._event("response.output_item.added", output_index=self._open.output_index,
                            item=item),
                self._event("response.content_part.added", item_id=self.message_id,
                            output_index=self._open.output_index, content_index=0, part=part)]

    def _close(self, status: str) -> list[dict[str, Any]]:
        """The events that end the item being written, which joins the output."""
        if self._open is None:
            return []
        opened, self._open = self._open, None
        text = "".join(opened.text)
        index = opened.output_index
        if opened.item["type"] == "message":
            logprobs = self._logprobs if self.with_logprobs else None
            done = message_item(self.message_id, text, status, logprobs)
            part = done["content"][0]
            events = [self._event("response.output_text.done", item_id=self.message_id,
                                  output_index=index, content_index=0, text=text,
                                  logprobs=logprobs or []),
                      self._event("response.content_part.done", item_id=self.message_id,
                                  output_index=index, content_index=0, part=part)]
        else:
            done = {**opened.item, "arguments": text, "status": "completed"}
            events = [self._event("response.function_call_arguments.done", item_id=done["id"],
                                  output_index=index, name=done["name"], arguments=text)]
        self._output.append(done)
        return events + [self._event("response.output_item.done", output_index=index, item=done)]

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event
