"""bf16 linear on a weight oneDNN reordered once, against F.linear on the plain weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_packed_linear, linear
from kernels.cpu_packed_linear import PAD_ABOVE_ROWS, pack_weight, packed_linear, row_buckets

# The engine packs only where oneDNN multiplies bf16 natively; elsewhere it may refuse the reorder.
needs_fast_bf16 = pytest.mark.skipif(not cpu_packed_linear.runs_fast_here(), reason="no AVX512-BF16 or AMX here")


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


def test_row_buckets_are_exact_up_to_64_then_multiples_of_8() -> None:
    assert row_buckets(10) == list(range(1, 11))
    assert row_buckets(100) == [*range(1, 65), 72, 80, 88, 96, 104]
    assert row_buckets(512)[-1] == 512 and len(row_buckets(512)) == 64 + 56


def test_row_buckets_coarsen_past_512_so_a_large_budget_fits_the_primitive_cache() -> None:
    assert row_buckets(700) == [*row_buckets(512), 576, 640, 704]
    assert len(row_buckets(4096)) == 64 + 56 + 56  # five weight shapes: 880 of oneDNN's 1,024


def test_pack_weight_refuses_what_it_cannot_pack() -> None:
    with pytest.raises(ValueError, match="2-D bf16 CPU weight"):
        pack_weight(torch.randn(4, 4))
    with pytest.raises(ValueError, match="2-D bf16 CPU weight"):
        pack_weight(torch.randn(4).bfloat16())


def test_runs_fast_here_matches_the_cpu_features() -> None:
    expected = torch.backends.mkldnn.is_available() and (
        torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())
    assert cpu_packed_linear.runs_fast_here() == expected
