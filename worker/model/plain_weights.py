"""A routed model's linear weights held once, in their packed copies, where every product uses those.

On oneDNN's bf16 path (AVX512-BF16 without AMX tiles) a routed layer multiplies by its weight's
packed copy at every row count (kernels.linear, the C++ decoder layer), so the plain weight beside
it is a second copy of the model's linear weights that nothing reads: 202 of SmolLM2's 257 MB in
bf16 (its output embedding is the input's table), nearly all of a larger untied model's.
`release_plain_weights` puts meta tensors of the same shape and dtype in their place (a read of one
fails loudly rather than computing garbage); `restore_plain_weights` unpacks them again, the same
bits (oneDNN's reorder is a permutation), before the model is put to another use: converted,
routed again, or run by transformers' own forward. Kept: AMX tiles and fp32 copies (a long prefill
chunk, and fp32's few-row skinny kernel, multiply by the plain weight) and any weight another
module shares (a tied output embedding is the input embedding's table).
"""

from __future__ import annotations

import torch
from torch import nn

from worker.model.fused_layers import GATE_UP_PROJECTIONS, QKV_PROJECTIONS, share_rows

# The modules' attributes (linear_layers, fused_layers): the packed copy of each weight a module
# multiplies by, and that weight's name, with the projections whose parameters are views of it.
_PACKED_WEIGHTS = {
    "carpool_packed_weight": ("weight", ()),
    "carpool_packed_qkv_weight": ("carpool_qkv_weight", QKV_PROJECTIONS),
    "carpool_packed_gate_up_weight": ("carpool_gate_up_weight", GATE_UP_PROJECTIONS),
}
RELEASED_ATTRIBUTE = "carpool_released_weights"  # on a module: the packed attributes it was released for


def stands_in_for_its_weight(packed: torch.Tensor | None) -> bool:
    """A packed copy that serves every row count: oneDNN's bf16 one (not AMX tiles, not fp32)."""
    return packed is not None and packed.is_mkldnn and packed.dtype == torch.bfloat16


def release_plain_weights(model: nn.Module) -> int:
    """Replace each plain weight that only its packed copy is multiplied by, and that no other module
    shares, by a meta tensor; returns the bytes released. Call once the model is routed."""
    owners: dict[int, int] = {}
    for _, parameter in model.named_parameters(remove_duplicate=False):
        key = parameter.untyped_storage().data_ptr() if parameter.device.type != "meta" else id(parameter)
        owners[key] = owners.get(key, 0) + 1
    released = 0
    for module in model.modules():
        for packed_name, (weight_name, projections) in _PACKED_WEIGHTS.items():
            packed = vars(module).get(packed_name)
            weight = getattr(module, weight_name, None)
            if not stands_in_for_its_weight(packed) or not isinstance(weight, torch.Tensor) or weight.is_meta:
                continue
            # Its own parameter, or its projections' views of it: nothing else holds the storage.
            if owners.get(weight.untyped_storage().data_ptr(), 0) != max(1, len(projections)):
                continue
            _set_weight(module, weight_name, projections, torch.empty_like(weight, device="meta"))
            vars(module).setdefault(RELEASED_ATTRIBUTE, set()).add(packed_name)
            released += weight.numel() * weight.element_size()
    return released


def restore_plain_weights(model: nn.Module) -> int:
    """Unpack every weight release_plain_weights released; returns how many. A no-op otherwise."""
    restored = 0
    for module in model.modules():
        for packed_name in vars(module).pop(RELEASED_ATTRIBUTE, ()):
            weight_name, projections = _PACKED_WEIGHTS[packed_name]
            _set_weight(module, weight_name, projections, vars(module)[packed_name].to_dense())
            restored += 1
    return restored


def _set_weight(module: nn.Module, weight_name: str, projections: tuple[str, ...], weight: torch.Tensor) -> None:
    """module's weight_name becomes `weight`; with projections, each projection's weight becomes a
    view of its rows, in order (fused_layers' concatenated layout)."""
    if projections:
        share_rows(module, tuple(f"{name}.weight" for name in projections), weight_name, weight)
        return
    parameter = module.get_parameter(weight_name)
    setattr(module, weight_name, nn.Parameter(weight, requires_grad=parameter.requires_grad))
