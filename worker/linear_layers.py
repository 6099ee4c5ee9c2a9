"""Routes a Hugging Face model's nn.Linear layers through `kernels.linear`.

A decode step late in a batch multiplies a handful of rows by every weight; `kernels.linear`
sends such calls to the skinny CPU kernel (fp32) or to oneDNN with a weight reordered once (bf16,
`packed=True`), and everything else to `F.linear`. The layers keep their parameters (tied
embeddings included): only their class changes, to a subclass whose forward calls the
dispatcher, and a packed layer also holds its reordered copy in `carpool_packed_weight`.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import linear
from kernels.cpu_packed_linear import pack_weight

PACKED_ATTRIBUTE = "carpool_packed_weight"


class DispatchedLinear(nn.Linear):
    carpool_packed_weight: torch.Tensor | None = None  # class default: not packed

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (nn.Linear's own name)
        return linear(input, self.weight, self.bias, self.carpool_packed_weight)


def packed_copy(weight: torch.Tensor, packed: bool) -> torch.Tensor | None:
    """The oneDNN copy of a bf16 CPU weight when packing is asked for, else None."""
    if packed and weight.dtype == torch.bfloat16 and weight.device.type == "cpu":
        return pack_weight(weight)
    return None


def route_linear_layers(model: nn.Module, dispatched: bool = True, packed: bool = False) -> int:
    """Make every plain nn.Linear of `model` a DispatchedLinear (or back); returns how many changed.
    packed: also keep a oneDNN-reordered copy of each bf16 weight (dropped when routed back)."""
    count = 0
    for module in model.modules():
        cls = type(module)
        if cls is nn.Linear and dispatched:  # subclasses (quantized, LoRA, ...) keep their own forward
            module.__class__ = DispatchedLinear
            count += 1
        elif cls is DispatchedLinear and not dispatched:
            module.__class__ = nn.Linear
            count += 1
        if type(module) is DispatchedLinear:
            module.carpool_packed_weight = packed_copy(module.weight, packed)
        else:
            vars(module).pop(PACKED_ATTRIBUTE, None)
    return count
