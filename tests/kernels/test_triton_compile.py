"""Compile the Triton kernels for an H100/H200 (sm_90) ahead of time, on the CPU, with no GPU or driver.

The interpreter checks what the kernels compute but not that they lower: loop-carried types,
tl.dot shapes and layouts are only checked by the real compiler, which runs here through ptxas.
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.triton_interpret

_POINTER = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}
_INDEX_POINTERS = {"block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
                   "slot_mapping_ptr": "*i64"}


def _compile(kernel, constants: dict[str, object], dtype: torch.dtype):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for name in kernel.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = _INDEX_POINTERS.get(name, _POINTER[dtype])
        else:
            signature[name] = "fp32" if name == "scale_log2" else "i32"
    target = GPUTarget("cuda", 90, 32)
    options = triton.compiler.make_backend(target).parse_options({"num_warps": 4})
    return triton.compile(ASTSource(kernel, signature, constants), target=target, options=options.__dict__)


@pytest.fixture(autouse=True)
def _compiled_mode(monkeypatch):
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("kernels are interpreted in this process")
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # silences triton 3.9's default-change warning


@pytest.mark.parametrize(
    ("dtype", "num_heads", "num_kv_heads", "head_dim", "long_queries"),
    [(torch.bfloat16, 9, 3, 64, False), (torch.float16, 32, 8, 128, True), (torch.float32, 12, 4, 80, False)],
)
def test_paged_attention_kernel_compiles_for_sm90(dtype, num_heads, num_kv_heads, head_dim, long_queries):
    from kernels.triton_paged_attention import _paged_attention_kernel, tile_constants

    constants = tile_constants(dtype, num_heads, num_kv_heads, head_dim, 16, long_queries)
    assert "cubin" in _compile(_paged_attention_kernel, constants, dtype).asm


def test_write_kv_cache_kernel_compiles_for_sm90():
    from kernels.triton_kv_cache_write import _write_kv_cache_kernel, write_constants

    constants = write_constants(torch.empty(0, 16, 3, 64))
    assert "cubin" in _compile(_write_kv_cache_kernel, constants, torch.bfloat16).asm
