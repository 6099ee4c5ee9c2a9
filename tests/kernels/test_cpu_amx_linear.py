"""bf16 linear on AMX tiles (kernels.cpu_amx_linear) against its twin, F.linear on the plain weight;
the tile layout against a torch permute of the weight; and where pack_weight picks it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_amx_linear, cpu_isa, linear
from kernels.cpu_packed_linear import pack_weight, packed_linear

needs_amx = pytest.mark.skipif(cpu_isa.AMX not in cpu_isa.supported_isas(),
                               reason="this CPU (or its OS, or the compiler) offers no AMX tiles")


def within_one_rounding(out: torch.Tensor, reference: torch.Tensor) -> bool:
    """Both accumulate in fp32 and round to bf16 once; only the order of the fp32 additions
    differs, so an output may sit one bf16 step (or the accumulated fp32 error) from the other."""
    step = torch.finfo(torch.bfloat16).eps * reference.float().abs().clamp_min(1.0)
    return bool(((out.float() - reference.float()).abs() <= step).all())


def tiles_of(weight: torch.Tensor) -> torch.Tensor:
    """The tile order written with torch: tile (n/16, k/32), row r, pair j = w[16 nb + j, 32 kb + 2r + (0, 1)]."""
    n, k = weight.shape
    return weight.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).reshape(n // 16, k // 32, 16, 32)


@needs_amx
@pytest.mark.parametrize("shape", [(32, 32), (96, 64), (960, 576), (576, 1536)])
def test_the_tiles_hold_the_weight_in_tdpbf16ps_pairs(shape: tuple[int, int]) -> None:
    weight = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[0])).bfloat16()
    assert torch.equal(cpu_amx_linear.pack(weight), tiles_of(weight))


@needs_amx
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 31, 32, 33, 64, 100, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_amx_linear_equals_f_linear_up_to_one_rounding(rows: int, with_bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows)
    weight = (torch.randn(96, 576, generator=generator) * 0.05).bfloat16()
    bias = torch.randn(96, generator=generator).bfloat16() if with_bias else None
    x = torch.randn(1, rows, 576, generator=generator).bfloat16()  # [batch, tokens, features], as a model hands it
    out = cpu_amx_linear.amx_linear(x, cpu_amx_linear.pack(weight), bias)
    assert out.shape == (1, rows, 96) and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert within_one_rounding(out, F.linear(x.float(), weight.float(), None if bias is None else bias.float()))


@needs_amx
def test_a_rows_result_does_not_depend_on_the_other_rows() -> None:
    # The engine's greedy tokens must not change with who else is in the batch.
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(64, 128, generator=generator).bfloat16()
    packed = cpu_amx_linear.pack(weight)
    x = torch.randn(70, 128, generator=generator).bfloat16()
    together = cpu_amx_linear.amx_linear(x, packed)
    alone = torch.cat([cpu_amx_linear.amx_linear(x[i:i + 1], packed) for i in range(70)])
    assert torch.equal(together, alone)
    assert torch.equal(cpu_amx_linear.amx_linear(x[33:], packed), together[33:])


@needs_amx
def test_pack_weight_takes_amx_tiles_where_they_run_and_onednn_elsewhere() -> None:
    weight = torch.randn(64, 64).bfloat16()
    x = torch.randn(9, 64).bfloat16()
    packed = pack_weight(weight)
    assert cpu_amx_linear.is_packed(packed) and torch.equal(packed, tiles_of(weight))
    assert torch.equal(linear(x, weight, None, packed), packed_linear(x, packed))
    assert torch.equal(packed_linear(x, packed), cpu_amx_linear.amx_linear(x, packed))
    with cpu_isa.forced_isa(cpu_isa.AVX512_BF16):  # pinned below AMX: oneDNN's reorder, bit-equal to F.linear
        onednn = pack_weight(weight)
        assert not cpu_amx_linear.is_packed(onednn)
        assert torch.equal(packed_linear(x, onednn), F.linear(x, weight))
    # A shape the tiles do not take (out_features not a multiple of 32) stays with oneDNN.
    odd = torch.randn(48, 64).bfloat16()
    assert not cpu_amx_linear.is_packed(pack_weight(odd))


@needs_amx
def test_kernels_linear_gives_amx_tiles_up_to_max_rows_and_onednn_past_them(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    amx = cpu_amx_linear.amx_linear
    monkeypatch.setattr(cpu_amx_linear, "amx_linear", lambda x, *args: calls.append(x.shape[0]) or amx(x, *args))
    generator = torch.Generator().manual_seed(3)
    weight = (torch.randn(64, 96, generator=generator) / 96 ** 0.5).bfloat16()
    packed = pack_weight(weight)
    few = torch.randn(cpu_amx_linear.MAX_ROWS, 96, generator=generator).bfloat16()
    assert torch.equal(linear(few, weight, None, packed), amx(few, packed)) and calls == [cpu_amx_linear.MAX_ROWS]
    many = torch.randn(cpu_amx_linear.MAX_ROWS + 1, 96, generator=generator).bfloat16()
    assert torch.equal(linear(many, weight, None, packed), F.linear(many, weight)) and len(calls) == 1


@needs_amx
def test_no_rows_give_an_empty_result() -> None:
    packed = cpu_amx_linear.pack(torch.randn(32, 32).bfloat16())
    out = cpu_amx_linear.amx_linear(torch.empty(0, 32, dtype=torch.bfloat16), packed)
    assert out.shape == (0, 32)


@needs_amx
def test_bad_arguments_are_refused_by_name() -> None:
    packed = cpu_amx_linear.pack(torch.randn(64, 32).bfloat16())
    with pytest.raises(ValueError, match="multiples of 32"):
        cpu_amx_linear.pack(torch.randn(48, 32).bfloat16())
    with pytest.raises(ValueError, match="multiples of 32"):
        cpu_amx_linear.pack(torch.randn(64, 40).bfloat16())
    with pytest.raises(ValueError, match="2-D bf16 CPU weight"):
        cpu_amx_linear.pack(torch.randn(64, 32))
    with pytest.raises(ValueError, match="x has 40 features but the packed weight expects 32"):
        cpu_amx_linear.amx_linear(torch.randn(3, 40).bfloat16(), packed)
    with pytest.raises(ValueError, match="x must be a bf16 CPU tensor"):
        cpu_amx_linear.amx_linear(torch.randn(3, 32), packed)
    with pytest.raises(ValueError, match=r"bias must be a CPU tensor of shape \[64\]"):
        cpu_amx_linear.amx_linear(torch.randn(3, 32).bfloat16(), packed, torch.randn(63).bfloat16())


def test_amx_is_refused_where_the_cpu_lacks_it() -> None:
    if cpu_isa.AMX in cpu_isa.supported_isas() or not cpu_isa.supported_isas():
        pytest.skip("this CPU runs AMX (or no C++ kernels are built)")
    assert not cpu_amx_linear.is_available()
    with pytest.raises(ValueError, match="has no amx"):
        cpu_isa.set_isa(cpu_isa.AMX)
