"""The per-request edits of a step's logits before any sampling: min_tokens masking, logit_bias,
and the repetition, frequency and presence penalties, vectorized over the rows that ask for them.

vLLM's formulas and order: the min_tokens mask and the bias first, then the penalties; the
repetition penalty covers prompt and output tokens (a positive logit is divided by it, a negative
one multiplied), frequency and presence cover output tokens only (logit -= frequency * count +
presence * [count > 0]). Built only when some row of the batch needs one of them, so a batch
without penalties pays nothing.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from protocol.generation import SamplingParams


@dataclass(slots=True)
class Penalties:
    """The rows with a penalty, with their token histories padded with `vocab_size`."""

    rows: torch.Tensor  # [num_rows] int64: rows of the batch
    output_tokens: torch.Tensor  # [num_rows, max_output_len] int64
    prompt_tokens: torch.Tensor | None  # [num_rows, max_prompt_len] int64; None: no repetition penalty
    presence: torch.Tensor  # [num_rows] float32
    frequency: torch.Tensor  # [num_rows] float32
    repetition: torch.Tensor  # [num_rows] float32


@dataclass(slots=True)
class LogitsProcessing:
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) set to -inf: min_tokens
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, token ids, values)
    penalties: Penalties | None

    @classmethod
    def build(
        cls,
        params: Seq[SamplingParams],
        output_indices: Seq[int],
        token_ids: Seq[list[int]],
        num_prompt_tokens: Seq[int],
        eos_token_ids: frozenset[int],
        vocab_size: int,
        device: torch.device | str = "cpu",
    ) -> LogitsProcessing | None:
        """None when no row needs any processing (the common case)."""
        if not any(p.is_processed for p in params):
            return None
        banned_rows: list[int] = []
        banned_ids: list[int] = []
        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_values: list[float] = []
        penalty_rows: list[int] = []
        for row, (p, index) in enumerate(zip(params, output_indices)):
            # min_tokens: the token being sampled gets output index `index`; while fewer than
            # min_tokens precede it, nothing that would end the generation may be drawn.
            if index < p.min_tokens:
                stops = set(p.stop_token_ids) | (set() if p.ignore_eos else eos_token_ids)
                for token_id in sorted(stops):
                    banned_rows.append(row)
                    banned_ids.append(token_id)
            for token_id, value in p.logit_bias:
                bias_rows.append(row)
                bias_ids.append(token_id)
                bias_values.append(value)
            if p.has_penalties:
                penalty_rows.append(row)

        def ints(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        banned = (ints(banned_rows), ints(banned_ids)) if banned_rows else None
        bias = (ints(bias_rows), ints(bias_ids),
                torch.tensor(bias_values, dtype=torch.float32, device=device)) if bias_rows else None
        penalties = None
        if penalty_rows:
            outputs = [token_ids[r][num_prompt_tokens[r]:] for r in penalty_rows]
            use_repetition = any(params[r].repetition_penalty != 1.0 for r in penalty_rows)
            prompts = [token_ids[r][: num_prompt_tokens[r]] for r in penalty_rows] if use_repetition else None

            def floats(name: str) -> torch.Tensor:
                return torch.tensor([getattr(params[r], name) for r in penalty_rows],
                                    dtype=torch.float32, device=device)

            penalties = Penalties(
                rows=ints(penalty_rows),
                output_tokens=_padded(outputs, vocab_size, device),
                prompt_tokens=_padded(prompts, vocab_size, device) if prompts is not None else None,
                presence=floats("presence_penalty"),
                frequency=floats("frequency_penalty"),
                repetition=floats("repetition_penalty"),
            )
        return cls(banned, bias, penalties)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Edit `logits` ([num_rows, vocab_size] float32) in place and return it."""
        if self.banned is not None:
            logits.index_put_(self.banned, torch.tensor(float("-inf"), device=logits.device))
        if self.bias is not None:
            rows, ids, values = self.bias
            logits.index_put_((rows, ids), values, accumulate=True)
        if self.penalties is not None:
            p = self.penalties
            sub = logits.index_select(0, p.rows)  # [num_penalty_rows, vocab_size]
            vocab_size = sub.shape[1]
            # Counts over vocab_size + 1 columns: the padding id lands in the last, then dropped.
            counts = torch.zeros(sub.shape[0], vocab_size + 1, dtype=sub.dtype, device=sub.device)
            counts.scatter_add_(1, p.output_tokens, torch.ones_like(p.output_tokens, dtype=sub.dtype))
            counts = counts[:, :vocab_size]
            in_output = counts > 0
            if p.prompt_tokens is not None:
                seen = torch.zeros(sub.shape[0], vocab_size + 1, dtype=torch.bool, device=sub.device)
                seen.scatter_(1, p.prompt_tokens, True)
                seen = seen[:, :vocab_size] | in_output
                repetition = p.repetition.unsqueeze(1)
                penalized = torch.where(sub > 0, sub / repetition, sub * repetition)
                sub = torch.where(seen, penalized, sub)
            sub = sub - p.frequency.unsqueeze(1) * counts - p.presence.unsqueeze(1) * in_output
            logits.index_copy_(0, p.rows, sub)
        return logits


def _padded(rows: list[list[int]], pad: int, device: torch.device | str) -> torch.Tensor:
    width = max(1, max(len(row) for row in rows))  # at least one column: scatter needs one
    return torch.tensor([row + [pad] * (width - len(row)) for row in rows], dtype=torch.int64,
                        device=device)
