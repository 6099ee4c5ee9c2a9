"""Routes a Hugging Face model's RMSNorm and gated-MLP modules through kernels' fused ops.

A decode step of a small model is dominated by op count, not arithmetic: Llama's RMSNorm is seven
torch ops and its MLP five (three projections, silu, multiply). Routed, an RMSNorm is one kernel
call and an MLP three: one projection onto gate and up together (their weights concatenated once,
the modules' own parameters becoming views into it, so memory does not grow), one silu-and-multiply,
and the down projection. As in linear_layers, only the modules' classes change, to subclasses
whose forward calls kernels' dispatchers; those fall back to torch twins off the CPU fast path.

Only the classes named below are routed: their forward is exactly the computation the fused ops
make. Other models (Gemma's 1 + weight norm, MLPs with biases or other activations) keep theirs.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from transformers.activations import SiLUActivation

from kernels import linear, rms_norm, silu_and_mul
from worker.linear_layers import packed_copy

RMS_NORM_CLASSES = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})
GATED_MLP_CLASSES = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})


class _FusedRMSNorm(nn.Module):
    weight: torch.Tensor
    variance_epsilon: float

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)


class _FusedGatedMLP(nn.Module):
    down_proj: nn.Linear
    carpool_gate_up_weight: torch.Tensor  # [2 * intermediate, hidden]: gate rows, then up rows
    carpool_packed_gate_up_weight: torch.Tensor | None = None  # its oneDNN copy (bf16, packed=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = linear(x, self.carpool_gate_up_weight, None, self.carpool_packed_gate_up_weight)
        return self.down_proj(silu_and_mul(gate_up))


@functools.cache
def _fused_class(original: type, mixin: type) -> type:
    fused = type(f"Fused{original.__name__}", (mixin, original), {})
    fused.carpool_original_class = original  # type: ignore[attr-defined]
    return fused


def _is_plain_gated_silu_mlp(module: nn.Module) -> bool:
    projections = [getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    return (all(isinstance(p, nn.Linear) and p.bias is None for p in projections)
            and isinstance(getattr(module, "act_fn", None), SiLUActivation | nn.SiLU))


def _share_gate_up_weight(module: nn.Module) -> None:
    """One [2I, H] tensor holding gate's rows then up's; the two parameters become views of it."""
    if hasattr(module, "carpool_gate_up_weight"):
        return
    gate, up = module.gate_proj.weight, module.up_proj.weight
    fused = torch.cat([gate.detach(), up.detach()])
    module.gate_proj.weight = nn.Parameter(fused[: gate.shape[0]], requires_grad=gate.requires_grad)
    module.up_proj.weight = nn.Parameter(fused[gate.shape[0]:], requires_grad=up.requires_grad)
    module.carpool_gate_up_weight = fused


def route_fused_layers(model: nn.Module, fused: bool = True, packed: bool = False) -> int:
    """Make the model's known RMSNorm and gated-MLP modules use the fused ops (or back); returns
    how many modules changed class. packed: the MLPs also keep a oneDNN-reordered copy of their
    bf16 gate/up weight (as linear_layers does). Call after the model has its final device and dtype."""
    count = 0
    for module in model.modules():
        cls = type(module)
        original = getattr(cls, "carpool_original_class", None)
        if not fused:
            if original is not None:
                module.__class__ = original
                vars(module).pop("carpool_packed_gate_up_weight", None)
                count += 1
            continue
        if original is None and cls.__name__ in RMS_NORM_CLASSES and hasattr(module, "variance_epsilon"):
            module.__class__ = _fused_class(cls, _FusedRMSNorm)
            count += 1
        elif original is None and cls.__name__ in GATED_MLP_CLASSES and _is_plain_gated_silu_mlp(module):
            _share_gate_up_weight(module)
            module.__class__ = _fused_class(cls, _FusedGatedMLP)
            count += 1
        if isinstance(module, _FusedGatedMLP):
            module.carpool_packed_gate_up_weight = packed_copy(module.carpool_gate_up_weight, packed)
    return count
