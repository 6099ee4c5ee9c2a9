"""Capped exponential backoff with jitter: how long to wait before retrying an unreachable Redis."""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(slots=True)
class Backoff:
    """Waits of base_s, 2*base_s, 4*base_s... up to cap_s, each jittered within its upper half.

    Jitter keeps a fleet that lost Redis at the same moment from reconnecting in lockstep; the
    fixed lower half keeps a wait from collapsing to zero (a busy loop against a dead server).
    """

    base_s: float = 0.05
    cap_s: float = 2.0
    rng: random.Random = field(default_factory=random.Random)
    attempts: int = 0  # failures since the last success

    def __post_init__(self) -> None:
        if not 0 < self.base_s <= self.cap_s:
            raise ValueError(f"need 0 < base_s <= cap_s, got base_s={self.base_s}, "
                             f"cap_s={self.cap_s}")

    def ceiling(self, attempt: int) -> float:
        """The longest wait after `attempt` failures (1-based)."""
        return min(self.cap_s, self.base_s * 2.0 ** min(attempt - 1, 60))

    def next_delay(self) -> float:
        """Record one more failure; the wait before the next try."""
        self.attempts += 1
        ceiling = self.ceiling(self.attempts)
        return ceiling / 2 + self.rng.uniform(0.0, ceiling / 2)

    def reset(self) -> int:
        """A try succeeded: start again from base_s. Returns the failures it ends."""
        attempts, self.attempts = self.attempts, 0
        return attempts
