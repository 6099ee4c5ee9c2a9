"""Fair shares with a real worker: two keys, one submitting four times more jobs, all of its jobs
queued ahead of the other's. While both have jobs queued, the tokens generated split as the
keys' weights say (FIFO would give the light key nothing until the heavy key's burst is through).
"""

from __future__ import annotations

import pytest

from protocol import JobSpec, submit_jobs
from scripts.bench_fair_share import FairShareMeter, contended_tokens
from tests.integration.conftest import KEYS, Fleet, new_id

pytestmark = pytest.mark.slow

# The light key's jobs last 5-8 rounds of seats: a contended window of 80-130 steps, which a
# sampler starved for a second by a loaded CI still sees most of (with 8, CI once measured a
# window of one step: 3 tokens each).
LIGHT_JOBS = 16
MAX_TOKENS = 16
# Six seats: 3 + 3 at equal weights, 4 + 2 at 2:1.
WORKER_ARGS = ["--max-num-seqs", "6", "--num-threads", "1", "--idle-block-seconds", "0.2"]


@pytest.fixture(scope="module")
def worker(fleet: Fleet) -> Fleet:
    fleet.start(("fair", WORKER_ARGS))
    return fleet


def _specs(model: str, owner: str, count: int) -> list[JobSpec]:
    # Every job generates exactly MAX_TOKENS tokens, so only the claims decide the shares.
    return [JobSpec.from_dict(dict(job_id=new_id(), model=model, prompt="Once upon a time",
                                   max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, ignore_eos=True,
                                   temperature=0.0, owner=owner))
            for _ in range(count)]


def _contended_split(fleet: Fleet, heavy: str, light: str) -> dict[str, int]:
    model = fleet.model_dir.name
    specs = _specs(model, heavy, LIGHT_JOBS * 4) + _specs(model, light, LIGHT_JOBS)
    meter = FairShareMeter(fleet.redis, KEYS, {spec.job_id: spec.owner for spec in specs})
    submit_jobs(fleet.redis, specs)  # one transaction: the heavy key's burst first in the queue
    samples = meter.run(interval_s=0.002, timeout_s=240)
    assert all(fleet.redis.hget(KEYS.state(s.job_id), "status") == b"finished" for s in specs)
    tokens, _ = contended_tokens(samples)
    return tokens


def test_equal_weights_split_tokens_evenly_while_both_keys_wait(worker: Fleet) -> None:
    tokens = _contended_split(worker, "heavy-1", "light-1")
    assert tokens["light-1"] >= 3 * MAX_TOKENS, tokens  # a window long enough to mean something
    assert 0.9 <= tokens["heavy-1"] / tokens["light-1"] <= 1.1, tokens


def test_weights_two_to_one_split_tokens_two_to_one(worker: Fleet) -> None:
    worker.redis.hset(KEYS.fair_weights(), mapping={"heavy-2": 2, "light-2": 1})
    tokens = _contended_split(worker, "heavy-2", "light-2")
    assert tokens["light-2"] >= 3 * MAX_TOKENS, tokens
    assert 1.8 <= tokens["heavy-2"] / tokens["light-2"] <= 2.2, tokens
