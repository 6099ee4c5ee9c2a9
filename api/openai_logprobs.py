"""Logprobs in OpenAI's shapes, from the token entries of a job's stream.

Completions (legacy): `{tokens, token_logprobs, top_logprobs, text_offset}`, where each position's
top_logprobs maps the most likely tokens and the generated one to their logprob (up to
logprobs + 1 entries, as OpenAI documents). Chat: `{content: [{token, logprob, bytes,
top_logprobs: [{token, logprob, bytes}]}]}`. Tokens are each id decoded alone (vLLM's choice), so a
token holding part of a UTF-8 character reads as U+FFFD; `bytes` are those of that string.
The values are what the worker computed (protocol.generation.TokenLogprobs says of which
distribution); this module only renames and decodes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

from protocol import StreamEntry
from protocol.generation import PromptLogprobs

TokenText = Callable[[int], str]


def token_text_of(tokenizer: Tokenizer | None) -> TokenText:
    """`id -> text`, cached per response; without a published tokenizer, vLLM's `token_id:<id>`
    spelling (its --return-tokens-as-token-ids), so a client can still tell tokens apart."""
    cache: dict[int, str] = {}

    def text(token_id: int) -> str:
        cached = cache.get(token_id)
        if cached is None:
            if tokenizer is None:
                cached = f"token_id:{token_id}"
            else:
                cached = tokenizer.decode([token_id], skip_special_tokens=False)
            cache[token_id] = cached
        return cached

    return text


@dataclass(slots=True)
class LogprobsFormatter:
    """Formats the logprobs of one choice, a batch of token entries at a time (a streamed chunk,
    or the whole answer); it keeps the running text offset across batches."""

    is_chat: bool
    token_text: TokenText
    num_top: int  # the request's count: a worker's longer list is cut to it
    text_offset: int = 0
    # vLLM's return_tokens_as_token_ids: tokens written `token_id:<id>`; text offsets then
    # advance by those strings' lengths, as vLLM's do.
    ids_as_tokens: bool = False

    def format(self, entries: Sequence[StreamEntry]) -> dict[str, Any]:
        entries = [entry for entry in entries if entry.logprobs is not None]
        if self.is_chat:
            return {"content": [self._chat_entry(entry) for entry in entries]}
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for entry in entries:
            assert entry.logprobs is not None
            token = self._written(entry.token_id)
            tokens.append(token)
            token_logprobs.append(entry.logprobs.logprob)
            top = {self._written(token_id): logprob
                   for token_id, logprob in entry.logprobs.top[: self.num_top]}
            top.setdefault(token, entry.logprobs.logprob)
            top_logprobs.append(top)
            offsets.append(self.text_offset)
            self.text_offset += len(token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}

    def format_prompt(self, prompt: PromptLogprobs) -> dict[str, Any]:
        """`echo` with logprobs (completions): the prompt's tokens in the legacy shape, the first
        with logprob and top_logprobs null (nothing precedes it), as OpenAI and vLLM answer.
        Offsets run from 0 and the completion's continue after them."""
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        offsets: list[int] = []
        offset = 0
        for token_id, entry in zip(prompt.token_ids, prompt.entries, strict=True):
            token = self._written(token_id)
            tokens.append(token)
            offsets.append(offset)
            offset += len(token)
            if entry is None:
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(entry.logprob)
            top = {self._written(top_id): logprob for top_id, logprob in entry.top[: self.num_top]}
            top.setdefault(token, entry.logprob)
            top_logprobs.append(top)
        self.text_offset = offset
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}

    def _chat_entry(self, entry: StreamEntry) -> dict[str, Any]:
        assert entry.logprobs is not None
        token = self._chat_token(entry.token_id, entry.logprobs.logprob)
        # The generated token's bytes are its text's even when it is written `token_id:<id>`
        # (so its text can be rebuilt), as vLLM's; its alternatives' are the strings written.
        token["bytes"] = list(self.token_text(entry.token_id).encode("utf-8"))
        return {**token, "top_logprobs": [self._chat_token(token_id, logprob) for token_id, logprob
                                          in entry.logprobs.top[: self.num_top]]}

    def _chat_token(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self._written(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    def _written(self, token_id: int) -> str:
        """A token as the answer names it: its text, or `token_id:<id>` (ids_as_tokens)."""
        return f"token_id:{token_id}" if self.ids_as_tokens else self.token_text(token_id)


def vllm_prompt_logprobs(prompt: PromptLogprobs | None, num_top: int,
                         token_text: TokenText) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token null (the first) or {token id: {logprob, rank,
    decoded_token}} for the token itself and the `num_top` most likely there. None when the
    job wrote none (it ended before its first token)."""
    if prompt is None:
        return None
    out: list[dict[str, dict[str, Any]] | None] = []
    for token_id, entry in zip(prompt.token_ids, prompt.entries, strict=True):
        if entry is None:
            out.append(None)
            continue
        position = {str(top_id): {"logprob": logprob, "rank": rank, "decoded_token": token_text(top_id)}
                    for rank, (top_id, logprob) in enumerate(entry.top[:num_top], start=1)}
        position[str(token_id)] = {"logprob": entry.logprob, "rank": entry.rank,
                                   "decoded_token": token_text(token_id)}
        out.append(position)
    return out
