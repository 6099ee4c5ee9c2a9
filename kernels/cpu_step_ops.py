"""A decoder step's per-layer CPU kernel calls with their checks made once per step, not per call.

The dispatchers in kernels.dispatch check every call's tensors (dtype, device, layout, the
extension built) and then reach the C++ kernel through a wrapper or two: 15-25 us of Python per
call, eleven calls a layer, 30 layers a step: up to 8 ms of a 16-20 ms decode step of a small model.
A decoder loop's calls repeat the same dtype, device and layout on every layer, so `StepOps.of`
checks them once, on the step's first layer, through those same checked functions, and the
methods then call the extension directly on tensors of that step (the same kernels, the same
results, bit for bit; tests/kernels/test_cpu_step_ops.py).

What stays with the dispatchers: prefill chunks longer than the C++ attention's MAX_QUERY_ROWS
(their twin path), and every dtype or device the kernels do not run.
"""

from __future__ import annotations

from types import ModuleType
from typing import TypeAlias

import torch

from kernels import cpu_extension, cpu_layer_ops, cpu_packed_linear, cpu_paged_attention, cpu_skinny_linear
from kernels.arg_checks import check_paged_attention_args, check_write_kv_cache_args
from kernels.cpu_packed_linear import padded_rows
from kernels.dispatch import MAX_SKINNY_ROWS

# A projection as linear takes it: weight, bias, oneDNN's packed copy of the weight.
LinearArgs: TypeAlias = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]


class StepOps:
    """The kernels of one step on contiguous CPU activations of one dtype (fp32 or bf16).

    Callers keep to what `of` checked: activations of its dtype, contiguous rows (q, k, v may be
    column slices of one contiguous qkv projection), the caches it saw (every layer's caches have
    one shape), and the step's metadata tensors."""

    def __init__(self, extension: ModuleType, dtype: torch.dtype, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, query_start_loc: torch.Tensor, slot_mapping: torch.Tensor,
                 attention_in_kernel: bool) -> None:
        self._ext = extension
        self.dtype = dtype
        self._block_tables, self._seq_lens, self._query_start_loc = block_tables, seq_lens, query_start_loc
        self._slot_mapping = slot_mapping
        # Every sequence's query rows fit the C++ attention (decodes, short chunks).
        self._attention_in_kernel = attention_in_kernel
        self._skinny = dtype == torch.float32 and cpu_skinny_linear.is_available()

    @classmethod
    def of(cls, hidden: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, key_cache: torch.Tensor,
           value_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
           query_start_loc: torch.Tensor, slot_mapping: torch.Tensor, max_query_len: int) -> StepOps | None:
        """The ops for a step of these activations (hidden: [T, hidden], a layer's input; its q, k
        and v heads are column slices of one [T, (num_heads + 2 * num_kv_heads) * head_dim]
        projection) and caches, or None where the kernels do not run them (then use
        kernels.dispatch). Raises ValueError on bad attention arguments, as the dispatchers do."""
        extension = cpu_extension.load()
        qkv = hidden.new_empty(hidden.shape[0], (num_heads + 2 * num_kv_heads) * head_dim)
        query, key, value = (part.unflatten(-1, (-1, head_dim)) for part in qkv.split(
            [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1))
        if (extension is None or hidden.dim() != 2 or not cpu_layer_ops.runs_here(hidden)
                or not cpu_paged_attention.is_available(query)):
            return None
        check_write_kv_cache_args(key, value, key_cache, value_cache, slot_mapping)
        check_paged_attention_args(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)
        return cls(extension, hidden.dtype, block_tables.contiguous(), seq_lens.contiguous(),
                   query_start_loc.contiguous(), slot_mapping,
                   max_query_len <= cpu_paged_attention.MAX_QUERY_ROWS)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out = torch.empty_like(x)
        self._ext.rms_norm_cpu(x, weight, eps, out)
        return out

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> torch.Tensor:
        out = torch.empty_like(x)
        self._ext.fused_add_rms_norm_cpu(x, residual, weight, eps, out)
        return out

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
        self._ext.silu_and_mul_cpu(gate_up, out)
        return out

    def rotary_embedding(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int) -> None:
        """cos, sin: contiguous [T, head_dim] of the step's dtype."""
        self._ext.rotary_embedding_cpu(qkv, cos, sin, num_heads)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               packed: torch.Tensor | None) -> torch.Tensor:
        """x: [rows, in] -> [rows, out], as kernels.linear computes it."""
        rows = x.shape[0]
        if packed is not None:
            if padded_rows(rows) == rows:
                return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
            return cpu_packed_linear.packed_linear(x, packed, bias)
        if (self._skinny and 0 < rows <= MAX_SKINNY_ROWS and weight.is_contiguous()
                and (bias is None or bias.is_contiguous())):
            return self._ext.skinny_linear(x, weight, bias)
        return torch.nn.functional.linear(x, weight, bias)

    def write_kv_cache(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor) -> None:
        self._ext.write_kv_cache_cpu(key, value, key_cache, value_cache, self._slot_mapping)

    @property
    def runs_whole_layers(self) -> bool:
        """decoder_layer runs this step: every sequence's query rows fit the C++ attention."""
        return self._attention_in_kernel

    def decoder_layer(self, hidden: torch.Tensor, input_norm: torch.Tensor, input_eps: float,
                      qkv_proj: LinearArgs, o_proj: LinearArgs, post_norm: torch.Tensor, post_eps: float,
                      gate_up_proj: LinearArgs, down_proj: LinearArgs, num_heads: int, num_kv_heads: int,
                      scale: float, cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor) -> torch.Tensor:
        """A Llama decoder layer in one C++ call (csrc/decoder_layer_cpu.cpp), as these methods compute
        it op by op: input norm, q/k/v projection, rotary, cache write, attention, output projection,
        residual add and norm, gate/up projection, SiLU-and-mul, down projection, residual add.
        Each *_proj is (weight, bias, packed) as linear takes them. Only where runs_whole_layers."""
        return self._ext.decoder_layer_cpu(
            hidden, input_norm, input_eps, qkv_proj, o_proj, post_norm, post_eps, gate_up_proj, down_proj,
            num_heads, num_kv_heads, scale, cos, sin, key_cache, value_cache, self._slot_mapping,
            self._block_tables, self._seq_lens, self._query_start_loc, cpu_paged_attention.MAX_QUERY_ROWS,
            padded_rows(hidden.shape[0]), MAX_SKINNY_ROWS if self._skinny else 0)

    def paged_attention(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        scale: float, max_query_len: int, max_seq_len: int) -> torch.Tensor:
        if not self._attention_in_kernel:  # long prefill chunks: the twin's batched SDPA, checked
            return cpu_paged_attention.paged_attention_cpu(
                query, key_cache, value_cache, self._block_tables, self._seq_lens, self._query_start_loc,
                scale, max_query_len, max_seq_len)
        out = torch.zeros(query.shape, dtype=query.dtype)  # rows outside every sequence stay zero
        self._ext.paged_attention_cpu(query, key_cache, value_cache, self._block_tables, self._seq_lens,
                                      self._query_start_loc, scale, cpu_paged_attention.MAX_QUERY_ROWS, out)
        return out

