"""plan_seq_buckets: every sequence with query tokens lands in exactly one bucket, cheaply padded."""

from __future__ import annotations

from kernels.seq_bucket import plan_seq_buckets


def _ids(buckets) -> list[int]:
    return sorted(i for b in buckets for i in b.seq_ids)


def test_each_sequence_once_and_idle_ones_dropped():
    query_lens = [1, 0, 5, 1, 1, 12]
    seq_lens = [10, 4, 30, 200, 7, 12]
    buckets = plan_seq_buckets(query_lens, seq_lens, block_size=16)
    assert _ids(buckets) == [0, 2, 3, 4, 5]
    for b in buckets:
        assert b.max_query_len == max(query_lens[i] for i in b.seq_ids)
        assert b.max_seq_len == max(seq_lens[i] for i in b.seq_ids)


def test_decode_and_prefill_never_share_a_bucket():
    buckets = plan_seq_buckets([1, 256, 1, 1], [300, 512, 310, 290], block_size=16)
    assert sorted(b.max_query_len for b in buckets) == [1, 256]


def test_similar_lengths_stay_in_one_bucket():
    buckets = plan_seq_buckets([1] * 8, [100, 101, 99, 102, 100, 98, 103, 97], block_size=16)
    assert len(buckets) == 1


def test_one_long_sequence_is_split_off():
    # Padding 63 short contexts to 4000 would multiply their work by 40.
    buckets = plan_seq_buckets([1] * 64, [100] * 63 + [4000], block_size=16)
    assert sorted(len(b.seq_ids) for b in buckets) == [1, 63]


def test_no_sequences():
    assert plan_seq_buckets([], [], block_size=16) == []
    assert plan_seq_buckets([0, 0], [5, 0], block_size=16) == []
