"""SeqBucket: a group of sequences the torch twin pads to one shape and attends to in one batched call."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

# Cost model, in units of one query row times one cached key: a bucket costs
# count * padded_ctx * (max_query_len + KV_GATHER_WEIGHT), the second term standing for gathering
# its K/V through the block table. A cut must save more than a bucket's fixed cost (about fifteen
# small torch ops). Picked on the scripts/bench_kernels.py shapes (2-core CPU), where any overhead
# between 500 and 5000 timed the same.
KV_GATHER_WEIGHT = 2
BUCKET_OVERHEAD = 1500
MAX_BUCKETS_PER_GROUP = 8


@dataclass(frozen=True, slots=True)
class SeqBucket:
    seq_ids: list[int]
    max_query_len: int
    max_seq_len: int


def _best_cut(q: list[int], c: list[int]) -> tuple[int, int]:
    """(saving, index) of the cheapest cut of a bucket with these query and padded context lengths."""
    q_pre, c_pre = list(accumulate(q, max)), list(accumulate(c, max))
    q_suf, c_suf = list(accumulate(reversed(q), max))[::-1], list(accumulate(reversed(c), max))[::-1]
    n, w = len(q), KV_GATHER_WEIGHT
    whole = n * c_pre[-1] * (q_pre[-1] + w)
    best_saving, best_index = 0, 0
    for i in range(1, n):
        saving = whole - i * c_pre[i - 1] * (q_pre[i - 1] + w) - (n - i) * c_suf[i] * (q_suf[i] + w)
        if saving > best_saving:
            best_saving, best_index = saving, i
    return best_saving, best_index


def _cut_group(ids: list[int], query_lens: list[int], padded_lens: list[int]) -> list[list[int]]:
    # Greedy, top down: keep cutting the bucket whose best cut saves most, while a cut pays for itself.
    def best(bucket: list[int]) -> tuple[int, int]:
        return _best_cut([query_lens[i] for i in bucket], [padded_lens[i] for i in bucket])

    buckets, cuts = [ids], [best(ids)]
    while len(buckets) < MAX_BUCKETS_PER_GROUP:
        k = max(range(len(buckets)), key=lambda j: cuts[j][0])
        saving, index = cuts[k]
        if saving <= BUCKET_OVERHEAD:
            break
        left, right = buckets[k][:index], buckets[k][index:]
        buckets[k:k + 1] = [left, right]
        cuts[k:k + 1] = [best(left), best(right)]
    return buckets


def plan_seq_buckets(query_lens: list[int], seq_lens: list[int], block_size: int) -> list[SeqBucket]:
    """Group sequences so that padding each group to its longest member wastes little work.

    Decode rows (query_len == 1) and prefill chunks never share a bucket: padding 63 decode rows to
    a 256-token chunk would multiply their work by 256. Sequences with no query tokens are dropped.
    """
    decode = sorted((i for i, q in enumerate(query_lens) if q == 1), key=lambda i: seq_lens[i])
    prefill = sorted((i for i, q in enumerate(query_lens) if q > 1), key=lambda i: (query_lens[i], seq_lens[i]))
    padded_lens = [-(-c // block_size) * block_size for c in seq_lens]  # the gather works in whole blocks
    buckets: list[SeqBucket] = []
    for group in (decode, prefill):
        if not group:
            continue
        for ids in _cut_group(group, query_lens, padded_lens):
            buckets.append(SeqBucket(ids, max(query_lens[i] for i in ids), max(seq_lens[i] for i in ids)))
    return buckets
