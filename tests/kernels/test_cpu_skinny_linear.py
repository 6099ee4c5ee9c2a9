"""The skinny CPU linear kernel against its twin, F.linear, and the dispatch around it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_extension, cpu_skinny_linear, dispatch, linear

needs_kernel = pytest.mark.skipif(not cpu_skinny_linear.is_available(), reason="no AVX2 or no compiler here")


def _operands(
    rows: int, in_features: int, out_features: int, seed: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator) / in_features**0.5
    bias = torch.randn(out_features, generator=generator)
    return x, weight, bias


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 16, 24, 31, 64, 95, 96])
@pytest.mark.parametrize(("in_features", "out_features"), [(576, 1536), (64, 64), (13, 7), (1536, 576), (8, 49155)])
def test_equals_f_linear(rows: int, in_features: int, out_features: int) -> None:
    # Ragged sizes too: a K tail past the 8-wide vectors, N tails past the 4-row tiles, M past 3-row tiles.
    x, weight, bias = _operands(rows, in_features, out_features, seed=rows * 1000 + in_features)
    for b in (None, bias):
        got = cpu_skinny_linear.skinny_linear(x, weight, b)
        assert got.shape == (rows, out_features)
        torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_a_row_does_not_depend_on_its_batch() -> None:
    # Each output is one dot product in a fixed order, so a sequence's logits are the same whoever
    # shares its step: bit for bit, not just close.
    x, weight, _ = _operands(7, 576, 960, seed=3)
    together = cpu_skinny_linear.skinny_linear(x, weight)
    for row in range(7):
        alone = cpu_skinny_linear.skinny_linear(x[row : row + 1].contiguous(), weight)
        assert torch.equal(alone[0], together[row])


@needs_kernel
def test_dispatch_uses_the_kernel_for_few_rows_only(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int]] = []
    extension = cpu_extension.load()  # dispatch calls the extension directly, its checks made
    original = extension.skinny_linear

    def counting(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        calls.append(tuple(x.shape))
        return original(x, weight, bias)

    monkeypatch.setattr(extension, "skinny_linear", counting)
    _, weight, bias = _operands(1, 32, 40, seed=5)
    few = torch.randn(1, dispatch.MAX_SKINNY_ROWS, 32)  # [batch, tokens, features], as in a model
    many = torch.randn(1, dispatch.MAX_SKINNY_ROWS + 1, 32)
    torch.testing.assert_close(linear(few, weight, bias), F.linear(few, weight, bias), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear(many, weight, bias), F.linear(many, weight, bias), rtol=0, atol=0)
    torch.testing.assert_close(linear(few.double(), weight.double()), F.linear(few.double(), weight.double()))
    assert calls == [(dispatch.MAX_SKINNY_ROWS, 32)]


@pytest.mark.parametrize(
    ("x", "weight", "bias", "message"),
    [
        (torch.zeros(2, 8, dtype=torch.float64), torch.zeros(4, 8), None, "x must be a float32 CPU tensor"),
        (torch.zeros(2, 8), torch.zeros(8, 4).t(), None, "weight must be contiguous"),
        (torch.zeros(2, 8), torch.zeros(4, 9), None, "x has 8 features but weight expects 9"),
        (torch.zeros(2, 2, 8), torch.zeros(4, 8), None, "must be 2-D"),
        (torch.zeros(2, 8), torch.zeros(4, 8), torch.zeros(5), r"bias must be \[4\], got \(5,\)"),
    ],
)
def test_bad_arguments_are_refused(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, message: str,
) -> None:
    with pytest.raises(ValueError, match=message):
        cpu_skinny_linear.skinny_linear(x, weight, bias)
