"""A routed Llama-family model's forward as one flat loop over the kernels, without the module tree.

Routed (fused_layers), a decoder layer is eleven kernel calls. Called through transformers'
module tree (nn.Module.__call__ five times a layer, the decoder layer's and the attention's
keyword plumbing, the attention interface's lookup, views made to match its [batch, heads, tokens,
head_dim] shapes), those calls cost about 190 us of Python per layer on a 2-core Xeon: 5.7 of the
21 ms a decode step of 4 sequences takes, every step, whatever the batch. This loop makes the same
kernel calls in the same order on the same tensors, so its logits equal the module tree's bit for
bit (tests/worker/model/test_decoder_loop.py), and reads each layer's weights from a record made
once.

It runs only where it reproduces the model's own forward exactly: a CausalLM of the classes below
whose decoder layers, attention blocks, MLPs and norms fused_layers routed, with paged attention.
Anything else keeps the module tree (DecoderLoop.of returns None).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from kernels import (
    StepOps,
    fused_add_rms_norm,
    linear,
    paged_attention,
    rms_norm,
    rotary_embedding,
    silu_and_mul,
    write_kv_cache,
)
from worker.model.attention_backend import AttentionMetadata
from worker.model.fused_layers import _FusedAttention, _FusedDecoderLayer, _FusedGatedMLP, _FusedRMSNorm

# CausalLM classes whose forward is embed -> rotary -> decoder layers -> norm -> rows kept -> lm_head,
# nothing else (transformers 5.24: no embedding scale, no logit soft-capping). Their decoder layers
# must also all be routed (checked per model).
CAUSAL_LM_CLASSES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"})


class _Linear(NamedTuple):
    """A projection's arguments to kernels.linear (and StepOps.decoder_layer), in their order."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    packed: torch.Tensor | None  # oneDNN's copy (bf16 CPU), else None


@dataclass(frozen=True, slots=True)
class _Layer:
    input_norm: torch.Tensor
    input_eps: float
    qkv: _Linear
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    o_proj: _Linear
    post_norm: torch.Tensor
    post_eps: float
    gate_up: _Linear
    down: _Linear


