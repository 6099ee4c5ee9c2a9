"""rms_norm, fused_add_rms_norm, silu_and_mul, rotary_embedding and write_kv_cache through the C++ CPU kernels
(csrc/layer_ops_cpu.cpp).

Each has a torch twin here (or in torch_kv_cache_write.py) that is its specification; the kernels
equal them up to fp32 summation order (in bf16 they round where the twins round). Callers go
through kernels.dispatch, which picks the kernel only where it runs (CPU tensors, fp32 or bf16 for
the arithmetic ones, the extension built).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_extension
from kernels.arg_checks import check_write_kv_cache_args

# The element types the arithmetic kernels are compiled for (computing in fp32 either way).
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def runs_here(*tensors: torch.Tensor) -> bool:
    """Contiguous CPU tensors of one KERNEL_DTYPES dtype and a built extension: what rms_norm and
    silu_and_mul need."""
    dtype = tensors[0].dtype
    return (dtype in KERNEL_DTYPES
            and all(t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous() for t in tensors)
            and cpu_extension.load() is not None)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: normalised in fp32, scaled by weight in the input's dtype."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., D] contiguous, weight: [D] of x's dtype (fp32 or bf16) -> like x."""
    if weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"weight must be [{x.shape[-1]}] to match x's last dim, got {tuple(weight.shape)}")
    out = torch.empty_like(x)
    cpu_extension.load().rms_norm_cpu(x, weight, float(eps), out)
    return out


def fused_add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """A Llama decoder layer's residual add and the next RMSNorm: residual <- residual + x (in place,
    rounded to their dtype as torch's add rounds), then rms_norm_torch(residual)."""
    residual.add_(x)
    return rms_norm_torch(residual, weight, eps)


def fused_add_rms_norm_cpu(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As fused_add_rms_norm_torch, in one pass over each row. x, residual: [..., D] contiguous,
    same shape and dtype (fp32 or bf16); weight: [D]. residual is updated in place."""
    if x.shape != residual.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} must equal x's {tuple(x.shape)}")
    if not runs_here(x, residual, weight):  # the kernel reads raw rows of one dtype
        raise ValueError(f"need contiguous CPU tensors of one dtype in {KERNEL_DTYPES}, got x {x.dtype}, "
                         f"residual {residual.dtype}, weight {weight.dtype}")
    if weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"weight must be [{x.shape[-1]}] to match x's last dim, got {tuple(weight.shape)}")
    out = torch.empty_like(x)
    cpu_extension.load().fused_add_rms_norm_cpu(x, residual, weight, float(eps), out)
    return out


def silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] (gate, then up) -> [..., I]: silu(gate) * up, the gated MLP's activation."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul_cpu(gate_up: torch.Tensor) -> torch.Tensor:
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dim must be even (gate then up), got {gate_up.shape[-1]}")
    out = torch.empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2, dtype=gate_up.dtype)
    cpu_extension.load().silu_and_mul_cpu(gate_up, out)
    return out


def rotary_embedding_torch(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int) -> None:
    """In place on the first num_heads heads of each row of qkv ([T, W], a fused q/k/v projection;
    the query's heads, then the key's): x <- x * cos + rotate_half(x) * sin, Llama's rotary
    embedding, with cos, sin: [T, head_dim] for each row's position."""
    head_dim = cos.shape[-1]
    heads = qkv[:, : num_heads * head_dim].unflatten(-1, (num_heads, head_dim))
    x1, x2 = heads[..., : head_dim // 2], heads[..., head_dim // 2:]
    rotated = torch.cat((-x2, x1), dim=-1)
    heads.copy_(heads * cos.unsqueeze(1) + rotated * sin.unsqueeze(1))


def rotary_embedding_cpu(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int) -> None:
    """As rotary_embedding_torch, in one pass; qkv's rows may be strided, each row unit-stride."""
    head_dim = cos.shape[-1]
    if qkv.dim() != 2 or cos.dim() != 2 or cos.shape != sin.shape or cos.shape[0] != qkv.shape[0]:
        raise ValueError(f"need qkv [T, W] and cos, sin [T, head_dim]; got {tuple(qkv.shape)}, "
                         f"{tuple(cos.shape)}, {tuple(sin.shape)}")
    if head_dim % 2 or num_heads * head_dim > qkv.shape[1] or qkv.stride(1) != 1:
        raise ValueError(f"{num_heads} heads of {head_dim} (even) must fit in qkv's unit-stride rows of "
                         f"{qkv.shape[1]}, got strides {qkv.stride()}")
    cpu_extension.load().rotary_embedding_cpu(qkv, cos.contiguous(), sin.contiguous(), num_heads)


def write_kv_cache_cpu(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """As write_kv_cache_torch (same checks, same result), in one call; any dtype, CPU tensors."""
    check_write_kv_cache_args(key, value, key_cache, value_cache, slot_mapping)
    cpu_extension.load().write_kv_cache_cpu(key, value, key_cache, value_cache, slot_mapping)
