"""Routes a Hugging Face model's nn.Linear layers through `kernels.linear`.

A decode step late in a batch multiplies a handful of rows by every weight; `kernels.linear`
sends such calls to the skinny CPU kernel (fp32) or to oneDNN with a weight reordered once (bf16,
`packed=True`), a fuller fp32 step to the weight's oneDNN copy too (`packed=True`), and everything
else to `F.linear`. The layers keep their parameters (tied embeddings included): only their class
changes, to a subclass whose forward calls the dispatcher, and a packed layer also holds its
reordered copy in `carpool_packed_weight`.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import linear
from kernels.cpu_packed_linear import pack_weight, warm_up

PACKED_ATTRIBUTE = "carpool_packed_weight"


class DispatchedLinear(nn.Linear):
    carpool_packed_weight: torch.Tensor | None = None  # class default: not packed

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (nn.Linear's own name)
        return linear(input, self.weight, self.bias, self.carpool_packed_weight)


def packed_copy(weight: torch.Tensor, packed: bool) -> torch.Tensor | None:
    """The packed copy of a bf16 or fp32 CPU weight when packing is asked for, else None."""
    if packed and weight.dtype in (torch.bfloat16, torch.float32) and weight.device.type == "cpu":
        return pack_weight(weight)
    return None


def route_linear_layers(model: nn.Module, dispatched: bool = True, packed: bool = False) -> int:
    """Make every plain nn.Linear of `model` a DispatchedLinear (or back); returns how many changed.
    packed: also keep a packed copy of each bf16 or fp32 weight (dropped when routed back)."""
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


def warm_up_packed_layers(model: nn.Module, max_rows: int, max_output_rows: int) -> int:
    """Have oneDNN build its primitive for every row count a step can bring, once per distinct
    packed weight shape: up to max_rows for the layers, up to max_output_rows (the sampling rows)
    for the output embedding. Returns how many shapes were warmed."""
    output_embedding = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    done: set[tuple[int, int, int]] = set()
    for module in model.modules():
        for name, packed in vars(module).items():
            if not name.startswith("carpool_packed_") or packed is None:
                continue
            rows = max_output_rows if module is output_embedding else max_rows
            key = (*packed.shape, rows)
            if key not in done and warm_up(packed, rows):
                done.add(key)
    return len(done)
