"""How many seats a batch has and how many tokens a step may carry, when the config leaves them open.

On a CPU a step's cost is mostly reading the weights once (a 135M model's linears take about the
same time for 1 row as for 8, and 64 rows cost 1.3 ms a row against 0.4 ms at 512 rows, on
Sapphire Rapids' AMX), so more seats buy throughput until the KV pool runs out: every seat should
find room for a chat-sized context, or the scheduler preempts instead of decoding. Measured with
`python scripts/bench_engine.py --num-requests 256 --baselines none --modes continuous
--max-num-seqs S --max-num-batched-tokens T` on a 2-core Xeon (AMX), SmolLM2 bf16: 64/512 631,
128/1024 863, 256/2048 837 tok/s (one run each, a shared machine).
"""

from __future__ import annotations

from dataclasses import dataclass

# The most seats by device kind: vLLM's own default batch for its offline engine is 256 too.
MAX_SEATS = {"cpu": 256, "cuda": 256}
# A step's token budget: this many per seat, within these bounds (prefill chunks share it).
TOKENS_PER_SEAT = 8
MIN_BUDGET = 512
MAX_BUDGET = {"cpu": 2048, "cuda": 8192}
# Each seat should find at least this much room in the KV pool (a prompt and its answer).
MIN_TOKENS_PER_SEAT = 256


@dataclass(frozen=True, slots=True)
class BatchLimits:
    max_num_seqs: int
    max_num_batched_tokens: int


def seat_cap(device_type: str) -> int:
    """The seats a pool is first sized for, before the pool's room is known."""
    return MAX_SEATS.get(device_type, MAX_SEATS["cpu"])


def resolve_batch_limits(device_type: str, pool_tokens: int, max_num_seqs: int | None,
                         max_num_batched_tokens: int | None) -> BatchLimits:
    """The configured values where given; otherwise as many seats as the pool has chat-sized room
    for (at most the device's cap), and a budget of TOKENS_PER_SEAT per seat."""
    seats = max_num_seqs
    if seats is None:
        seats = max(1, min(seat_cap(device_type), pool_tokens // MIN_TOKENS_PER_SEAT))
    budget = max_num_batched_tokens
    if budget is None:
        ceiling = MAX_BUDGET.get(device_type, MAX_BUDGET["cpu"])
        budget = min(ceiling, max(MIN_BUDGET, seats * TOKENS_PER_SEAT))
    return BatchLimits(seats, budget)
