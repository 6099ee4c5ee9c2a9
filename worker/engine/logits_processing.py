"""The per-request edits of a step's logits before any sampling: the allowed_token_ids whitelist,
bad_words, min_tokens masking, logit_bias, and the repetition, frequency and presence penalties,
vectorized over the rows that ask for them.

vLLM's formulas and order: the allowed_token_ids mask (every other token -inf), then the bad-words
ban (a bad word's last token is -inf where the output so far ends with the word's other tokens),
the min_tokens mask and the bias, then the penalties; the
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
class AllowedTokens:
    """The rows with an allowed_token_ids whitelist: each one's allowed ids, flattened."""

    rows: torch.Tensor  # [num_rows] int64: rows of the batch
    entry_rows: torch.Tensor  # [num_ids] int64: the index into `rows` each id belongs to
    token_ids: torch.Tensor  # [num_ids] int64


@dataclass(slots=True)
class LogitsProcessing:
    # (rows, token ids) set to -inf: bad words' last tokens and min_tokens' stops
    banned: tuple[torch.Tensor, torch.Tensor] | None
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, token ids, values)
    penalties: Penalties | None
    allowed: AllowedTokens | None = None

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
        bad_words_token_ids: Seq[Seq[tuple[int, ...]]] = (),
    ) -> LogitsProcessing | None:
        """None when no row needs any processing (the common case). `bad_words_token_ids`: each
        row's bad words as token sequences (the engine tokenizes them once per request); read
        only for rows with bad_words."""
        if not any(p.is_processed for p in params):
            return None
        banned_rows: list[int] = []
        banned_ids: list[int] = []
        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_values: list[float] = []
        penalty_rows: list[int] = []
        for row, (p, index) in enumerate(zip(params, output_indices)):
            if p.bad_words:
                for token_id in _bad_word_bans(bad_words_token_ids[row], token_ids[row],
                                               num_prompt_tokens[row]):
                    banned_rows.append(row)
                    banned_ids.append(token_id)
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
        return cls(banned, bias, penalties, _allowed_tokens(params, device))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Edit `logits` ([num_rows, vocab_size] float32) in place and return it."""
        if self.allowed is not None:  # first, as in vLLM: no bias or penalty revives the rest
            a = self.allowed
            keep = torch.zeros(a.rows.shape[0], logits.shape[1], dtype=torch.bool, device=logits.device)
            keep[a.entry_rows, a.token_ids] = True
            sub = logits.index_select(0, a.rows).masked_fill_(~keep, float("-inf"))
            logits.index_copy_(0, a.rows, sub)
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


def _allowed_tokens(params: Seq[SamplingParams], device: torch.device | str) -> AllowedTokens | None:
    rows = [row for row, p in enumerate(params) if p.allowed_token_ids is not None]
    if not rows:
        return None
    entry_rows: list[int] = []
    token_ids: list[int] = []
    for entry, row in enumerate(rows):
        allowed = params[row].allowed_token_ids or ()
        entry_rows += [entry] * len(allowed)
        token_ids += allowed
    return AllowedTokens(torch.tensor(rows, dtype=torch.int64, device=device),
                         torch.tensor(entry_rows, dtype=torch.int64, device=device),
                         torch.tensor(token_ids, dtype=torch.int64, device=device))


def _bad_word_bans(bad_words: Seq[tuple[int, ...]], tokens: list[int], num_prompt_tokens: int) -> list[int]:
    """The last tokens of the bad words that the next token would complete: those whose other
    tokens end the output so far (the prompt never counts, as in vLLM). A one-token bad word is
    always banned."""
    num_output = len(tokens) - num_prompt_tokens
    bans = []
    for word in bad_words:
        prefix_length = len(word) - 1
        if prefix_length > num_output:
            continue
        if tuple(tokens[len(tokens) - prefix_length:]) == word[:-1]:
            bans.append(word[-1])
    return bans


def _padded(rows: list[list[int]], pad: int, device: torch.device | str) -> torch.Tensor:
    width = max(1, max(len(row) for row in rows))  # at least one column: scatter needs one
    return torch.tensor([row + [pad] * (width - len(row)) for row in rows], dtype=torch.int64,
                        device=device)
