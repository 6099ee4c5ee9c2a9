"""The single dispatch point: Triton for CUDA tensors, the C++ CPU kernels for fp32 and bf16 on
AVX2 CPUs (the skinny matmul: fp32 only), the torch twins otherwise.

The Triton modules are imported on first CUDA call only, so `import kernels` works where triton
is missing or cannot initialise (CPU CI). If it fails on a CUDA machine the twin (which also runs
on CUDA) takes over after one warning, so a broken triton install degrades speed, not service.
"""

from __future__ import annotations

import functools
import importlib
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from kernels import (
    cpu_amx_linear,
    cpu_extension,
    cpu_layer_ops,
    cpu_packed_linear,
    cpu_paged_attention,
    cpu_skinny_linear,
)
from kernels.torch_kv_cache_write import write_kv_cache_torch
from kernels.torch_paged_attention import paged_attention_torch


@functools.cache
def _triton_module(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"kernels.{name}")
    except (ImportError, RuntimeError, OSError) as exc:  # triton raises RuntimeError when it finds no driver
        warnings.warn(f"Triton kernels unavailable ({exc!r}); CUDA tensors use the torch twin", stacklevel=3)
        return None


def _triton_function(module: str, function: str) -> Callable[..., Any] | None:
    loaded = _triton_module(module)
    return None if loaded is None else getattr(loaded, function)


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    slot_mapping: torch.Tensor,  # [num_tokens] int64, block_id * block_size + offset; negative: skip
) -> None:
    """Write token t's K/V into slot slot_mapping[t], i.e. key_cache[slot // block_size, slot % block_size]."""
    if key.is_cuda and (triton_write := _triton_function("triton_kv_cache_write", "write_kv_cache_triton")):
        triton_write(key, value, key_cache, value_cache, slot_mapping)
        return
    if key.device.type == "cpu" and cpu_extension.load() is not None:
        cpu_layer_ops.write_kv_cache_cpu(key, value, key_cache, value_cache, slot_mapping)
        return
    write_kv_cache_torch(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], sequences packed one after another
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length including this step's tokens
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, cumulative query offsets
    scale: float,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """Causal attention of every packed query row over its sequence's paged K/V cache.

    Sequence s owns query rows query_start_loc[s]:query_start_loc[s + 1] (q_len of them); its j-th
    row sits at position seq_lens[s] - q_len + j and attends to cached positions 0..that position,
    read through block_tables[s] (whose entries past the sequence's last block are ignored). Query
    head h reads kv head h // (num_heads // num_kv_heads). Rows outside every sequence come back as
    zeros. The max_* hints are optional host-side ints; results never depend on them.
    Returns [num_tokens, num_heads, head_dim] in query's dtype.
    """
    args = (query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale)
    if query.is_cuda and (triton_attention := _triton_function("triton_paged_attention", "paged_attention_triton")):
        return triton_attention(*args, max_query_len=max_query_len, max_seq_len=max_seq_len)
    if cpu_paged_attention.is_available(query):
        return cpu_paged_attention.paged_attention_cpu(*args, max_query_len=max_query_len, max_seq_len=max_seq_len)
    return paged_attention_torch(*args, max_query_len=max_query_len, max_seq_len=max_seq_len)


