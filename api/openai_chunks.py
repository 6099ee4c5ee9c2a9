"""OpenAI's streaming chunks (`text_completion` and `chat.completion.chunk`), field for field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from protocol import FinishReason


def openai_finish_reason(reason: FinishReason | None) -> str | None:
    return reason.openai_name if reason else None


def usage_dict(prompt_tokens: int, completion_tokens: int,
               cached_tokens: int | None = None) -> dict[str, Any]:
    usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return usage


@dataclass(frozen=True, slots=True)
class ChunkWriter:
    """Builds the chunks of one streamed completion (chat or plain); each carries one choice,
    numbered by `index` (prompt number * n + choice number)."""

    is_chat: bool
    response_id: str
    created: int
    model: str
    include_usage: bool
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: usage so far on every chunk
    service_tier: str | None = None  # on every chunk when the request named one, as OpenAI's
    # vLLM's return_token_ids: each chunk's new token ids (`token_ids`, on its choice) and the
    # prompt's (`prompt_token_ids`: on chat's opening chunk, on a completion's first choice chunk).
    return_token_ids: bool = False
    # vLLM's stream_interval: a choice's text goes out every this many tokens (its first token
    # and its end at once), fewer chunks for a client that reads many streams.
    stream_interval: int = 1

    def opening(self, index: int = 0, usage: dict[str, Any] | None = None,
                prompt_token_ids: list[int] | None = None) -> dict[str, Any] | None:
        """Chat streams open with the assistant's role and empty content, as OpenAI's do."""
        if not self.is_chat:
            return None
        chunk = self._chunk([self._choice(index, {"role": "assistant", "content": ""}, None)],
                            usage)
        if self.return_token_ids:
            chunk["prompt_token_ids"] = prompt_token_ids
        return chunk

    def echo(self, text: str, index: int = 0, usage: dict[str, Any] | None = None,
             logprobs: dict[str, Any] | None = None,
             prompt_token_ids: list[int] | None = None) -> dict[str, Any]:
        """The echo's chunk: no generated token is in it, so a completion's token_ids are empty
        there, and chat's echo chunk has none (as vLLM's)."""
        return self.text(text, index, usage, logprobs, None if self.is_chat else [],
                         prompt_token_ids)

    def text(self, text: str, index: int = 0, usage: dict[str, Any] | None = None,
             logprobs: dict[str, Any] | None = None, token_ids: list[int] | None = None,
             prompt_token_ids: list[int] | None = None) -> dict[str, Any]:
        payload = {"content": text} if self.is_chat else text
        return self._chunk([self._choice(index, payload, None, logprobs, token_ids,
                                         prompt_token_ids)], usage)

    def delta(self, delta: dict[str, Any], index: int = 0, usage: dict[str, Any] | None = None,
              logprobs: dict[str, Any] | None = None,
              token_ids: list[int] | None = None) -> dict[str, Any]:
        """A chat chunk with any delta: content, or tool_calls (api/tool_parsers.py)."""
        return self._chunk([self._choice(index, delta, None, logprobs, token_ids)], usage)

    def finish(self, reason: FinishReason | None, index: int = 0,
               usage: dict[str, Any] | None = None,
               logprobs: dict[str, Any] | None = None,
               reason_name: str | None = None, token_ids: list[int] | None = None,
               prompt_token_ids: list[int] | None = None) -> dict[str, Any]:
        """The choice's last chunk; `reason_name` overrides the reason's name (tool_calls)."""
        payload: dict[str, Any] | str = {} if self.is_chat else ""
        name = reason_name or openai_finish_reason(reason)
        return self._chunk([self._choice(index, payload, name, logprobs, token_ids,
                                         prompt_token_ids)], usage)

    def usage(self, prompt_tokens: int, completion_tokens: int,
              cached_tokens: int | None = None) -> dict[str, Any]:
        chunk = self._chunk([])
        chunk["usage"] = usage_dict(prompt_tokens, completion_tokens, cached_tokens)
        return chunk

    def _choice(self, index: int, payload: dict[str, Any] | str, finish_reason: str | None,
                logprobs: dict[str, Any] | None = None, token_ids: list[int] | None = None,
                prompt_token_ids: list[int] | None = None) -> dict[str, Any]:
        key = "delta" if self.is_chat else "text"
        choice: dict[str, Any] = {"index": index, key: payload, "logprobs": logprobs,
                                  "finish_reason": finish_reason}
        if self.return_token_ids and not self.is_chat:
            choice["prompt_token_ids"] = prompt_token_ids  # null after the first, as vLLM's
        if self.return_token_ids and token_ids is not None:
            choice["token_ids"] = token_ids
        return choice

    def _chunk(self, choices: list[dict[str, Any]],
               usage: dict[str, Any] | None = None) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.response_id,
            "object": "chat.completion.chunk" if self.is_chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.service_tier is not None:
            chunk["service_tier"] = self.service_tier
        if self.include_usage:
            # OpenAI sends null on every chunk but the last when asked; vLLM's
            # continuous_usage_stats puts the usage so far on each one.
            chunk["usage"] = usage if self.continuous_usage else None
        return chunk
