"""write_kv_cache_torch: the pure-torch twin of the Triton KV-cache write kernel."""

from __future__ import annotations

import torch

from kernels.arg_checks import check_write_kv_cache_args


def write_kv_cache_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Copy token t's K/V into cache slot slot_mapping[t] (block * block_size + offset); skip negative slots."""
    check_write_kv_cache_args(key, value, key_cache, value_cache, slot_mapping)
    _, _, num_kv_heads, head_dim = key_cache.shape
    keep = (slot_mapping >= 0).nonzero().squeeze(1)  # a host sync on CUDA; this twin is the CPU path
    slots = slot_mapping.index_select(0, keep)
    # key/value: [num_tokens, num_kv_heads, head_dim]; the caches viewed as one row per slot.
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key.index_select(0, keep))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value.index_select(0, keep))
