"""paged_attention_cpu: the C++ CPU paged-attention kernel (csrc/paged_attention_cpu.cpp), fp32 or
bf16 (computed in fp32, rounded once at the output).

Same signature and results as its twin, `paged_attention_torch`. Sequences with up to
MAX_QUERY_ROWS query rows in the step (decodes, short chunks) are computed by the kernel straight
from the paged cache; longer prefill chunks go to the twin, whose batched SDPA is faster there.
"""

from __future__ import annotations

import torch

from kernels import cpu_extension
from kernels.arg_checks import check_paged_attention_args
from kernels.torch_paged_attention import paged_attention_torch

# Past this many rows a sequence's attention is a GEMM, which SDPA in the twin does better. Below,
# the twin's per-sequence gathers and calls cost more than the kernel's row-by-row scan: a
# 2,048-token prefill step of 47 prompts of 43 tokens took 379 ms with 16 here and 295 ms with 64
# (SmolLM2, bf16, 2-core Xeon with AMX; fp32 on the AVX2 path: 1,068 against 946 ms with 128); 16
# prompts of 128 tokens 363 against 321 ms with 128; 4 prompts of 512 tokens 457 ms with 16, 454
# with 128, 565 with 512 (the crossover).
MAX_QUERY_ROWS = 128


def is_available(query: torch.Tensor) -> bool:
    """True where the kernel runs this query: fp32 or bf16 on an AVX2 CPU, head_dim a multiple of 8."""
    return (query.dtype in (torch.float32, torch.bfloat16) and query.device.type == "cpu"
            and query.shape[-1] % 8 == 0 and cpu_extension.load() is not None)


def paged_attention_cpu(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """Causal attention of the packed query rows over each sequence's paged K/V cache (see kernels.paged_attention)."""
    check_paged_attention_args(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)
    if not is_available(query):
        raise ValueError("paged_attention_cpu needs float32 or bfloat16 CPU tensors, head_dim % 8 == 0 "
                         "and the built extension")
    out = torch.zeros(query.shape, dtype=query.dtype)  # rows outside every sequence stay zero, as in the twin
    # The kernel checks lengths and block ids itself (ValueError): no host round trip per layer here.
    cpu_extension.load().paged_attention_cpu(
        query, key_cache, value_cache, block_tables.contiguous(), seq_lens.contiguous(),
        query_start_loc.contiguous(), float(scale), MAX_QUERY_ROWS, out,
    )
    if max_query_len is None or max_query_len > MAX_QUERY_ROWS:
        starts: list[int] = query_start_loc.tolist()
        long_seqs = [s for s in range(len(starts) - 1) if starts[s + 1] - starts[s] > MAX_QUERY_ROWS]
        if long_seqs:
            _attend_long_with_twin(out, query, key_cache, value_cache, block_tables, seq_lens, starts, long_seqs, scale)
    return out


def _attend_long_with_twin(
    out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, starts: list[int], long_seqs: list[int], scale: float,
) -> None:
    rows = torch.cat([torch.arange(starts[s], starts[s + 1]) for s in long_seqs])
    lens = [starts[s + 1] - starts[s] for s in long_seqs]
    sub_starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_ids = torch.tensor(long_seqs)
    sub_out = paged_attention_torch(
        query.index_select(0, rows), key_cache, value_cache, block_tables.index_select(0, seq_ids),
        seq_lens.index_select(0, seq_ids), sub_starts, scale,
    )
    out.index_copy_(0, rows, sub_out)
