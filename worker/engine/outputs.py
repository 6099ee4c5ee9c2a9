"""What the engine hands out: a step's plan (SchedulerOutput), a step's results per request
(StepOutput), and a whole generation's result (Completion)."""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.generation import FinishReason, TokenEntry, TokenLogprobs
from worker.engine.sequence import Sequence


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    tokens: list[TokenEntry]
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at its last admission
    # With the first token of a request that asked for prompt logprobs: one per prompt token, the
    # first None (nothing precedes it); else None.
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass(slots=True)
class PreemptedRequest:
    """A request the engine let go of (requeue_preempted=False): resume it from these tokens."""

    request_id: str
    output_token_ids: list[int]


@dataclass(slots=True)
class StepStats:
    num_seqs: int  # sequences in this step's forward
    num_scheduled_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    num_running: int
    num_waiting: int
    slot_utilisation: float  # num_running / max_num_seqs
    num_preemptions: int  # in this step
    step_time_s: float
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache, not computed


@dataclass(slots=True)
class StepOutput:
    outputs: list[RequestOutput]
    preempted: list[PreemptedRequest]
    stats: StepStats


@dataclass(slots=True)
class SchedulerOutput:
    """One step's work, in packing order (decodes first): parallel lists, one entry a sequence."""

    seqs: list[Sequence] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)  # cached before this step
    num_scheduled_tokens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    is_sampling: list[bool] = field(default_factory=list)  # catches up fully, so samples a token
    preempted: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)  # retired while scheduling
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache instead of computed

    @property
    def total_num_scheduled_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def num_sampling(self) -> int:
        return sum(self.is_sampling)


@dataclass(slots=True)
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    num_prompt_tokens: int
