"""The kernels package surface: what it exports, what it imports, one signature everywhere."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import kernels
from kernels import dispatch


def test_exports():
    expected = ["StepOps", "fused_add_rms_norm", "linear", "paged_attention", "paged_attention_torch", "rms_norm",
                "rotary_embedding", "silu_and_mul", "write_kv_cache", "write_kv_cache_torch"]
    assert sorted(kernels.__all__) == expected


def test_import_does_not_import_triton():
    code = "import sys, kernels; assert 'triton' not in sys.modules, 'kernels imported triton'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=Path(__file__).parents[2])


def _signature(fn) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


def test_twins_share_the_public_signatures():
    assert _signature(kernels.paged_attention) == _signature(kernels.paged_attention_torch)
    assert _signature(kernels.write_kv_cache) == _signature(kernels.write_kv_cache_torch)
    assert _signature(kernels.paged_attention)[-3:] == [("scale", inspect.Parameter.empty), ("max_query_len", None),
                                                         ("max_seq_len", None)]


def test_triton_launchers_share_the_public_signatures():
    pytest.importorskip("triton")
    from kernels.triton_kv_cache_write import write_kv_cache_triton
    from kernels.triton_paged_attention import paged_attention_triton

    assert _signature(paged_attention_triton) == _signature(kernels.paged_attention)
    assert _signature(write_kv_cache_triton) == _signature(kernels.write_kv_cache)


def test_broken_triton_falls_back_to_the_twin_with_a_warning(monkeypatch):
    def broken(name: str):
        raise ImportError(f"no module named {name}")

    dispatch._triton_module.cache_clear()
    monkeypatch.setattr(importlib, "import_module", broken)
    try:
        with pytest.warns(UserWarning, match="Triton kernels unavailable"):
            assert dispatch._triton_function("triton_paged_attention", "paged_attention_triton") is None
    finally:
        dispatch._triton_module.cache_clear()
