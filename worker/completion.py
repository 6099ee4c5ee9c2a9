"""The result of `Engine.generate` for one prompt."""

from __future__ import annotations

from dataclasses import dataclass

from worker.sequence import FinishReason


@dataclass(slots=True)
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    num_prompt_tokens: int
