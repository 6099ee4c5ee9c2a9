"""skinny_linear: fp32 `x @ weight.T (+ bias)` for a few rows on AVX2 CPUs (csrc/skinny_linear.cpp).

Its twin is `torch.nn.functional.linear`, which it equals up to fp32 summation order.
"""

from __future__ import annotations

import torch

from kernels import cpu_extension


def is_available() -> bool:
    """True when the extension is built (building it now if needed) and the CPU can run it."""
    return cpu_extension.load() is not None


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [num_rows, in_features], weight: [out_features, in_features] -> [num_rows, out_features]."""
    _check_args(x, weight, bias)
    extension = cpu_extension.load()
    if extension is None:
        raise RuntimeError("the skinny_linear extension is unavailable here; check is_available() first")
    return extension.skinny_linear(x, weight, bias)


def _check_args(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    for name, tensor in (("x", x), ("weight", weight), ("bias", bias)):
        if tensor is None:
            continue
        if tensor.dtype != torch.float32 or tensor.device.type != "cpu":
            raise ValueError(f"{name} must be a float32 CPU tensor, got {tensor.dtype} on {tensor.device}")
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {tensor.stride()}")
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"x and weight must be 2-D, got shapes {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"x has {x.shape[1]} features but weight expects {weight.shape[1]}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
