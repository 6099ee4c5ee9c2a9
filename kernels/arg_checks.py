"""Argument checks shared by the torch twins and the Triton launchers.

Both paths accept exactly the same inputs, so an engine that runs on the CPU runs unchanged on a GPU.
Only metadata is checked (shapes, dtypes, strides, devices): reading values would cost a
device->host sync per call. Each message is formatted only when its check fails: the engine runs
these twice per layer per step, and formatting them all cost 35 us per layer.
"""

from __future__ import annotations

import torch

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)


def _check_cache_pair(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    if key_cache.dim() != 4:
        raise ValueError("key_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got shape {tuple(key_cache.shape)}")
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"value_cache shape {tuple(value_cache.shape)} must equal "
                         f"key_cache shape {tuple(key_cache.shape)}")
    if key_cache.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"key_cache dtype {key_cache.dtype} not in {SUPPORTED_DTYPES}")
    if value_cache.dtype != key_cache.dtype:
        raise ValueError(f"value_cache dtype {value_cache.dtype} must equal key_cache dtype {key_cache.dtype}")
    # Contiguous caches let both paths address a slot as block * block_size + offset.
    if not key_cache.is_contiguous():
        raise ValueError("key_cache must be contiguous")
    if not value_cache.is_contiguous():
        raise ValueError("value_cache must be contiguous")
    if value_cache.device != key_cache.device:
        raise ValueError(f"value_cache is on {value_cache.device} but key_cache is on {key_cache.device}")


def _check_like_cache(tensor: torch.Tensor, name: str, key_cache: torch.Tensor) -> None:
    """The cache's dtype and device, head_dim contiguous (rows and heads may be strided)."""
    if tensor.dtype != key_cache.dtype:
        raise ValueError(f"{name} dtype {tensor.dtype} must equal the cache dtype {key_cache.dtype}")
    if tensor.device != key_cache.device:
        raise ValueError(f"{name} is on {tensor.device} but the caches are on {key_cache.device}")
    if tensor.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in head_dim, got strides {tensor.stride()}")


def _check_index(tensor: torch.Tensor, name: str, dim: int, dtype: torch.dtype, device: torch.device) -> None:
    if tensor.dim() != dim:
        raise ValueError(f"{name} must have {dim} dim(s), got shape {tuple(tensor.shape)}")
    if tensor.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {tensor.dtype}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device} but the caches are on {device}")
    if tensor.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {tensor.stride()}")


def check_write_kv_cache_args(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Raise ValueError naming the offending argument unless the inputs match the write_kv_cache contract."""
    _check_cache_pair(key_cache, value_cache)
    _, _, num_kv_heads, head_dim = key_cache.shape
    for name, tensor in (("key", key), ("value", value)):
        if tensor.dim() != 3 or tuple(tensor.shape[1:]) != (num_kv_heads, head_dim):
            raise ValueError(f"{name} must be [num_tokens, {num_kv_heads}, {head_dim}] to match the cache, "
                             f"got shape {tuple(tensor.shape)}")
        _check_like_cache(tensor, name, key_cache)
    if value.shape[0] != key.shape[0]:
        raise ValueError(f"value has {value.shape[0]} tokens but key has {key.shape[0]}")
    _check_index(slot_mapping, "slot_mapping", 1, torch.int64, key_cache.device)
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries but key has {key.shape[0]} tokens")


def check_paged_attention_args(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> None:
    """Raise ValueError naming the offending argument unless the inputs match the paged_attention contract."""
    _check_cache_pair(key_cache, value_cache)
    _, _, num_kv_heads, head_dim = key_cache.shape
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_heads, head_dim], got shape {tuple(query.shape)}")
    if query.shape[2] != head_dim:
        raise ValueError(f"query head_dim {query.shape[2]} must equal the cache head_dim {head_dim}")
    if query.shape[1] % num_kv_heads:
        raise ValueError(f"query num_heads {query.shape[1]} must be a multiple of num_kv_heads {num_kv_heads}")
    _check_like_cache(query, "query", key_cache)
    _check_index(block_tables, "block_tables", 2, torch.int32, key_cache.device)
    _check_index(seq_lens, "seq_lens", 1, torch.int32, key_cache.device)
    _check_index(query_start_loc, "query_start_loc", 1, torch.int32, key_cache.device)
    num_seqs = block_tables.shape[0]
    if seq_lens.shape[0] != num_seqs:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries but block_tables has {num_seqs} rows")
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(f"query_start_loc must have num_seqs + 1 = {num_seqs + 1} entries, "
                         f"got {query_start_loc.shape[0]}")


def check_paged_attention_lengths(
    query_lens: list[int], ctx_lens: list[int], total: int, num_tokens: int, max_ctx: int,
) -> None:
    """Lengths read on the host (the CPU paths read them anyway): raise ValueError on any inconsistency."""
    if total > num_tokens:
        raise ValueError(f"query_start_loc ends at {total} but query has only {num_tokens} rows")
    for s, (q_len, ctx) in enumerate(zip(query_lens, ctx_lens)):
        if q_len < 0 or ctx < q_len or ctx > max_ctx:
            raise ValueError(f"sequence {s}: need 0 <= query_len ({q_len}) <= seq_len ({ctx}) <= "
                             f"max_num_blocks_per_seq * block_size ({max_ctx})")
