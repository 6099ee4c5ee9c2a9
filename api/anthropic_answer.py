"""A chat completion's answer as Anthropic's Messages API's: the whole answer as a message object
(text and tool_use blocks, the stop reason, usage), and its stream of chunks as the Messages
events: message_start, per block content_block_start / content_block_delta (text_delta,
input_json_delta) / content_block_stop, message_delta (stop reason, output tokens), message_stop.

With stop sequences the job keeps the one that ended the text (include_stop_str_in_output): the
answer cuts it off and names it, as Anthropic does; a stream holds back the text that could
still be one until the end shows whether it was."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from api.anthropic_schemas import MessagesRequest
from api.sse import typed_event

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                 "abort": "end_turn"}


def stop_of(text: str, finish_reason: str | None,
            stop_sequences: list[str]) -> tuple[str, str | None, str | None]:
    """(the text without the stop sequence that ended it, stop_reason, that stop sequence)."""
    if finish_reason == "stop":
        # Longest first: of "\n" and "\n\n" both ending the text, the longer one stopped it.
        for sequence in sorted(stop_sequences, key=len, reverse=True):
            if text.endswith(sequence):
                return text[:len(text) - len(sequence)], "stop_sequence", sequence
    return text, _STOP_REASONS.get(finish_reason or "stop", "end_turn"), None


def usage_of(chat_usage: dict[str, Any]) -> dict[str, Any]:
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"] - cached,
            "output_tokens": chat_usage["completion_tokens"],
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def message_of(body: MessagesRequest, chat_answer: dict[str, Any], message_id: str) -> dict[str, Any]:
    """A non-streamed chat.completion (one choice) as the message object."""
    choice = chat_answer["choices"][0]
    message = choice["message"]
    text, stop_reason, stop_sequence = stop_of(message.get("content") or "", choice["finish_reason"],
                                               body.stop_sequences)
    content: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    content += [_tool_use(call["id"], call["function"]["name"],
                          json.loads(call["function"]["arguments"] or "{}"))
                for call in message.get("tool_calls") or []]
    return {"id": message_id, "type": "message", "role": "assistant",
            "model": chat_answer["model"], "content": content, "stop_reason": stop_reason,
            "stop_sequence": stop_sequence, "usage": usage_of(chat_answer["usage"])}


def _tool_use(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": name, "input": arguments}


def error_event(message: str, error_type: str = "api_error") -> bytes:
    return typed_event({"type": "error", "error": {"type": error_type, "message": message}})


@dataclass(slots=True)
class MessageEvents:
    """Turns one chat choice's chunks (api/openai_stream.py) into the Messages events."""

    message_id: str
    model: str
    input_tokens: int
    stop_sequences: list[str]
    _block: int = -1  # the open content block's index (-1: none yet)
    _block_kind: str = ""  # "text" or "tool_use"
    _held: str = ""  # text that may still be (part of) the stop sequence that ends it
    _stop_reason: str | None = None
    _stop_sequence: str | None = None
    _events: list[bytes] = field(default_factory=list)

    def opening(self) -> list[bytes]:
        message: dict[str, Any] = {
            "id": self.message_id, "type": "message", "role": "assistant", "content": [],
            "model": self.model, "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0,
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}
        return [typed_event({"type": "message_start", "message": message}),
                typed_event({"type": "ping"})]

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        """The events a chunk brings (none for most chunks of a stop sequence's length)."""
        self._events = []
        if "error" in chunk:
            self._events.append(error_event(chunk["error"].get("message", "The job failed")))
            return self._events
        if chunk.get("usage") and not chunk.get("choices"):  # the last chunk: the whole usage
            self._send_text(self._take_held())
            self._close()
            self._finish(chunk["usage"])
            return self._events
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                self._text(delta["content"])
            for call in delta.get("tool_calls") or []:
                self._tool_call(call)
            if choice.get("finish_reason") is not None:
                self._end(choice["finish_reason"])
        return self._events

    def _text(self, text: str) -> None:
        self._held += text
        # All but the last characters a stop sequence could take go out now.
        keep = max((len(s) for s in self.stop_sequences), default=0)
        cut = max(len(self._held) - keep, 0)
        ready, self._held = self._held[:cut], self._held[cut:]
        self._send_text(ready)

    def _send_text(self, text: str) -> None:
        if not text:
            return
        if self._block_kind != "text":
            self._open({"type": "text", "text": ""}, "text")
        self._events.append(typed_event({
            "type": "content_block_delta", "index": self._block,
            "delta": {"type": "text_delta", "text": text}}))

    def _tool_call(self, call: dict[str, Any]) -> None:
        function = call.get("function") or {}
        if call.get("id"):  # a new call: its own block
            self._send_text(self._take_held())
            self._open(_tool_use(call["id"], function.get("name", ""), {}), "tool_use")
        if function.get("arguments"):
            self._events.append(typed_event({
                "type": "content_block_delta", "index": self._block,
                "delta": {"type": "input_json_delta", "partial_json": function["arguments"]}}))

    def _end(self, finish_reason: str) -> None:
        text, self._stop_reason, self._stop_sequence = stop_of(self._take_held(), finish_reason,
                                                               self.stop_sequences)
        self._send_text(text)

    def _take_held(self) -> str:
        held, self._held = self._held, ""
        return held

    def _open(self, block: dict[str, Any], kind: str) -> None:
        self._close()
        self._block += 1
        self._block_kind = kind
        self._events.append(typed_event({
            "type": "content_block_start", "index": self._block, "content_block": block}))

    def _close(self) -> None:
        if self._block_kind:
            self._events.append(typed_event({"type": "content_block_stop",
                                                           "index": self._block}))
            self._block_kind = ""

    def _finish(self, chat_usage: dict[str, Any]) -> None:
        # The whole usage, as the job counted it (message_start had the API's count of the prompt).
        self._events.append(typed_event({
            "type": "message_delta",
            "delta": {"stop_reason": self._stop_reason or "end_turn",
                      "stop_sequence": self._stop_sequence},
            "usage": usage_of(chat_usage)}))
        self._events.append(typed_event({"type": "message_stop"}))