class DecoderLoop:
    """The logits of a routed model's step, computed layer by layer from records made once."""

    def __init__(self, model: nn.Module, layers: list[_Layer]) -> None:
        self._model = model
        self._layer_class = type(model.model.layers[0])
        self._layers = layers
        self._embed = model.model.embed_tokens
        self._rotary = model.model.rotary_emb
        self._norm: nn.Module = model.model.norm
        head = model.lm_head
        self._lm_head = _Linear(head.weight, head.bias, getattr(head, "carpool_packed_weight", None))

    @classmethod
    def of(cls, model: nn.Module) -> DecoderLoop | None:
        """The loop for `model` where it reproduces the model's forward, else None."""
        inner = getattr(model, "model", None)
        if (type(model).__name__ not in CAUSAL_LM_CLASSES or inner is None
                or not isinstance(getattr(inner, "norm", None), _FusedRMSNorm)
                or not isinstance(getattr(model, "lm_head", None), nn.Linear)):
            return None
        records = [_record(layer) for layer in inner.layers[: model.config.num_hidden_layers]]
        layers = [record for record in records if record is not None]
        # One head layout for all layers: a step's kernel arguments are checked once, on the first.
        if (not records or len(layers) != len(records) or not _rotates_whole_heads(model, layers)
                or len({(layer.num_heads, layer.num_kv_heads, layer.head_dim) for layer in layers}) != 1):
            return None
        return cls(model, layers)

    def is_current(self) -> bool:
        """False once the model was routed back (another runner may share it): its modules'
        classes then no longer match the records'."""
        return type(self._model.model.layers[0]) is self._layer_class

    def logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention: AttentionMetadata,
               logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids, position_ids: [num_tokens]; the logits of the rows in logits_indices:
        [num_kept, vocab_size] in the model's dtype, as the module tree computes them."""
        hidden = self._embed(input_ids)  # [T, hidden]
        cos, sin = self._rotary(hidden, position_ids.unsqueeze(0))
        first = self._layers[0]
        head_dim = first.head_dim
        cos, sin = cos.reshape(-1, head_dim).contiguous(), sin.reshape(-1, head_dim).contiguous()
        key_cache, value_cache = attention.kv_caches[0]
        # Decodes and short chunks: each layer one C++ call; longer prefill chunks op by op.
        whole_layers = StepOps.of(
            hidden, first.num_heads, first.num_kv_heads, head_dim, key_cache, value_cache, attention.block_tables,
            attention.seq_lens, attention.query_start_loc, attention.slot_mapping, attention.max_query_len)
        num_tokens = hidden.shape[0]
        for index, layer in enumerate(self._layers):
            key_cache, value_cache = attention.kv_caches[index]
            if whole_layers is not None:
                hidden = whole_layers.decoder_layer(
                    hidden, layer.input_norm, layer.input_eps, layer.qkv, layer.o_proj, layer.post_norm,
                    layer.post_eps, layer.gate_up, layer.down, layer.num_heads, layer.num_kv_heads, layer.scaling,
                    cos, sin, key_cache, value_cache)
                continue
            qkv = linear(rms_norm(hidden, layer.input_norm, layer.input_eps), *layer.qkv)  # [T, (H + 2 KV) * D]
            rotary_embedding(qkv, cos, sin, layer.num_heads + layer.num_kv_heads)
            q_width, kv_width = layer.num_heads * head_dim, layer.num_kv_heads * head_dim
            query = qkv[:, :q_width].view(num_tokens, layer.num_heads, head_dim)
            key = qkv[:, q_width:q_width + kv_width].view(num_tokens, layer.num_kv_heads, head_dim)
            value = qkv[:, q_width + kv_width:].view(num_tokens, layer.num_kv_heads, head_dim)
            write_kv_cache(key, value, key_cache, value_cache, attention.slot_mapping)
            attended = paged_attention(query, key_cache, value_cache, attention.block_tables, attention.seq_lens,
                                       attention.query_start_loc, layer.scaling, attention.max_query_len,
                                       attention.max_seq_len)
            # As _FusedDecoderLayer: the output projection's fresh tensor carries the residual stream.
            residual = linear(attended.view(num_tokens, q_width), *layer.o_proj)
            normed = fused_add_rms_norm(hidden, residual, layer.post_norm, layer.post_eps)
            hidden = linear(silu_and_mul(linear(normed, *layer.gate_up)), *layer.down).add_(residual)
        # The norm is per row: the kept rows alone give the same values as all rows, then kept.
        return linear(self._norm(hidden.index_select(0, logits_indices)), *self._lm_head)


def _record(layer: nn.Module) -> _Layer | None:
    """A routed decoder layer's weights and shapes, or None where it is not fully routed."""
    attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
    if not (isinstance(layer, _FusedDecoderLayer) and isinstance(attention, _FusedAttention)
            and isinstance(mlp, _FusedGatedMLP) and all(isinstance(norm, _FusedRMSNorm) for norm in norms)):
        return None
    input_norm, post_norm = norms
    return _Layer(
        input_norm=input_norm.weight, input_eps=input_norm.variance_epsilon,
        qkv=_Linear(attention.carpool_qkv_weight, attention.carpool_qkv_bias, attention.carpool_packed_qkv_weight),
        num_heads=attention.carpool_num_heads, num_kv_heads=attention.carpool_num_kv_heads,
        head_dim=attention.head_dim, scaling=attention.scaling,
        o_proj=_module_linear(attention.o_proj),
        post_norm=post_norm.weight, post_eps=post_norm.variance_epsilon,
        gate_up=_Linear(mlp.carpool_gate_up_weight, None, mlp.carpool_packed_gate_up_weight),
        down=_module_linear(mlp.down_proj),
    )


def _rotates_whole_heads(model: nn.Module, records: list[_Layer]) -> bool:
    """The rotary embedding spans every head dim (no partial_rotary_factor), which the fused
    attention's kernel path needs (elsewhere it falls back to the module's own forward)."""
    weight = model.model.embed_tokens.weight
    cos, _ = model.model.rotary_emb(weight[:1].unsqueeze(0), torch.zeros(1, 1, dtype=torch.long, device=weight.device))
    return all(cos.shape[-1] == record.head_dim for record in records)


def _module_linear(module: Any) -> _Linear:
    return _Linear(module.weight, module.bias, getattr(module, "carpool_packed_weight", None))
