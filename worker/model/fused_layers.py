"""Routes a Hugging Face model's RMSNorm, gated-MLP, attention and decoder-layer modules through kernels' fused ops.

A decode step of a small model is dominated by op count, not arithmetic: Llama's RMSNorm is seven
torch ops, its MLP five (three projections, silu, multiply) and its attention block some twenty
around the attention itself (three projections, views, fourteen for the rotary embedding).
Routed, an RMSNorm is one kernel call; an MLP three: one projection onto gate and up together,
one silu-and-multiply, the down projection; an attention block one projection onto q, k and v
together, one in-place rotary kernel, then the attention function transformers' AttentionInterface
names (Carpool's paged attention in the engine) and the output projection; a decoder layer adds
the attention's output to the residual stream and normalises it in one call (fused_add_rms_norm).
Concatenated weights
are made once, and the modules' own parameters become views into them, so memory does not grow.
As in linear_layers, only the modules' classes change, to subclasses whose forward calls kernels'
dispatchers; those fall back to torch twins off the CPU fast path.

Only the classes named below are routed: their forward is exactly the computation the fused ops
make. Other models (Gemma's 1 + weight norm, MLPs with biases or other activations, Qwen3's q/k
norms) keep theirs.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch
from torch import nn
from transformers.activations import SiLUActivation
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kernels import fused_add_rms_norm, linear, rms_norm, rotary_embedding, silu_and_mul
from worker.model.linear_layers import packed_copy

RMS_NORM_CLASSES = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})
GATED_MLP_CLASSES = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})
# Attention blocks with separate q/k/v projections and Llama's rotate-half rotary embedding, and
# where each passes a sliding window to the attention function (as their own forward does).
# Decoder layers whose forward is Llama's pre-norm block: norm, attention, residual add, norm, MLP,
# residual add (transformers 5.24: Llama, Mistral, Qwen2 and Qwen3 have the same forward).
DECODER_LAYER_CLASSES = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer",
                                   "Qwen3DecoderLayer"})
ATTENTION_CLASSES = {
    "LlamaAttention": lambda module: None,
    "MistralAttention": lambda module: getattr(module.config, "sliding_window", None),
    "Qwen2Attention": lambda module: module.sliding_window,
}


class _FusedRMSNorm(nn.Module):
    weight: torch.Tensor
    variance_epsilon: float

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)


class _FusedGatedMLP(nn.Module):
    down_proj: nn.Linear
    carpool_gate_up_weight: torch.Tensor  # [2 * intermediate, hidden]: gate rows, then up rows
    carpool_packed_gate_up_weight: torch.Tensor | None = None  # its packed copy (packed=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = linear(x, self.carpool_gate_up_weight, None, self.carpool_packed_gate_up_weight)
        return self.down_proj(silu_and_mul(gate_up))


class _FusedAttention(nn.Module):
    config: Any
    head_dim: int
    scaling: float
    o_proj: nn.Linear
    carpool_qkv_weight: torch.Tensor  # [(H + 2 * KV) * head_dim, hidden]: q rows, then k, then v
    carpool_qkv_bias: torch.Tensor | None
    carpool_packed_qkv_weight: torch.Tensor | None = None  # its packed copy (packed=True)
    carpool_num_heads: int
    carpool_num_kv_heads: int

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        original = type(self).carpool_original_class  # type: ignore[attr-defined]
        cos, sin = position_embeddings
        # Transformers' own KV cache (a plain generate), or a rotary embedding over part of each
        # head (partial_rotary_factor): the module's own forward.
        if cache is not None or cos.shape[-1] != self.head_dim:
            return original.forward(self, hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
        input_shape = hidden_states.shape[:-1]
        num_heads, num_kv_heads, head_dim = self.carpool_num_heads, self.carpool_num_kv_heads, self.head_dim
        # qkv: [..., (H + 2 * KV) * head_dim]; the q and k heads are rotated in place.
        qkv = linear(hidden_states, self.carpool_qkv_weight, self.carpool_qkv_bias, self.carpool_packed_qkv_weight)
        rotary_embedding(qkv.view(-1, qkv.shape[-1]), cos.reshape(-1, head_dim), sin.reshape(-1, head_dim),
                         num_heads + num_kv_heads)
        query, key, value = (
            part.unflatten(-1, (-1, head_dim)).transpose(-3, -2)  # [..., heads, tokens, head_dim] views
            for part in qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        )
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, _eager_attention(original))
        sliding_window = ATTENTION_CLASSES[original.__name__](self)
        output, weights = attention(
            self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling,
            sliding_window=sliding_window, **kwargs,
        )
        return self.o_proj(output.reshape(*input_shape, -1).contiguous()), weights


class _FusedDecoderLayer(nn.Module):
    """The block's first residual add and the norm after it in one kernel call (fused_add_rms_norm),
    the second add in place: three calls around attention and MLP where the original makes four,
    and two fewer [tokens, hidden] tensors allocated."""

    self_attn: nn.Module
    mlp: nn.Module
    input_layernorm: nn.Module
    post_attention_layernorm: nn.Module

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        attended, _ = self.self_attn(
            hidden_states=self.input_layernorm(hidden_states), attention_mask=attention_mask,
            position_ids=position_ids, cache=cache, use_cache=use_cache,
            position_embeddings=position_embeddings, **kwargs,
        )
        # The residual stream is carried in `attended`, the output projection's fresh tensor, not in
        # hidden_states: a caller may hold the layer's input (output_hidden_states). bf16 and fp32
        # addition commute, so attended + hidden_states rounds as the original's residual + attended.
        norm = self.post_attention_layernorm
        normed = fused_add_rms_norm(hidden_states, attended, norm.weight, norm.variance_epsilon)
        return self.mlp(normed).add_(attended)


@functools.cache
def _eager_attention(original: type) -> Any:
    """The architecture's own eager attention, which its forward falls back to by the same rule."""
    return sys.modules[original.__module__].eager_attention_forward


