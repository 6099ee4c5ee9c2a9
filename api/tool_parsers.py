"""Tool-call parsers: the model's output text turned into OpenAI `tool_calls`, keyed by name.

A parser reads a whole answer (`parse`) or a stream of text pieces (`stream`, which gives content
pieces and tool-call deltas as they become certain). Register another format with `register`;
the server picks one with CARPOOL_TOOL_PARSER (default "hermes").
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from api.tool_calls import CALL_CLOSE, CALL_OPEN


@dataclass(slots=True)
class CallIds:
    """The ids of one job's tool calls, in the order they come: derived from the job's id, so
    every reading of its output (the answer, its stream, a background response's replay) names
    its calls alike."""

    job_id: str
    _count: int = 0

    def next(self) -> str:
        self._count += 1
        return "call_" + hashlib.sha256(f"{self.job_id}:{self._count}".encode()).hexdigest()[:24]


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    content: str | None  # the text outside the calls (None when there is none)
    tool_calls: list[dict[str, Any]]  # OpenAI's shape: id, type, function {name, arguments}


class StreamingToolParser(Protocol):
    def feed(self, text: str) -> list[dict[str, Any]]:
        """Deltas for the next piece of output: {"content": ...} or {"tool_calls": [...]}."""

    def finish(self) -> list[dict[str, Any]]:
        """Deltas for what was held back, at the end of the output."""

    @property
    def called(self) -> bool:
        """Whether any tool call was sent."""


class ToolParser(Protocol):
    def parse(self, text: str, call_ids: CallIds) -> ParsedOutput: ...

    def stream(self, call_ids: CallIds) -> StreamingToolParser: ...


_PARSERS: dict[str, Callable[[], ToolParser]] = {}


def register(name: str, factory: Callable[[], ToolParser]) -> None:
    _PARSERS[name] = factory


def parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_parser(name: str) -> ToolParser:
    try:
        return _PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r} (known: {', '.join(parser_names())})") from None


def _call(body: str, call_ids: CallIds) -> dict[str, Any] | None:
    """One call's OpenAI shape from the JSON between the tags; None if it is not a call."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return {"id": call_ids.next(), "type": "function",
            "function": {"name": value["name"],
                         "arguments": json.dumps(arguments, ensure_ascii=False)}}


class HermesToolParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as Hermes and Qwen models write."""

    _CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)

    def parse(self, text: str, call_ids: CallIds) -> ParsedOutput:
        calls: list[dict[str, Any]] = []
        outside: list[str] = []
        position = 0
        for match in self._CALL.finditer(text):
            call = _call(match.group(1), call_ids)
            if call is None:
                continue  # not JSON of a call: leave it in the content
            outside.append(text[position:match.start()])
            calls.append(call)
            position = match.end()
        if not calls:
            return ParsedOutput(text, [])
        outside.append(text[position:])
        content = "".join(outside).strip()
        return ParsedOutput(content or None, calls)

    def stream(self, call_ids: CallIds) -> HermesStreamingParser:
        return HermesStreamingParser(call_ids)


@dataclass(slots=True)
class HermesStreamingParser:
    """Streams text outside calls as content (holding back what may start `<tool_call>`) and each
    complete call as two deltas: id, type and name (arguments ""), then the arguments."""

    call_ids: CallIds
    _buffer: str = ""
    _in_call: bool = False
    _count: int = 0
    _deltas: list[dict[str, Any]] = field(default_factory=list)

    @property
    def called(self) -> bool:
        return self._count > 0

    def feed(self, text: str) -> list[dict[str, Any]]:
        self._buffer += text
        while self._step():
            pass
        deltas, self._deltas = self._deltas, []
        return deltas

    def finish(self) -> list[dict[str, Any]]:
        # An unclosed call (cut by max_tokens) or a held-back prefix is plain text after all.
        rest = (CALL_OPEN if self._in_call else "") + self._buffer
        self._buffer, self._in_call = "", False
        if self._count and not rest.strip():
            return []
        return [{"content": rest}] if rest else []

    def _step(self) -> bool:
        if not self._in_call:
            start = self._buffer.find(CALL_OPEN)
            if start < 0:
                keep = _partial_suffix(self._buffer, CALL_OPEN)
                if self._count and not self._buffer[:len(self._buffer) - keep].strip():
                    return False  # whitespace after a call: content only if text follows it
                self._content(self._buffer[:len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
                return False
            # Whitespace between calls (or before the first) is not content worth a chunk.
            before = self._buffer[:start]
            self._content(before if before.strip() or not self._count else "")
            self._buffer, self._in_call = self._buffer[start + len(CALL_OPEN):], True
            return True
        end = self._buffer.find(CALL_CLOSE)
        if end < 0:
            return False
        body, self._buffer = self._buffer[:end], self._buffer[end + len(CALL_CLOSE):]
        self._in_call = False
        call = _call(body, self.call_ids)
        if call is None:
            self._content(CALL_OPEN + body + CALL_CLOSE)
            return True
        index, self._count = self._count, self._count + 1
        function = call["function"]
        self._deltas.append({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                             "function": {"name": function["name"], "arguments": ""}}]})
        self._deltas.append({"tool_calls": [{"index": index,
                                             "function": {"arguments": function["arguments"]}}]})
        return True

    def _content(self, text: str) -> None:
        if text:
            self._deltas.append({"content": text})


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (held back: it may become it)."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


register("hermes", HermesToolParser)


def tool_finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's finish_reason once calls were made: tool_calls where the model stopped by itself."""
    return "tool_calls" if called and reason == "stop" else reason


def chat_message(parser: ToolParser | None, text: str, reason: str | None,
                 job_id: str) -> tuple[dict[str, Any], str | None]:
    """A chat choice's message and finish_reason, with the calls `parser` finds in `text` (the
    output of job `job_id`)."""
    if parser is None:
        return {"role": "assistant", "content": text}, reason
    parsed = parser.parse(text, CallIds(job_id))
    if not parsed.tool_calls:
        return {"role": "assistant", "content": text}, reason
    return ({"role": "assistant", "content": parsed.content, "tool_calls": parsed.tool_calls},
            tool_finish_reason(reason, True))
