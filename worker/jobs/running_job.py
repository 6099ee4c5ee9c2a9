"""One job in this worker's batch: its lease, its request and what it has generated so far."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from protocol.generation import TokenEntry
from protocol.messages import JobSpec, JobState
from worker.jobs.lease import Lease


@dataclass(slots=True)
class RunningJob:
    lease: Lease
    spec: JobSpec | None  # None only for a malformed job that is failed without running
    state: JobState  # as read at claim time (created/started/first-token times, preemptions)
    result_ttl: int
    failure_ttl: int
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # of the prompt, found in the engine's prefix cache
    token_ids: list[int] = field(default_factory=list)  # the whole stream: resumed + new
    texts: list[str] = field(default_factory=list)
    # Generated and not yet in the stream (the last publishes may have notified some live).
    unpublished: list[TokenEntry] = field(default_factory=list)
    # [redis-cost] Live tokens (protocol/stream_steps.py): how many of `unpublished` went to
    # subscribers already, and when the stream last held every token notified (Redis' clock, ms,
    # for the append script's window check; this worker's monotonic clock, for its own interval).
    # 0: not since this claim (its next publish writes the stream).
    num_notified: int = 0
    stream_complete_ms: int = 0
    stream_complete_at: float = 0.0
    prompt_token_ids: tuple[int, ...] = ()  # kept only for a job that asked for prompt logprobs
    # The encoded prompt logprobs (protocol.generation.PromptLogprobs) the engine handed
    # out with the first token, until they go to Redis with it ("": none asked, or already sent).
    prompt_logprobs: str = ""
    claimed_at: float = 0.0
    first_token_at: float = 0.0
    last_token_at: float = 0.0

    @property
    def job_id(self) -> str:
        return self.lease.job_id

    @property
    def is_background(self) -> bool:
        """A batch-tier job: it holds a seat only while no higher tier waits for it."""
        return self.spec is not None and self.spec.priority.is_background

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def record_live(self, live_result: int, notified: bool) -> None:
        """What an append script made of this live job's tokens: notified (live_result 1, the
        notification went out: counted), or not, the worker's live fence gone (a lease or
        stream of this worker was taken) or the live window passed (2: its stream next, where
        its own fence decides)."""
        if live_result == 1 and notified:
            self.num_notified = len(self.unpublished)
        elif live_result == 2:
            self.stream_complete_at = -math.inf

    def add_tokens(self, tokens: list[TokenEntry], now: float) -> list[float]:
        """Record new tokens; returns the inter-token latencies they close (for the histogram)."""
        gaps: list[float] = []
        for token in tokens:
            if token.index != len(self.token_ids):
                raise ValueError(f"job {self.job_id}: engine produced token index {token.index}, "
                                 f"expected {len(self.token_ids)}")
            if self.last_token_at:
                gaps.append(now - self.last_token_at)
            self.token_ids.append(token.token_id)
            self.texts.append(token.text)
            self.unpublished.append(token)
            if not self.first_token_at:
                self.first_token_at = now
            self.last_token_at = now
        return gaps