# Up to this many rows the skinny kernel matched or beat MKL's sgemm on the model's shapes (AVX2;
# `python scripts/bench_cpu_linear.py --rows 1,32,64,96,128 --threads 1` and `--threads 2`): on
# the layers 1.4x (1 thread) and 2.0x (2 threads) at 1 row, 1.03-1.2x at 32-96 rows, 0.95x at 128
# rows on 2 threads; on the 49152-wide lm_head (`--weights lm_head`) 1.2x (1 thread) and 1.7x
# (2 threads) at 64 rows, where MKL packs the whole 113 MB weight on every call. Prefill chunks
# (hundreds of rows) go to MKL's packed GEMM.
MAX_SKINNY_ROWS = 96
# Between MAX_SKINNY_ROWS and this many rows an fp32 input goes to the weight's oneDNN copy (where
# the layers were routed with packed=True): MKL's sgemm packs the weight on every call, 113 MB for
# SmolLM2's lm_head, which the copy saves (lm_head 1.69x at 128 rows, 1.32x at 256; the fused
# layers 1.01-1.09x at 96-192 rows, 0.97-1.00x at 256; 2-vCPU Zen 3 EPYC, `python
# scripts/bench_cpu_linear.py --fp32-packed --weights fused_layers|lm_head --threads 2`). Past it
# (prefill chunks) MKL was as fast or faster: 0.90-0.96x at 320-512 rows on the layers.
MAX_PACKED_FP32_ROWS = 256


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """`F.linear`, through the skinny CPU kernel when x has few rows (fp32 on an AVX2 CPU), or
    through the weight's packed copy when one is given (`cpu_packed_linear.pack_weight(weight)`;
    bf16: AMX tiles up to cpu_amx_linear.MAX_ROWS rows, or oneDNN's pre-reordered copy; fp32:
    oneDNN's copy, for the rows between the skinny kernel's and MAX_PACKED_FP32_ROWS)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if packed is not None and x.dtype == torch.bfloat16 and x.device.type == "cpu":
        if cpu_amx_linear.is_packed(packed) and rows > cpu_amx_linear.MAX_ROWS:
            return F.linear(x, weight, bias)  # a long prefill chunk: oneDNN wins there (cpu_amx_linear.MAX_ROWS)
        return cpu_packed_linear.packed_linear(x, packed, bias)
    if (0 < rows <= MAX_SKINNY_ROWS and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.device.type == "cpu" and weight.is_contiguous()
            and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
            and cpu_skinny_linear.is_available()):
        # The extension directly: the conditions above are skinny_linear's checks, already made.
        out = cpu_extension.load().skinny_linear(x.reshape(rows, x.shape[-1]).contiguous(), weight, bias)
        return out.view(*x.shape[:-1], weight.shape[0])
    if (packed is not None and MAX_SKINNY_ROWS < rows <= MAX_PACKED_FP32_ROWS and x.dtype == torch.float32
            and packed.dtype == x.dtype and x.device.type == "cpu"):
        return cpu_packed_linear.packed_linear(x, packed, bias)
    return F.linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama-style RMSNorm over x's last dim; the C++ kernel for fp32 and bf16 CPU tensors."""
    if cpu_layer_ops.runs_here(x, weight):
        return cpu_layer_ops.rms_norm_cpu(x, weight, eps)
    return cpu_layer_ops.rms_norm_torch(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual <- residual + x (in place), then Llama-style RMSNorm of it: a decoder layer's
    `residual + hidden_states` and the next norm in one pass; the C++ kernel for fp32 and bf16 CPU tensors."""
    if cpu_layer_ops.runs_here(x, residual, weight):
        return cpu_layer_ops.fused_add_rms_norm_cpu(x, residual, weight, eps)
    return cpu_layer_ops.fused_add_rms_norm_torch(x, residual, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] gate then up -> silu(gate) * up; the C++ kernel for fp32 and bf16 CPU tensors."""
    if cpu_layer_ops.runs_here(gate_up):
        return cpu_layer_ops.silu_and_mul_cpu(gate_up)
    return cpu_layer_ops.silu_and_mul_torch(gate_up)


def rotary_embedding(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int) -> None:
    """In place on the first num_heads heads of each [T, W] row of a fused q/k/v projection:
    x <- x * cos + rotate_half(x) * sin (Llama's rotary embedding; cos, sin: [T, head_dim]).
    The C++ kernel for fp32 and bf16 CPU tensors."""
    if cpu_layer_ops.runs_here(cos, sin) and qkv.dtype == cos.dtype and qkv.device.type == "cpu":
        cpu_layer_ops.rotary_embedding_cpu(qkv, cos, sin, num_heads)
    else:
        cpu_layer_ops.rotary_embedding_torch(qkv, cos, sin, num_heads)