@functools.cache
def _fused_class(original: type, mixin: type) -> type:
    fused = type(f"Fused{original.__name__}", (mixin, original), {})
    fused.carpool_original_class = original  # type: ignore[attr-defined]
    return fused


def _is_plain_gated_silu_mlp(module: nn.Module) -> bool:
    projections = [getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    return (all(isinstance(p, nn.Linear) and p.bias is None for p in projections)
            and isinstance(getattr(module, "act_fn", None), SiLUActivation | nn.SiLU))


def _is_plain_rotary_attention(module: nn.Module) -> bool:
    projections = [getattr(module, name, None) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
    return (all(isinstance(p, nn.Linear) for p in projections)
            and len({p.bias is None for p in projections[:3]}) == 1  # q, k, v: all with bias or none
            and not hasattr(module, "q_norm") and not hasattr(module, "k_norm")
            and isinstance(getattr(module, "head_dim", None), int))


# The projections whose rows a fused module's concatenated weight holds, in its order.
QKV_PROJECTIONS = ("q_proj", "k_proj", "v_proj")
GATE_UP_PROJECTIONS = ("gate_proj", "up_proj")


def _concatenate(module: nn.Module, names: tuple[str, ...], attribute: str) -> torch.Tensor:
    """One tensor holding the named parameters' rows in order; each parameter becomes a view of it.
    Stored under `attribute` on module; made again only where the parameters are no longer its
    views (`model.to(dtype)` gives them new storage and leaves a plain attribute behind)."""
    parameters = [module.get_parameter(name) for name in names]
    cached = vars(module).get(attribute)
    if cached is not None and parameters[0].dtype == cached.dtype and parameters[0].data_ptr() == cached.data_ptr():
        return cached
    fused = torch.cat([p.detach() for p in parameters])
    share_rows(module, names, attribute, fused)
    return fused


def share_rows(module: nn.Module, names: tuple[str, ...], attribute: str, fused: torch.Tensor) -> None:
    """Store `fused` under `attribute` on module and make each named parameter a view of its rows,
    in order (each keeps its row count and requires_grad)."""
    start = 0
    for name in names:
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        parameter = owner.get_parameter(leaf)
        rows = parameter.shape[0]
        setattr(owner, leaf, nn.Parameter(fused[start:start + rows], requires_grad=parameter.requires_grad))
        start += rows
    setattr(module, attribute, fused)


def _share_gate_up_weight(module: nn.Module) -> None:
    """One [2I, H] tensor holding gate's rows then up's."""
    _concatenate(module, tuple(f"{n}.weight" for n in GATE_UP_PROJECTIONS), "carpool_gate_up_weight")


def _share_qkv_weight(module: nn.Module) -> None:
    """One [(H + 2 * KV) * head_dim, hidden] tensor holding q's rows, then k's, then v's (and their
    biases likewise, where they have them)."""
    _concatenate(module, tuple(f"{n}.weight" for n in QKV_PROJECTIONS), "carpool_qkv_weight")
    if module.q_proj.bias is not None:
        _concatenate(module, tuple(f"{n}.bias" for n in QKV_PROJECTIONS), "carpool_qkv_bias")
    else:
        module.carpool_qkv_bias = None
    module.carpool_num_heads = module.q_proj.out_features // module.head_dim
    module.carpool_num_kv_heads = module.k_proj.out_features // module.head_dim


def _is_plain_decoder_layer(module: nn.Module) -> bool:
    norm = getattr(module, "post_attention_layernorm", None)
    return (all(isinstance(getattr(module, name, None), nn.Module) for name in ("self_attn", "mlp", "input_layernorm"))
            and type(norm).__name__.removeprefix("Fused") in RMS_NORM_CLASSES and hasattr(norm, "variance_epsilon"))


def route_fused_layers(model: nn.Module, fused: bool = True, packed: bool = False) -> int:
    """Make the model's known RMSNorm, gated-MLP, attention and decoder-layer modules use the fused ops (or back);
    returns how many modules changed class. packed: the MLPs and attention blocks also keep a
    oneDNN-reordered copy of their concatenated bf16 weight (as linear_layers does). Call after the
    model has its final device and dtype."""
    count = 0
    for module in model.modules():
        cls = type(module)
        original = getattr(cls, "carpool_original_class", None)
        if not fused:
            if original is not None:
                module.__class__ = original
                vars(module).pop("carpool_packed_gate_up_weight", None)
                vars(module).pop("carpool_packed_qkv_weight", None)
                count += 1
            continue
        if original is None and cls.__name__ in RMS_NORM_CLASSES and hasattr(module, "variance_epsilon"):
            module.__class__ = _fused_class(cls, _FusedRMSNorm)
            count += 1
        elif original is None and cls.__name__ in GATED_MLP_CLASSES and _is_plain_gated_silu_mlp(module):
            _share_gate_up_weight(module)
            module.__class__ = _fused_class(cls, _FusedGatedMLP)
            count += 1
        elif original is None and cls.__name__ in ATTENTION_CLASSES and _is_plain_rotary_attention(module):
            _share_qkv_weight(module)
            module.__class__ = _fused_class(cls, _FusedAttention)
            count += 1
        elif original is None and cls.__name__ in DECODER_LAYER_CLASSES and _is_plain_decoder_layer(module):
            module.__class__ = _fused_class(cls, _FusedDecoderLayer)
            count += 1
        # Routed before: share again, in case the model changed dtype or device since (a no-op otherwise).
        if isinstance(module, _FusedGatedMLP):
            _share_gate_up_weight(module)
            module.carpool_packed_gate_up_weight = packed_copy(module.carpool_gate_up_weight, packed)
            _drop_packed_copies(module.gate_proj, module.up_proj)
        elif isinstance(module, _FusedAttention):
            _share_qkv_weight(module)
            module.carpool_packed_qkv_weight = packed_copy(module.carpool_qkv_weight, packed)
            _drop_packed_copies(module.q_proj, module.k_proj, module.v_proj)
    return count


def _drop_packed_copies(*projections: nn.Module) -> None:
    """The fused module multiplies by its concatenated weight: its projections' own oneDNN copies
    (made by linear_layers.route_linear_layers) would only take memory."""
    for projection in projections:
        if "carpool_packed_weight" in vars(projection):
            projection.carpool_packed_weight = None
