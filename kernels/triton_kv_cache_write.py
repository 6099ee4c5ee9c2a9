"""write_kv_cache_triton: the Triton kernel that writes each token's K/V into its paged-cache slot.

Imported only on demand (kernels.dispatch): importing it imports triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.arg_checks import check_write_kv_cache_args


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,
    slot_mapping_ptr,  # [num_tokens] int64
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_c_block,
    stride_c_slot,
    stride_c_head,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    # One program per token: copy its [num_kv_heads, head_dim] key and value tiles.
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok)
    if slot < 0:  # padding token
        return
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    dst = (slot // BLOCK_SIZE) * stride_c_block + (slot % BLOCK_SIZE) * stride_c_slot
    dst_offs = dst + offs_h[:, None] * stride_c_head + offs_d[None, :]
    k = tl.load(key_ptr + tok * stride_k_tok + offs_h[:, None] * stride_k_head + offs_d[None, :], mask=mask)
    tl.store(key_cache_ptr + dst_offs, k, mask=mask)
    v = tl.load(value_ptr + tok * stride_v_tok + offs_h[:, None] * stride_v_head + offs_d[None, :], mask=mask)
    tl.store(value_cache_ptr + dst_offs, v, mask=mask)


def write_constants(key_cache: torch.Tensor) -> dict[str, int]:
    """The kernel's constexpr arguments for one cache layout (public so tests can compile it ahead of time)."""
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    return {"BLOCK_SIZE": block_size, "NUM_KV_HEADS": num_kv_heads, "HEADS_PAD": triton.next_power_of_2(num_kv_heads),
            "HEAD_DIM": head_dim, "HEAD_PAD": triton.next_power_of_2(head_dim)}


def write_kv_cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Same contract as kernels.write_kv_cache_torch."""
    check_write_kv_cache_args(key, value, key_cache, value_cache, slot_mapping)
    # TRITON_INTERPRET is read once, when @triton.jit runs; the kernel object records the answer.
    interpreted = not isinstance(_write_kv_cache_kernel, triton.runtime.JITFunction)
    if not key.is_cuda and not interpreted:
        raise ValueError(f"write_kv_cache_triton needs CUDA tensors (key is on {key.device}); "
                         "CPU tensors need TRITON_INTERPRET=1 set before triton is imported")
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _write_kv_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        **write_constants(key_cache),
    )
