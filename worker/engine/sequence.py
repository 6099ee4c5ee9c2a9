"""One request as the scheduler sees it: its tokens, how many are in the KV cache, its state."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from protocol.generation import FinishReason, SamplingParams


class SequenceStatus(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt, then output
    num_prompt_tokens: int
    params: SamplingParams
    seed: int  # params.seed, or one drawn at add time so seeded and unseeded share one path
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V sit in the cache
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    # Prompt tokens the prefix cache held when it was last admitted (usage's cached_tokens).
    num_cached_tokens: int = 0
    # Asked for prompt logprobs and not yet handed them out (with its first token): until then
    # every prompt position is computed, the prefix cache skipped, so none is missing.
    needs_prompt_logprobs: bool = False
    # A background request (the Batch API's tier): the first victim when the KV pool runs out.
    preempt_first: bool = False
    # params.bad_words as token sequences, tokenized once when the request is added (the sampler
    # bans a sequence's last token where the output ends with the rest).
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # vLLM's cache_salt: its prefix-cache blocks are shared only with sequences of the same salt.
    cache_salt: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
