"""The run-time ISA switch of the C++ CPU kernels (kernels.cpu_isa) and the two paths side by side."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import cpu_extension, cpu_isa, cpu_paged_attention

pytestmark = pytest.mark.skipif(cpu_extension.load() is None, reason="no AVX2 or no compiler here")
needs_avx512 = pytest.mark.skipif(cpu_isa.AVX512_BF16 not in cpu_isa.supported_isas(),
                                  reason="this CPU has no AVX-512 BF16")


def test_the_best_supported_isa_is_active_and_avx2_always_runs() -> None:
    assert cpu_isa.supported_isas()[0] == cpu_isa.AVX2
    if "CARPOOL_CPU_ISA" not in os.environ:
        assert cpu_isa.active_isa() == cpu_isa.supported_isas()[-1]
    assert cpu_isa.cpu_features()["avx2"]


def test_forced_isa_switches_and_restores() -> None:
    before = cpu_isa.active_isa()
    with cpu_isa.forced_isa(cpu_isa.AVX2):
        assert cpu_isa.active_isa() == cpu_isa.AVX2
    assert cpu_isa.active_isa() == before


def test_unknown_or_unsupported_isas_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown ISA"):
        cpu_isa.set_isa("sse2")
    if cpu_isa.AVX512_BF16 not in cpu_isa.supported_isas():
        with pytest.raises(ValueError, match="has no avx512_bf16"):
            cpu_isa.set_isa(cpu_isa.AVX512_BF16)


def test_the_environment_variable_pins_avx2() -> None:
    code = "from kernels import cpu_isa; print(cpu_isa.active_isa())"
    env = {**os.environ, "CARPOOL_CPU_ISA": "avx2"}
    result = subprocess.run([sys.executable, "-c", code], check=True, timeout=300, capture_output=True, text=True,
                            cwd=Path(__file__).parents[2], env=env)
    assert result.stdout.strip() == "avx2"


@needs_avx512
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_avx512_and_avx2_attention_agree_on_an_engine_shaped_decode(paged_batch, dtype) -> None:
    # SmolLM2's heads over contexts of 1..~500 keys: both paths against each other, to their
    # summation order (each is checked against the dense reference in test_cpu_paged_attention).
    seq_lens = [1, 15, 16, 17, 100, 255, 256, 257, 499]
    batch = paged_batch([1] * len(seq_lens), seq_lens, num_heads=9, num_kv_heads=3, head_dim=64, dtype=dtype)
    outputs = {}
    for isa in (cpu_isa.AVX2, cpu_isa.AVX512_BF16):  # not AMX: its decodes take the same scan
        with cpu_isa.forced_isa(isa):
            outputs[isa] = cpu_paged_attention.paged_attention_cpu(*batch.args())
    tol = 1e-6 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(outputs[cpu_isa.AVX512_BF16].float(), outputs[cpu_isa.AVX2].float(), rtol=tol, atol=tol)


ZEN5_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC

processor\t: 1
vendor_id\t: GenuineIntel
cpu family\t: 6
"""


def test_the_cpu_family_is_the_first_processors_vendor_and_family() -> None:
    assert cpu_isa.cpu_family(ZEN5_CPUINFO) == ("AuthenticAMD", 26)
    assert cpu_isa.cpu_family("processor\t: 0\nvendor_id\t: GenuineIntel\n") is None  # no family: unknown
    assert cpu_isa.cpu_family("") is None
    here = cpu_isa.cpu_family()
    assert here is None or (isinstance(here[0], str) and isinstance(here[1], int))
