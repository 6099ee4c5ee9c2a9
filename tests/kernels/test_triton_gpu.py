"""Triton kernels against the torch twins on a CUDA GPU, at real model shapes."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (num_heads, num_kv_heads, head_dim): SmolLM2-135M, a Llama-8B-like layer, a non-power-of-two head.
MODELS = [(9, 3, 64), (32, 8, 128), (12, 4, 80)]


def _engine_lens(seed: int) -> tuple[list[int], list[int]]:
    """63 decodes with contexts 50..600, one 256-token chunk after a 256-token prefix, one fresh prompt."""
    gen = torch.Generator().manual_seed(seed)
    decode_ctx = torch.randint(50, 601, (63,), generator=gen).tolist()
    return [1] * 63 + [256, 37], decode_ctx + [512, 37]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), MODELS)
def test_engine_batch_matches_twin(paged_batch, close, dtype, num_heads, num_kv_heads, head_dim):
    from kernels import paged_attention_torch
    from kernels.triton_paged_attention import paged_attention_triton

    query_lens, seq_lens = _engine_lens(head_dim)
    batch = paged_batch(query_lens, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                        dtype=dtype, extra_tokens=3).to("cuda")
    out = paged_attention_triton(*batch.args(), max_query_len=256, max_seq_len=600)
    assert out.dtype == dtype and out.is_cuda
    close(out, paged_attention_torch(*batch.args()), dtype)
    assert torch.equal(out[-3:], torch.zeros_like(out[-3:]))


@pytest.mark.parametrize("max_query_len", [None, 1, 1024])
def test_long_prefill_and_long_decodes(paged_batch, close, max_query_len):
    batch = paged_batch([1, 1, 1024, 1], [4096, 1, 3000, 777], num_heads=32, num_kv_heads=8, head_dim=128,
                        dtype=torch.bfloat16, seed=7).to("cuda")
    from kernels import paged_attention_torch
    from kernels.triton_paged_attention import paged_attention_triton

    close(paged_attention_triton(*batch.args(), max_query_len=max_query_len),
          paged_attention_torch(*batch.args()), torch.bfloat16)


def test_dispatch_runs_triton_on_cuda(paged_batch, mixed_lens):
    from kernels import dispatch, paged_attention
    from kernels.triton_paged_attention import paged_attention_triton

    batch = paged_batch(*mixed_lens, dtype=torch.bfloat16).to("cuda")
    assert dispatch._triton_module("triton_paged_attention") is not None
    assert torch.equal(paged_attention(*batch.args()), paged_attention_triton(*batch.args()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_cache_matches_twin_exactly(dtype):
    from kernels import write_kv_cache, write_kv_cache_torch

    gen = torch.Generator(device="cuda").manual_seed(0)
    num_blocks, block_size, num_kv_heads, head_dim, num_tokens = 300, 16, 8, 128, 1000
    kv = torch.randn(num_tokens, 2 * num_kv_heads, head_dim, device="cuda", generator=gen).to(dtype)
    key, value = kv[:, :num_kv_heads], kv[:, num_kv_heads:]
    cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device="cuda", generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, device="cuda", generator=gen)[:num_tokens]
    slots[::7] = -1
    triton_k, triton_v = cache.clone(), cache.clone()
    twin_k, twin_v = cache.clone(), cache.clone()
    write_kv_cache(key, value, triton_k, triton_v, slots)
    write_kv_cache_torch(key, value, twin_k, twin_v, slots)
    assert torch.equal(triton_k, twin_k) and torch.equal(triton_v, twin_v)
