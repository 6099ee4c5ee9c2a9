"""Paged attention and KV-cache writes (Triton kernels on CUDA, pure-torch twins elsewhere), and
few-row linear layers (a C++ kernel on AVX2 CPUs, `F.linear` elsewhere).

The engine calls only write_kv_cache, paged_attention and linear; the twins are exported by name
for tests and benchmarks. Importing this package never imports triton or compiles anything.
"""

from kernels.dispatch import linear, paged_attention, write_kv_cache
from kernels.torch_kv_cache_write import write_kv_cache_torch
from kernels.torch_paged_attention import paged_attention_torch

__all__ = ["linear", "paged_attention", "paged_attention_torch", "write_kv_cache", "write_kv_cache_torch"]
