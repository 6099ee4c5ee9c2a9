"""A decoder step's layers as one C++ call each, with the step's kernel arguments checked once.

Called op by op from Python, a Llama decoder layer is eleven kernel calls, each through a checked
dispatcher (kernels.dispatch: dtype, device, layout, the extension built) and a wrapper or two:
15-25 us of Python per call, up to 8 ms of a 16-20 ms decode step of a small model at 30 layers.
`StepOps.of` checks a step's tensors once, on its first layer, through the same checked functions;
`decoder_layer` then runs each layer in one call (csrc/decoder_layer_cpu.cpp): the same kernels in
the same order as the dispatchers, the same results bit for bit (tests/kernels/test_cpu_step_ops.py).

Steps it does not take stay with the dispatchers, op by op: a prefill chunk longer than the C++
attention takes (cpu_paged_attention.max_query_rows: torch's flash attention), and every dtype or
device the kernels do not run.
"""

from __future__ import annotations

from types import ModuleType
from typing import TypeAlias

import torch

from kernels import cpu_amx_linear, cpu_extension, cpu_layer_ops, cpu_paged_attention, cpu_skinny_linear
from kernels.arg_checks import check_paged_attention_args, check_write_kv_cache_args
from kernels.cpu_packed_linear import layer_min_rows, padded_rows
from kernels.dispatch import MAX_PACKED_FP32_ROWS, MAX_SKINNY_ROWS

# The row minimum of a step's layers where it is set (scripts/bench_step_rows.py and the tests set
# it between steps); None: this CPU's, cpu_packed_linear.layer_min_rows.
LAYER_MIN_ROWS: int | None = None

# A projection as kernels.linear takes it: weight, bias, oneDNN's packed copy of the weight.
LinearArgs: TypeAlias = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]


class StepOps:
    """One step's decoder layers on contiguous CPU activations of one dtype (fp32 or bf16).

    Callers keep to what `of` checked: activations of its dtype, contiguous rows, the caches it saw
    (every layer's caches have one shape), and the step's metadata tensors."""

    def __init__(self, extension: ModuleType, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 query_start_loc: torch.Tensor, slot_mapping: torch.Tensor, skinny: bool,
                 max_query_rows: int) -> None:
        self._ext = extension
        self._max_query_rows = max_query_rows  # cpu_paged_attention.max_query_rows, for this step
        self._block_tables, self._seq_lens, self._query_start_loc = block_tables, seq_lens, query_start_loc
        self._slot_mapping = slot_mapping
        self._max_skinny_rows = MAX_SKINNY_ROWS if skinny else 0  # fp32: kernels.linear's skinny kernel
        self._min_rows = layer_min_rows() if LAYER_MIN_ROWS is None else LAYER_MIN_ROWS

    @classmethod
    def of(cls, hidden: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, key_cache: torch.Tensor,
           value_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
           query_start_loc: torch.Tensor, slot_mapping: torch.Tensor, max_query_len: int) -> StepOps | None:
        """The ops for a step of these activations (hidden: [T, hidden], a layer's input; its q, k
        and v heads are column slices of one [T, (num_heads + 2 * num_kv_heads) * head_dim]
        projection) and caches, or None where a whole layer cannot run in one call (the kernels do
        not run these tensors, or a sequence has more query rows than the C++ attention takes): then use
        kernels.dispatch op by op. Raises ValueError on bad attention arguments, as the dispatchers do."""
        extension = cpu_extension.load()
        qkv = hidden.new_empty(hidden.shape[0], (num_heads + 2 * num_kv_heads) * head_dim)
        query, key, value = (part.unflatten(-1, (-1, head_dim)) for part in qkv.split(
            [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1))
        if (extension is None or hidden.dim() != 2 or not cpu_layer_ops.runs_here(hidden)
                or not cpu_paged_attention.is_available(query)):
            return None
        check_write_kv_cache_args(key, value, key_cache, value_cache, slot_mapping)
        check_paged_attention_args(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)
        max_query_rows = cpu_paged_attention.max_query_rows(hidden.dtype, head_dim)
        if max_query_len > max_query_rows:
            return None
        return cls(extension, block_tables.contiguous(), seq_lens.contiguous(), query_start_loc.contiguous(),
                   slot_mapping, hidden.dtype == torch.float32 and cpu_skinny_linear.is_available(),
                   max_query_rows)

    def decoder_layer(self, hidden: torch.Tensor, input_norm: torch.Tensor, input_eps: float,
                      qkv_proj: LinearArgs, o_proj: LinearArgs, post_norm: torch.Tensor, post_eps: float,
                      gate_up_proj: LinearArgs, down_proj: LinearArgs, num_heads: int, num_kv_heads: int,
                      scale: float, cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor) -> torch.Tensor:
        """A Llama decoder layer in one C++ call, as kernels' dispatchers compute it op by op:
        input norm, q/k/v projection, rotary, cache write, attention, output projection, residual
        add and norm, gate/up projection, SiLU-and-mul, down projection, residual add. Each *_proj
        is (weight, bias, packed) as kernels.linear takes them; cos, sin: contiguous [T, head_dim]."""
        return self._ext.decoder_layer_cpu(
            hidden, input_norm, input_eps, qkv_proj, o_proj, post_norm, post_eps, gate_up_proj, down_proj,
            num_heads, num_kv_heads, scale, cos, sin, key_cache, value_cache, self._slot_mapping,
            self._block_tables, self._seq_lens, self._query_start_loc, self._max_query_rows,
            padded_rows(hidden.shape[0], self._min_rows), self._max_skinny_rows, cpu_amx_linear.MAX_ROWS,
            MAX_PACKED_FP32_ROWS)
