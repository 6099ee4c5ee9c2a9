"""Routes a Hugging Face model's nn.Linear layers through `kernels.linear`.

A decode step late in a batch multiplies a handful of rows by every weight; `kernels.linear`
sends such calls to the skinny CPU kernel and everything else to `F.linear`. The layers keep
their parameters (tied embeddings included): only their class changes, to a subclass whose
forward calls the dispatcher.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import linear


class DispatchedLinear(nn.Linear):
    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (nn.Linear's own name)
        return linear(input, self.weight, self.bias)


def route_linear_layers(model: nn.Module, dispatched: bool = True) -> int:
    """Make every plain nn.Linear of `model` a DispatchedLinear (or back); returns how many changed."""
    source, target = (nn.Linear, DispatchedLinear) if dispatched else (DispatchedLinear, nn.Linear)
    count = 0
    for module in model.modules():
        if type(module) is source:  # subclasses (quantized, LoRA, ...) keep their own forward
            module.__class__ = target
            count += 1
    return count
