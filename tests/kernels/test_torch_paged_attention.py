"""paged_attention_torch against a dense float64 reference on un-paged K/V."""

from __future__ import annotations

import pytest
import torch

from kernels import paged_attention, paged_attention_torch


@pytest.mark.parametrize("head_dim", [16, 64, 80, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (9, 3)])
def test_mixed_batch_matches_dense_fp32(paged_batch, dense_reference, close, mixed_lens, head_dim, num_heads,
                                        num_kv_heads):
    batch = paged_batch(*mixed_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                        seed=head_dim)
    close(paged_attention_torch(*batch.args()), dense_reference(batch), torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_mixed_batch_matches_dense_half(paged_batch, dense_reference, close, mixed_lens, dtype, head_dim):
    batch = paged_batch(*mixed_lens, num_heads=9, num_kv_heads=3, head_dim=head_dim, dtype=dtype)
    out = paged_attention_torch(*batch.args())
    assert out.dtype == dtype
    close(out, dense_reference(batch), dtype)


@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
def test_block_sizes(paged_batch, dense_reference, close, mixed_lens, block_size):
    batch = paged_batch(*mixed_lens, block_size=block_size)
    close(paged_attention_torch(*batch.args()), dense_reference(batch), torch.float32)


def test_many_decodes_split_into_buckets(paged_batch, dense_reference, close):
    # Lengths spread from 1 to 900 make the planner cut several buckets; a prefill rides along.
    seq_lens = [1 + (i * 37) % 900 for i in range(48)] + [300]
    batch = paged_batch([1] * 48 + [64], seq_lens, num_heads=9, num_kv_heads=3, head_dim=64, seed=3)
    close(paged_attention_torch(*batch.args()), dense_reference(batch), torch.float32)


def test_several_prefill_chunks(paged_batch, dense_reference, close):
    batch = paged_batch([5, 2, 30, 16, 3], [5, 100, 30, 80, 3], seed=4)
    close(paged_attention_torch(*batch.args()), dense_reference(batch), torch.float32)


def test_padding_rows_after_the_last_sequence_are_zero(paged_batch, dense_reference, mixed_lens):
    batch = paged_batch(*mixed_lens, extra_tokens=5)
    out = paged_attention_torch(*batch.args())
    assert torch.equal(out[-5:], torch.zeros_like(out[-5:]))
    torch.testing.assert_close(out.double(), dense_reference(batch), atol=1e-5, rtol=1e-5)


def test_strided_query_is_read_in_place(paged_batch, dense_reference, close, mixed_lens):
    # The engine slices q out of a fused qkv projection: rows are strided, head_dim is contiguous.
    batch = paged_batch(*mixed_lens, num_heads=4, num_kv_heads=2)
    qkv = torch.cat([batch.query, torch.zeros_like(batch.query)], dim=1)
    batch.query = qkv[:, :4]
    assert not batch.query.is_contiguous()
    close(paged_attention_torch(*batch.args()), dense_reference(batch), torch.float32)


def test_hints_do_not_change_the_result(paged_batch, mixed_lens):
    batch = paged_batch(*mixed_lens)
    plain = paged_attention_torch(*batch.args())
    hinted = paged_attention_torch(*batch.args(), max_query_len=max(mixed_lens[0]), max_seq_len=max(mixed_lens[1]))
    assert torch.equal(plain, hinted)


def test_dispatch_runs_the_twin_on_cpu_outside_fp32_and_bf16(paged_batch, mixed_lens):
    # fp32 and bf16 go to the C++ kernel where it is built (tests/kernels/test_cpu_paged_attention.py).
    batch = paged_batch(*mixed_lens, dtype=torch.float16)
    assert torch.equal(paged_attention(*batch.args()), paged_attention_torch(*batch.args()))


def test_empty_batch(paged_batch):
    batch = paged_batch([0, 0], [3, 0])
    assert paged_attention_torch(*batch.args()).shape == (0, 4, 16)


@pytest.mark.parametrize("attend", [paged_attention_torch, paged_attention], ids=["twin", "dispatch"])
@pytest.mark.parametrize(("query_lens", "seq_lens"), [([3], [2]), ([1], [40])])
def test_impossible_lengths_are_rejected(paged_batch, query_lens, seq_lens, attend):
    # dispatch: the C++ kernel on an AVX2 CPU, which checks the lengths itself.
    batch = paged_batch([1], [2])
    batch.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
    batch.query_start_loc = torch.tensor([0, query_lens[0]], dtype=torch.int32)
    batch.query = torch.zeros(query_lens[0], 4, 16)
    with pytest.raises(ValueError, match="sequence 0"):
        attend(*batch.args())


def test_head_major_query_from_transformers(paged_batch, dense_reference, close, mixed_lens):
    # transformers hands attention [1, num_heads, num_tokens, head_dim]; the engine passes [0].transpose(0, 1).
    batch = paged_batch(*mixed_lens, num_heads=4, num_kv_heads=2)
    batch.query = batch.query.transpose(0, 1).contiguous().transpose(0, 1)
    assert batch.query.stride() == (16, batch.query.shape[0] * 16, 1)
    close(paged_attention_torch(*batch.args()), dense_reference(batch), torch.float32)
