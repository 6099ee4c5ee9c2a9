"""write_kv_cache_torch against a slot-by-slot reference."""

from __future__ import annotations

import pytest
import torch

from kernels import write_kv_cache, write_kv_cache_torch


def reference_write(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    block_size = key_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            key_cache[slot // block_size, slot % block_size] = key[t]
            value_cache[slot // block_size, slot % block_size] = value[t]


def make_inputs(dtype: torch.dtype, num_tokens: int = 11, num_blocks: int = 6, block_size: int = 4,
                num_kv_heads: int = 3, head_dim: int = 16) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[t for t in (2, 7) if t < num_tokens]] = -1  # padding tokens
    return key, value, key_cache, value_cache, slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_reference_exactly(dtype):
    key, value, key_cache, value_cache, slots = make_inputs(dtype)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    reference_write(key, value, expected_k, expected_v, slots)
    write_kv_cache_torch(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_k)
    assert torch.equal(value_cache, expected_v)


def test_negative_slots_leave_the_cache_untouched():
    key, value, key_cache, value_cache, _ = make_inputs(torch.float32)
    before_k, before_v = key_cache.clone(), value_cache.clone()
    write_kv_cache_torch(key, value, key_cache, value_cache, torch.full((key.shape[0],), -1, dtype=torch.int64))
    assert torch.equal(key_cache, before_k)
    assert torch.equal(value_cache, before_v)


def test_strided_key_and_value_from_a_fused_projection():
    key, value, key_cache, value_cache, slots = make_inputs(torch.float32)
    kv = torch.cat([key, value], dim=1)  # [num_tokens, 2 * num_kv_heads, head_dim]
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    reference_write(key, value, expected_k, expected_v, slots)
    write_kv_cache(kv[:, :3], kv[:, 3:], key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_k)
    assert torch.equal(value_cache, expected_v)


def test_no_tokens():
    key, value, key_cache, value_cache, _ = make_inputs(torch.float32, num_tokens=0)
    before = key_cache.clone()
    write_kv_cache_torch(key, value, key_cache, value_cache, torch.zeros(0, dtype=torch.int64))
    assert torch.equal(key_cache, before)
