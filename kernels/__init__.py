"""Paged attention and KV-cache writes (Triton kernels on CUDA, C++ kernels on AVX2 CPUs, pure-torch
twins elsewhere), linear layers (fp32: a few-row C++ kernel on AVX2 CPUs; bf16: AMX tiles where the
CPU has them, oneDNN on weights packed once elsewhere; `F.linear` otherwise), and the small per-layer
ops RMSNorm (alone or after the residual add), SiLU-and-multiply and the rotary embedding (C++ on
CPUs, torch elsewhere). kernels.cpu_isa says which CPU paths run (AVX2, AVX-512 or AMX).

The engine calls only these dispatchers, and StepOps: a decode step's CPU decoder layers, each in
one C++ call, with the step's arguments checked once. The twins are
exported by name for tests and benchmarks. Importing this package never imports triton or compiles anything.
"""

from kernels.cpu_step_ops import StepOps
from kernels.dispatch import (
    fused_add_rms_norm,
    linear,
    paged_attention,
    rms_norm,
    rotary_embedding,
    silu_and_mul,
    write_kv_cache,
)
from kernels.torch_kv_cache_write import write_kv_cache_torch
from kernels.torch_paged_attention import paged_attention_torch

__all__ = [
    "fused_add_rms_norm", "linear", "paged_attention", "paged_attention_torch", "rms_norm", "rotary_embedding",
    "silu_and_mul", "StepOps", "write_kv_cache",
    "write_kv_cache_torch",
]
