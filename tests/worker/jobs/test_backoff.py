"""Retry waits for an unreachable Redis: doubling from the base to the cap, jittered, reset."""

from __future__ import annotations

import random

import pytest

from worker.jobs.backoff import Backoff


def test_waits_double_up_to_the_cap_each_jittered_in_its_upper_half() -> None:
    backoff = Backoff(base_s=0.1, cap_s=1.0, rng=random.Random(0))
    ceilings = [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]
    delays = [backoff.next_delay() for _ in ceilings]
    for ceiling, delay in zip(ceilings, delays):
        assert ceiling / 2 <= delay <= ceiling
    assert backoff.attempts == len(ceilings)
    assert len(set(delays)) == len(delays)  # jittered: no two workers retry in lockstep


def test_a_success_starts_again_from_the_base() -> None:
    backoff = Backoff(base_s=0.1, cap_s=1.0, rng=random.Random(1))
    for _ in range(5):
        backoff.next_delay()
    assert backoff.reset() == 5
    assert backoff.attempts == 0 and backoff.next_delay() <= 0.1


def test_a_long_outage_stays_at_the_cap() -> None:
    backoff = Backoff(base_s=0.05, cap_s=2.0, rng=random.Random(2))
    delays = [backoff.next_delay() for _ in range(2000)]
    assert max(delays) <= 2.0 and min(delays[-100:]) >= 1.0


@pytest.mark.parametrize(("base_s", "cap_s"), [(0.0, 1.0), (2.0, 1.0), (-1.0, 1.0)])
def test_a_base_that_is_not_positive_or_over_the_cap_is_refused(base_s: float,
                                                                  cap_s: float) -> None:
    with pytest.raises(ValueError, match="need 0 < base_s <= cap_s"):
        Backoff(base_s=base_s, cap_s=cap_s)
