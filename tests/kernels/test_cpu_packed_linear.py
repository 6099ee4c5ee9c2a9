"""bf16 and fp32 linear on a weight oneDNN reordered once, against F.linear on the plain weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_packed_linear, linear
from kernels.cpu_packed_linear import (
    MIN_LAYER_ROWS,
    PAD_ABOVE_ROWS,
    pack_weight,
    packed_linear,
    padded_rows,
    row_buckets,
    warm_up,
)
from kernels.dispatch import MAX_PACKED_FP32_ROWS, MAX_SKINNY_ROWS

# The engine packs only where oneDNN multiplies bf16 natively; elsewhere it may refuse the reorder.
needs_fast_bf16 = pytest.mark.skipif(not cpu_packed_linear.runs_fast_here(), reason="no AVX512-BF16 or AMX here")
needs_fp32_packing = pytest.mark.skipif(not cpu_packed_linear.packs_fp32_here(),
                                        reason="no oneDNN or no AVX2 here")


@needs_fast_bf16
@pytest.mark.parametrize("rows", [1, 7, PAD_ABOVE_ROWS, PAD_ABOVE_ROWS + 1, 70, 100, 257, 513, 700])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_equals_f_linear_to_the_bit(rows: int, with_bias: bool) -> None:
    # Rows past PAD_ABOVE_ROWS are padded to a multiple of 8: the padding must not show.
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=generator).bfloat16()
    bias = torch.randn(96, generator=generator).bfloat16() if with_bias else None
    x = torch.randn(1, rows, 40, generator=generator).bfloat16()  # [batch, tokens, features], as a model hands it
    out = packed_linear(x, pack_weight(weight), bias)
    assert out.shape == (1, rows, 96) and out.is_contiguous()
    assert torch.equal(out, F.linear(x, weight, bias))


@needs_fast_bf16
def test_dispatch_takes_the_packed_weight_for_bf16_cpu_inputs() -> None:
    weight = torch.randn(16, 8).bfloat16()
    x = torch.randn(3, 8).bfloat16()
    assert torch.equal(linear(x, weight, None, pack_weight(weight)), F.linear(x, weight))


def test_a_layer_in_one_call_pads_fewer_rows_than_min_layer_rows_and_packed_linear_does_not() -> None:
    assert [padded_rows(rows, MIN_LAYER_ROWS) for rows in range(1, 8)] == [5, 5, 5, 5, 5, 6, 7]
    assert [padded_rows(rows) for rows in range(1, 8)] == list(range(1, 8))
    assert padded_rows(70, MIN_LAYER_ROWS) == padded_rows(70) == 72


@pytest.mark.parametrize(("family", "fast_bf16", "amx", "expected"), [
    (("AuthenticAMD", 25), True, False, MIN_LAYER_ROWS),  # Zen 4: measured faster padded
    (("AuthenticAMD", 26), True, False, 1),  # Zen 5: measured slower padded
    (("AuthenticAMD", 25), False, False, 1),  # Zen 3: no AVX512-BF16, bf16 does not run fast
    (("GenuineIntel", 6), True, True, 1),  # AMX tiles take the rows as they are
    (("GenuineIntel", 6), True, False, 1),  # not measured: no padding
    (None, True, False, 1),  # no /proc/cpuinfo
])
def test_the_layers_pad_few_rows_only_on_a_zen_4(family: tuple[str, int] | None, fast_bf16: bool, amx: bool,
                                                 expected: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_packed_linear.cpu_isa, "cpu_family", lambda: family)
    monkeypatch.setattr(cpu_packed_linear, "runs_fast_here", lambda: fast_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    cpu_packed_linear.layer_min_rows.cache_clear()
    try:
        assert cpu_packed_linear.layer_min_rows() == expected
    finally:
        cpu_packed_linear.layer_min_rows.cache_clear()


def test_row_buckets_are_exact_up_to_64_then_multiples_of_8() -> None:
    assert row_buckets(10) == list(range(1, 11))
    assert row_buckets(100) == [*range(1, 65), 72, 80, 88, 96, 104]
    assert row_buckets(512)[-1] == 512 and len(row_buckets(512)) == 64 + 56


def test_row_buckets_coarsen_past_512_so_a_large_budget_fits_the_primitive_cache() -> None:
    assert row_buckets(700) == [*row_buckets(512), 576, 640, 704]
    assert len(row_buckets(4096)) == 64 + 56 + 56  # five weight shapes: 880 of oneDNN's 1,024


def test_pack_weight_refuses_what_it_cannot_pack() -> None:
    with pytest.raises(ValueError, match="2-D bf16 or fp32 CPU weight"):
        pack_weight(torch.randn(4, 4).half())
    with pytest.raises(ValueError, match="2-D bf16 or fp32 CPU weight"):
        pack_weight(torch.randn(4).bfloat16())
    with pytest.raises(ValueError, match="2-D bf16 or fp32 CPU weight"):
        pack_weight(torch.randn(4, 4, 4))


@needs_fp32_packing
@pytest.mark.parametrize("rows", [MAX_SKINNY_ROWS + 1, 100, 128, 203, MAX_PACKED_FP32_ROWS])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_fp32_linear_agrees_with_f_linear_and_its_padding_never_shows(rows: int, with_bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=generator)
    bias = torch.randn(96, generator=generator) if with_bias else None
    x = torch.randn(1, rows, 40, generator=generator)
    packed = pack_weight(weight)
    out = packed_linear(x, packed, bias)
    assert out.shape == (1, rows, 96) and out.is_contiguous()
    # oneDNN sums in another order than MKL: fp32 rounding apart, no more.
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    # Rows past PAD_ABOVE_ROWS go in padded to a multiple of 8: the real rows' bits are those of
    # the unpadded call.
    unpadded = torch.ops.mkldnn._linear_pointwise(x[0], packed, bias, "none", [], "")
    assert torch.equal(out[0], unpadded)


@needs_fp32_packing
def test_dispatch_sends_fp32_to_the_packed_copy_only_between_the_skinny_rows_and_its_limit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(64, 32, generator=generator)
    bias = torch.randn(64, generator=generator)
    packed = pack_weight(weight)
    calls = []

    def spied(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        calls.append(x.shape[0])
        return packed_linear(x, packed, bias)

    monkeypatch.setattr(cpu_packed_linear, "packed_linear", spied)
    for rows in (1, MAX_SKINNY_ROWS, MAX_SKINNY_ROWS + 1, MAX_PACKED_FP32_ROWS, MAX_PACKED_FP32_ROWS + 1):
        x = torch.randn(rows, 32, generator=generator)
        torch.testing.assert_close(linear(x, weight, bias, packed), F.linear(x, weight, bias),
                                   rtol=1e-5, atol=1e-5)
    assert calls == [MAX_SKINNY_ROWS + 1, MAX_PACKED_FP32_ROWS]
    # No copy given: F.linear.
    linear(torch.randn(128, 32), weight, bias)
    assert calls == [MAX_SKINNY_ROWS + 1, MAX_PACKED_FP32_ROWS]


@needs_fp32_packing
def test_an_fp32_copy_is_not_warmed_up() -> None:
    # Its primitives are built as steps bring their row counts (warm_up's docstring says why).
    assert warm_up(pack_weight(torch.randn(16, 8)), max_rows=300) is False


def test_packs_fp32_here_matches_the_cpu_features() -> None:
    expected = torch.backends.mkldnn.is_available() and torch.backends.cpu.get_cpu_capability() in (
        "AVX2", "AVX512")
    assert cpu_packed_linear.packs_fp32_here() == expected


def test_runs_fast_here_matches_the_cpu_features() -> None:
    expected = torch.backends.mkldnn.is_available() and (
        torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())
    assert cpu_packed_linear.runs_fast_here() == expected
