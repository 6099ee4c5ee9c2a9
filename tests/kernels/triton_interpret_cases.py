"""Triton kernels against the torch twins on CPU tensors, through Triton's interpreter.

Not collected on its own (no test_ prefix): test_triton_interpret.py runs this file in a child
pytest with TRITON_INTERPRET=1, because triton reads that variable when a kernel is decorated and
this process must not share compiled kernels with GPU tests.
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through test_triton_interpret.py (needs TRITON_INTERPRET=1)", allow_module_level=True)

from kernels import paged_attention_torch, write_kv_cache_torch  # noqa: E402
from kernels.triton_kv_cache_write import write_kv_cache_triton  # noqa: E402
from kernels.triton_paged_attention import _is_interpreted, paged_attention_triton  # noqa: E402

pytestmark = pytest.mark.triton_interpret


def test_kernels_are_interpreted():
    assert _is_interpreted()


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "dtype"),
    [
        (9, 3, 16, torch.float32),  # group 3 padded to 4
        (4, 2, 80, torch.float32),  # head_dim padded to 128 and masked
        (16, 1, 32, torch.float32),  # one kv head: a whole tile of query heads per token
        (8, 2, 32, torch.bfloat16),
        (8, 2, 32, torch.float16),
    ],
)
def test_mixed_batch_matches_twin(paged_batch, close, mixed_lens, num_heads, num_kv_heads, head_dim, dtype):
    batch = paged_batch(*mixed_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                        extra_tokens=2)
    out = paged_attention_triton(*batch.args(), max_query_len=max(mixed_lens[0]))
    assert out.dtype == dtype
    close(out, paged_attention_torch(*batch.args()), dtype)
    assert torch.equal(out[-2:], torch.zeros_like(out[-2:]))


@pytest.mark.parametrize("max_query_len", [None, 1, 40])
def test_tiling_hints_never_change_the_result(paged_batch, close, max_query_len):
    # A 40-token chunk after a 30-token prefix spans several query tiles and key tiles.
    batch = paged_batch([1, 40, 1], [23, 70, 5], num_heads=4, num_kv_heads=2, head_dim=16, block_size=8)
    out = paged_attention_triton(*batch.args(), max_query_len=max_query_len)
    close(out, paged_attention_torch(*batch.args()), torch.float32)


def test_head_major_query_from_transformers(paged_batch, close, mixed_lens):
    batch = paged_batch(*mixed_lens, num_heads=4, num_kv_heads=2)
    batch.query = batch.query.transpose(0, 1).contiguous().transpose(0, 1)  # strides (d, num_tokens * d, 1)
    close(paged_attention_triton(*batch.args()), paged_attention_torch(*batch.args()), torch.float32)


@pytest.mark.parametrize("block_size", [1, 16])
def test_block_sizes(paged_batch, close, block_size):
    batch = paged_batch([1, 3, 1], [9, 20, 33], block_size=block_size)
    close(paged_attention_triton(*batch.args()), paged_attention_torch(*batch.args()), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_matches_twin_exactly(dtype):
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(2 * 3, 9, 24, generator=gen).to(dtype)  # head-major, as transformers hands it over
    key, value = kv[:3].transpose(0, 1), kv[3:].transpose(0, 1)
    cache = torch.randn(5, 4, 3, 24, generator=gen).to(dtype)
    slots = torch.randperm(20, generator=gen)[:9]
    slots[[1, 5]] = -1
    triton_k, triton_v = cache.clone(), cache.clone() + 1
    twin_k, twin_v = triton_k.clone(), triton_v.clone()
    write_kv_cache_triton(key, value, triton_k, triton_v, slots)
    write_kv_cache_torch(key, value, twin_k, twin_v, slots)
    assert torch.equal(triton_k, twin_k)
    assert torch.equal(triton_v, twin_v)


@pytest.mark.parametrize(("query_lens", "seq_lens"), [([1], [40]), ([24], [24])])
def test_single_sequence(paged_batch, close, query_lens, seq_lens):
    batch = paged_batch(query_lens, seq_lens)
    close(paged_attention_triton(*batch.args()), paged_attention_torch(*batch.args()), torch.float32)
