"""paged_attention_cpu: the C++ CPU paged-attention kernel (csrc/paged_attention_cpu.cpp), fp32 or
bf16 (computed in fp32, rounded once at the output).

Same signature and results as its twin, `paged_attention_torch`. Sequences with up to
`max_query_rows` query rows in the step are computed by the C++ kernels straight from the paged
cache: decodes and short chunks always; every bf16 chunk on AVX512-BF16 and on AMX (chunks of 16
rows or more in csrc/chunk_attention.cpp: AMX tiles, or VDPBF16PS blocks in tile order without AMX;
shorter ones the row-by-row scan). Longer prefill chunks, elsewhere, are GEMMs for torch's CPU
flash attention.

A long chunk is the last `q` of a sequence's `ctx` positions, so its mask is causal aligned to
the bottom right: every row sees the `ctx - q` positions before the chunk, then the chunk's own
positions causally. torch's `is_causal` aligns to the top left, so the twin passes an explicit
mask, and a masked flash attention computes every block of it: a 2,048-row chunk spent two
thirds of its attention time on the mask and on blocks above the diagonal (a 1,400-token prompt
prefilled at 2,335 tokens/s against 4,384 for 256-token ones). Here each long chunk is two
unmasked flash calls, the positions before it and the chunk itself with `is_causal` (which skips
the blocks above the diagonal), merged by their log-sum-exps: the same attention, 1.2-2.6x faster
per call (README, "The whole serving path", long prompts).
"""

from __future__ import annotations

import torch

from kernels import cpu_extension, cpu_isa
from kernels.arg_checks import check_paged_attention_args

# Past this many rows a sequence's attention is a GEMM, which torch's flash attention does better
# (these crossover figures were measured against the twin's SDPA, before the flash path). Below,
# the twin's per-sequence gathers and calls cost more than the kernel's row-by-row scan: a
# 2,048-token prefill step of 47 prompts of 43 tokens took 379 ms with 16 here and 295 ms with 64
# (SmolLM2, bf16, 2-core Xeon with AMX; fp32 on the AVX2 path: 1,068 against 946 ms with 128); 16
# prompts of 128 tokens 363 against 321 ms with 128; 4 prompts of 512 tokens 457 ms with 16, 454
# with 128, 565 with 512 (the crossover).
MAX_QUERY_ROWS = 128
# In bf16, the C++ kernels take every chunk where they beat torch's flash attention at every length
# measured (README, "The whole serving path", long prompts): without AMX (ISA avx512_bf16) the
# row-by-row scan (VDPBF16PS; a long chunk's rows dealt out to the threads in parts), one layer's
# attention, 9 heads over 3, on a 2-vCPU Zen 4 EPYC, 3.1x at 256 rows, 1.8x at 512, 1.3x at 1,024,
# 1.2x at 1,400, 1.1x at 2,048. Since the VDPBF16PS blocks of csrc/chunk_attention.cpp took the
# chunks of 16 rows or more from it (for a head_dim that is a multiple of 32; other heads keep the
# scan), 2.9x the scan again at 512 and 1,400 rows on a Zen 5 EPYC. With AMX the tiles of
# csrc/chunk_attention.cpp, on a 2-core Xeon 1.65x at 256, 1.5x at 1,024, 1.45x at 1,400 and 2,048
# (the same shapes; flash runs on AMX tiles too there, and beats the scan 3.5x at 1,400 rows).
# AVX2 and fp32 keep the flash path.
NO_ROW_LIMIT = 1 << 30


def max_query_rows(dtype: torch.dtype, head_dim: int) -> int:
    """The most query rows of one sequence the C++ kernels take, for queries of `dtype` and
    `head_dim` with the ISA the kernels run with now; longer chunks go to torch's flash attention."""
    if dtype == torch.bfloat16:
        isa = cpu_isa.active_isa()  # "amx" only where the extension is built and loaded
        # The tiles' own test of a head's size (csrc/chunk_attention.cpp), not a copy of it.
        if isa == cpu_isa.AVX512_BF16 or (isa == cpu_isa.AMX and cpu_extension.load().chunk_attention_runs(head_dim)):
            return NO_ROW_LIMIT
    return MAX_QUERY_ROWS


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
    most_rows = max_query_rows(query.dtype, query.shape[-1])
    # The kernel checks lengths and block ids itself (ValueError): no host round trip per layer here.
    cpu_extension.load().paged_attention_cpu(
        query, key_cache, value_cache, block_tables.contiguous(), seq_lens.contiguous(),
        query_start_loc.contiguous(), float(scale), most_rows, out,
    )
    if max_query_len is None or max_query_len > most_rows:
        starts: list[int] = query_start_loc.tolist()
        long_seqs = [s for s in range(len(starts) - 1) if starts[s + 1] - starts[s] > most_rows]
        if long_seqs:
            ctx_lens: list[int] = seq_lens.tolist()
            for s in long_seqs:
                _attend_long_chunk(out, query, key_cache, value_cache, block_tables[s], ctx_lens[s],
                                   starts[s], starts[s + 1], scale)
    return out


# torch's CPU flash attention, with the log-sum-exp of each row that SDPA does not return (an aten
# op since torch 2.2; grouped-query attention built in: query head h reads kv head h // group).
_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _attend_long_chunk(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor, block_row: torch.Tensor, ctx: int, start: int,
                       end: int, scale: float) -> None:
    """Rows start..end of `query`: the sequence's last end - start positions, over its `ctx`
    (its lengths and block ids already checked by the C++ kernel's call, for every sequence)."""
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    blocks = block_row[:-(-ctx // block_size)].long()
    # [ctx, kv heads, d] -> [1, kv heads, ctx, d]: views of one gather each.
    k = key_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:ctx].permute(1, 0, 2)[None]
    v = value_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:ctx].permute(1, 0, 2)[None]
    q = query[start:end].permute(1, 0, 2)[None]  # [1, heads, rows, d]
    before = ctx - (end - start)
    chunk, chunk_lse = _FLASH(q, k[:, :, before:], v[:, :, before:], 0.0, True, scale=scale)[:2]
    if before > 0:
        earlier, earlier_lse = _FLASH(q, k[:, :, :before], v[:, :, :before], 0.0, False, scale=scale)[:2]
        # softmax over both key ranges: each part's output weighted by its share of the exp-sum.
        most = torch.maximum(chunk_lse, earlier_lse)
        w_chunk, w_earlier = (chunk_lse - most).exp_(), (earlier_lse - most).exp_()
        total = w_chunk + w_earlier
        chunk = (chunk.float() * (w_chunk / total)[..., None]).addcmul_(
            earlier.float(), (w_earlier / total)[..., None])
    out[start:end] = chunk[0].permute(1, 0, 2).to(out.dtype)
