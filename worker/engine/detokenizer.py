"""Incremental detokenization of one request's output, with stop strings.

The state is a pure function of (prompt ids, output ids): replaying the outputs of a resumed
request through `step` rebuilds exactly the state that produced the text already emitted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

Decode = Callable[[list[int]], str]

# Tokens of left context decoded with the new ones, so a word's leading space comes out right.
CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


def make_decode(tokenizer: Any, skip_special_tokens: bool = True) -> Decode:
    """The cheapest faithful `ids -> text` for the tokenizer: special tokens skipped (unless
    `skip_special_tokens` is false, vLLM's field), no cleanup."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    cleanup = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
    if backend is not None and not cleanup:
        # The Rust tokenizer directly: a quarter of the Python wrapper's cost per call.
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class Detokenizer:
    def __init__(self, decode: Decode, prompt_token_ids: list[int], stop: Iterable[str] = (),
                 min_tokens: int = 0, include_stop: bool = False) -> None:
        self._decode = decode
        context_start = max(len(prompt_token_ids) - CONTEXT_TOKENS, 0)
        self._ids = list(prompt_token_ids[context_start:])
        # ids[prefix_offset:read_offset] is decoded context; ids[read_offset:] not yet emitted.
        self.prefix_offset = 0
        self.read_offset = len(self._ids)
        self.stop = tuple(stop)
        self.held = ""  # released by the decoder but maybe the start of a stop string
        # Stop strings count once the output holds min_tokens tokens (vLLM's rule), not before.
        self.min_tokens = min_tokens
        self.num_output_tokens = 0
        self.include_stop = include_stop  # vLLM's include_stop_str_in_output

    def step(self, token_id: int) -> tuple[str, bool]:
        """Take one output token; return the text it releases and whether a stop string ended it."""
        self._ids.append(token_id)
        self.num_output_tokens += 1
        prefix_text = self._decode(self._ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self._ids[self.prefix_offset :])
        # A trailing U+FFFD is a UTF-8 character still missing bytes: wait for the next token.
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return "", False
        self.prefix_offset = self.read_offset
        self.read_offset = len(self._ids)
        if len(self._ids) > 4 * CONTEXT_TOKENS:  # keep the window short; offsets move with it
            drop = self.prefix_offset
            del self._ids[:drop]
            self.prefix_offset -= drop
            self.read_offset -= drop
        return self._apply_stop(new_text[len(prefix_text) :])

    def flush(self) -> str:
        """At a finish other than a stop string: release everything still held, as decoded,
        except a last character still missing bytes (the output ended inside it, at max_tokens
        say): its U+FFFD is not text the model wrote, and vLLM and OpenAI never show it either."""
        tail = ""
        if self.read_offset < len(self._ids):
            prefix_text = self._decode(self._ids[self.prefix_offset : self.read_offset])
            tail = self._decode(self._ids[self.prefix_offset :])[len(prefix_text) :]
            tail = tail.rstrip(REPLACEMENT_CHAR)
            self.prefix_offset = self.read_offset = len(self._ids)
        text, _ = self._apply_stop(tail)
        text += self.held
        self.held = ""
        return text

    def _apply_stop(self, delta: str) -> tuple[str, bool]:
        if not self.stop or self.num_output_tokens < self.min_tokens:
            return delta, False
        text = self.held + delta
        # (where it starts, where it ends) of each stop string found; the first to start ends the
        # text (the longest of those starting there, when it is kept).
        found = [(index, index + len(stop)) for stop in self.stop if (index := text.find(stop)) >= 0]
        if found:
            self.held = ""
            start, end = min(found, key=lambda span: (span[0], -span[1]))
            return text[: end if self.include_stop else start], True
        hold = max((_overlap(text, stop) for stop in self.stop), default=0)
        self.held = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold], False


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `stop`."""
    for length in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:length]):
            return length
    return 0
