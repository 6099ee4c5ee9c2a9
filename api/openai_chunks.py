"""OpenAI's streaming chunks (`text_completion` and `chat.completion.chunk`), field for field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from protocol import FinishReason


def openai_finish_reason(reason: FinishReason | None) -> str | None:
    return reason.openai_name if reason else None


def usage_dict(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclass(frozen=True, slots=True)
class ChunkWriter:
    """Builds the chunks of one streamed completion (chat or plain)."""

    is_chat: bool
    response_id: str
    created: int
    model: str
    include_usage: bool

    def opening(self) -> dict[str, Any] | None:
        """Chat streams open with the assistant's role and empty content, as OpenAI's do."""
        if not self.is_chat:
            return None
        return self._chunk([self._choice({"role": "assistant", "content": ""}, None)])

    def text(self, text: str, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        payload = {"content": text} if self.is_chat else text
        return self._chunk([self._choice(payload, None, logprobs)])

    def finish(self, reason: FinishReason | None,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        payload: dict[str, Any] | str = {} if self.is_chat else ""
        return self._chunk([self._choice(payload, openai_finish_reason(reason), logprobs)])

    def usage(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        chunk = self._chunk([])
        chunk["usage"] = usage_dict(prompt_tokens, completion_tokens)
        return chunk

    def _choice(self, payload: dict[str, Any] | str, finish_reason: str | None,
                logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        key = "delta" if self.is_chat else "text"
        return {"index": 0, key: payload, "logprobs": logprobs, "finish_reason": finish_reason}

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.response_id,
            "object": "chat.completion.chunk" if self.is_chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            chunk["usage"] = None  # OpenAI sends null on every chunk but the last when asked
        return chunk
