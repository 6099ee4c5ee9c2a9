"""What one engine step reports: new tokens and finishes per request, preemptions, and stats."""

from __future__ import annotations

from dataclasses import dataclass

from worker.sequence import FinishReason


@dataclass(slots=True)
class TokenDelta:
    index: int  # position in the request's output, 0-based
    token_id: int
    # The text this token releases: "" while held back (a partial UTF-8 character or the possible
    # start of a stop string); it may carry held-back text of earlier tokens.
    text: str


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    tokens: list[TokenDelta]
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int


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
