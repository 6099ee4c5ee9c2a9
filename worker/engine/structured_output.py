"""Structured outputs: one grammar matcher per constrained request, and each step's token mask.

llguidance compiles a request's constraint (JSON schema, regex, choice, Lark/GBNF grammar) against
the model's tokenizer into a matcher that says, before every token, which tokens keep the text
inside the grammar (a bitmask, one bit per vocabulary entry). The engine applies the mask to the
logits of the constrained rows before sampling, greedy and sampled alike, then advances each
matcher with the token sampled. Steps with no constrained row never reach this module.

A resumed request (preempted, or taken over after a crash) replays the tokens it already has
into a fresh matcher, so it continues from the same grammar state.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from protocol.generation import StructuredOutput, grammar_of

if TYPE_CHECKING:
    import llguidance

log = logging.getLogger(__name__)

DEFAULT_CACHE_SIZE = 128  # compiled grammars kept across requests
# Filling several masks in parallel (llguidance's thread pool) pays only where cores are many: on
# a small CPU box its threads would take the cores the forward runs on, so there the masks are
# filled one after another (about 0.3 ms a row for SmolLM2's vocabulary: 5 ms for 16 rows).
_MASK_THREADS = min(8, (os.cpu_count() or 1) // 4)
_PARALLEL_MIN_ROWS = 4


@dataclass(slots=True)
class GrammarBitmask:
    """The step's mask for its constrained rows: apply() before sampling."""

    rows: torch.Tensor  # [num_constrained] int64: rows of the step's logits
    bits: torch.Tensor  # [num_constrained, ceil(vocab_size / 32)] int32, bit set = token allowed

    def apply(self, logits: torch.Tensor) -> None:
        """Set every disallowed token's logit of the constrained rows to -inf, in place."""
        # logits: [num_rows, vocab_size] float32
        vocab_size = logits.shape[-1]
        bits = self.bits.to(logits.device, non_blocking=True)
        rows = self.rows.to(logits.device, non_blocking=True)
        shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
        # [n, words, 32] -> [n, words * 32]: bit j of word w is token 32 * w + j
        allowed = ((bits.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab_size].bool()
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


class StructuredOutputs:
    """The engine's matchers, by request id, and the cache of compiled grammars they start from."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int],
                 cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos_token_ids = sorted(eos_token_ids)
        self._cache_size = cache_size
        self._tokenizer: llguidance.LLTokenizer | None = None  # built at the first constraint (~1 s)
        self._executor: llguidance.LLExecutor | None = None
        self._compiled: OrderedDict[StructuredOutput, llguidance.LLMatcher] = OrderedDict()
        self._matchers: dict[str, llguidance.LLMatcher] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def add(self, request_id: str, constraint: StructuredOutput, output_token_ids: list[int]) -> None:
        """Start a matcher for a request; `output_token_ids` (a resumed request's) are replayed.
        Raises ValueError when the grammar does not compile or the tokens do not fit it."""
        matcher = self._compile(constraint).deep_copy()
        if output_token_ids and not matcher.consume_tokens(output_token_ids):
            raise ValueError(f"the {len(output_token_ids)} tokens already generated do not fit the "
                             f"structured output ({matcher.get_error()})")
        self._matchers[request_id] = matcher

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def bitmask(self, request_ids: list[str]) -> GrammarBitmask | None:
        """The mask for the rows of `request_ids` (one per sampling row) that are constrained."""
        rows = [(row, self._matchers[r]) for row, r in enumerate(request_ids) if r in self._matchers]
        if not rows:
            return None
        # llguidance.torch has these helpers, but importing it sets up torch.compile for a kernel
        # we do not use; the raw calls are the same two lines.
        num_words = (self.vocab_size + 31) // 32
        bits = torch.empty((len(rows), num_words), dtype=torch.int32)
        row_bytes = num_words * 4
        if self._executor is not None and len(rows) >= _PARALLEL_MIN_ROWS:  # in parallel, off the GIL
            self._executor.unsafe_compute_mask_ptr(
                [(matcher, i) for i, (_, matcher) in enumerate(rows)], bits.data_ptr(), row_bytes, len(rows))
        else:
            for i, (_, matcher) in enumerate(rows):
                matcher.unsafe_compute_mask_ptr(bits[i].data_ptr(), row_bytes)
        return GrammarBitmask(torch.tensor([row for row, _ in rows], dtype=torch.int64), bits)

    def advance(self, request_ids: list[str], token_ids: list[int]) -> set[str]:
        """Feed each constrained request its sampled token; return those whose grammar is complete
        (nothing but EOS may follow), which end with finish reason stop."""
        done: set[str] = set()
        for request_id, token_id in zip(request_ids, token_ids):
            matcher = self._matchers.get(request_id)
            if matcher is None:
                continue
            if not matcher.consume_token(token_id):
                # The mask allows only tokens the matcher takes, so this is a bug: end the request
                # rather than let it run on unconstrained.
                log.error("request %s: token %d rejected by its grammar: %s", request_id, token_id,
                          matcher.get_error())
                done.add(request_id)
            elif matcher.is_stopped():
                done.add(request_id)
        return done

    def _compile(self, constraint: StructuredOutput) -> llguidance.LLMatcher:
        # Imported once a constraint arrives: an engine that never sees one runs without llguidance
        # (the GPU check's offline machine has none).
        import llguidance

        compiled = self._compiled.get(constraint)
        if compiled is not None:
            self._compiled.move_to_end(constraint)
            return compiled
        compiled = llguidance.LLMatcher(self._llg_tokenizer(), grammar_of(constraint), log_level=0)
        if compiled.is_error():
            raise ValueError(f"the structured output does not compile: {compiled.get_error()}")
        self._compiled[constraint] = compiled
        if len(self._compiled) > self._cache_size:
            self._compiled.popitem(last=False)
        return compiled

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            import llguidance.hf  # imports transformers: only once a constraint arrives

            self._tokenizer = llguidance.hf.from_tokenizer(
                self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos_token_ids)
            if _MASK_THREADS >= 2:
                self._executor = llguidance.LLExecutor(num_threads=_MASK_THREADS)
        return self._tokenizer
