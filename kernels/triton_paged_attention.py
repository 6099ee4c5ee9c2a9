"""paged_attention_triton: the Triton paged-attention kernel over a packed batch of sequences.

Imported only on demand (kernels.dispatch): importing it imports triton. Under TRITON_INTERPRET=1,
set before this module is first imported, the kernel runs on CPU tensors through Triton's
interpreter; that is how CPU CI tests it against the torch twin.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.arg_checks import check_paged_attention_args

_LOG2E = 1.4426950408889634
_MIN_DOT = 16  # tl.dot needs every block dimension >= 16


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,
    block_tables_ptr,  # [num_seqs, max_num_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    scale_log2,  # softmax scale * log2(e): the kernel works in base 2
    num_seqs,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_c_block,
    stride_c_slot,
    stride_c_head,
    stride_bt_seq,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # query tokens per program; a tile row is one (token, query head) pair
    BLOCK_N: tl.constexpr,  # cached keys per inner iteration
    DOT_FP32: tl.constexpr,  # upcast tl.dot operands (see _needs_fp32_dot)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 so results match the twin; tf32 would not
):
    # One program: BLOCK_Q query tokens of one sequence x the GROUP query heads of one kv head,
    # i.e. a [BLOCK_Q * GROUP_PAD, HEAD_PAD] tile, with an online softmax over the cached keys.
    # Programs are numbered per sequence from query_start_loc[s] // BLOCK_Q + s, which leaves every
    # sequence at least cdiv(query_len, BLOCK_Q) numbers without any host-side bookkeeping.
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)

    # Find the sequence: the last s with query_start_loc[s] // BLOCK_Q + s <= pid.
    lo = pid * 0
    hi = lo + num_seqs - 1  # a tensor even when triton specialises num_seqs == 1 to a constant
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(first <= pid, mid, lo)
        hi = tl.where(first <= pid, hi, mid - 1)
    seq = lo
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = pid - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return
    ctx = tl.load(seq_lens_ptr + seq)

    offs_m = tl.arange(0, BLOCK_Q * GROUP_PAD)
    tok = q_block * BLOCK_Q + offs_m // GROUP_PAD  # token index within the sequence
    head = kv_head * GROUP + offs_m % GROUP_PAD
    row_ok = (tok < q_len) & (offs_m % GROUP_PAD < GROUP)
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(query_ptr + q_rows[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    pos = ctx - q_len + tok  # absolute position of each row; it sees keys 0..pos

    # Finite start so fully masked tiles give exp2(-inf - m) = 0, never NaN.
    m_i = tl.full([BLOCK_Q * GROUP_PAD], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_PAD], dtype=tl.float32)
    kv_end = ctx - q_len + tl.minimum(q_len, (q_block + 1) * BLOCK_Q)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    for kv_start in range(0, kv_end, BLOCK_N):
        offs_n = kv_start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_end
        block = tl.load(table + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        slot = block * stride_c_block + (offs_n % BLOCK_SIZE) * stride_c_slot + kv_head * stride_c_head
        # Masked loads: slots past seq_len are never read, whatever they hold.
        k = tl.load(key_cache_ptr + slot[None, :] + offs_d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # [rows, BLOCK_N]
        s = tl.where((offs_n[None, :] <= pos[:, None]) & n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(value_cache_ptr + slot[:, None] + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_FP32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _is_interpreted() -> bool:
    # TRITON_INTERPRET is read once, when @triton.jit runs; the kernel object records the answer.
    return not isinstance(_paged_attention_kernel, triton.runtime.JITFunction)


def _needs_fp32_dot(dtype: torch.dtype) -> bool:
    # Triton 3.9's interpreter multiplies bf16 tiles as their raw uint16 bits. Upcasting is exact
    # (a bf16 x bf16 product fits in fp32), so the interpreted kernel still matches the compiled one.
    return _is_interpreted() and dtype == torch.bfloat16


def _check_device(query: torch.Tensor) -> None:
    if not query.is_cuda and not _is_interpreted():
        raise ValueError(f"paged_attention_triton needs CUDA tensors (query is on {query.device}); "
                         "CPU tensors need TRITON_INTERPRET=1 set before triton is imported")


def tile_constants(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, long_queries: bool
) -> dict[str, int | bool | str]:
    """The kernel's constexpr arguments for one input layout (public so tests can compile it ahead of time)."""
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    head_pad = max(_MIN_DOT, triton.next_power_of_2(head_dim))
    # Decode rows want small tiles (one token per sequence), prefill chunks larger ones.
    rows = 64 if long_queries else _MIN_DOT
    dot_fp32 = _needs_fp32_dot(dtype)
    return {
        "BLOCK_SIZE": block_size, "HEAD_DIM": head_dim, "HEAD_PAD": head_pad, "GROUP": group, "GROUP_PAD": group_pad,
        "BLOCK_Q": max(1, rows // group_pad), "BLOCK_N": 64 if head_pad <= 64 else 32, "DOT_FP32": dot_fp32,
        # tf32 would not match the twin in fp32; for 16-bit operands the setting is ignored.
        "DOT_PRECISION": "ieee" if dtype == torch.float32 or dot_fp32 else "tf32",
    }


def paged_attention_triton(
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
    """Same contract as kernels.paged_attention_torch. The hints only choose tile sizes: no host sync, ever."""
    check_paged_attention_args(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)
    _check_device(query)
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    num_seqs = block_tables.shape[0]
    # Rows outside every sequence come back as zeros, as from the twin.
    out = torch.zeros((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    long_queries = (max_query_len if max_query_len is not None else num_tokens // num_seqs) > 1
    constants = tile_constants(query.dtype, num_heads, num_kv_heads, head_dim, block_size, long_queries)
    # Enough programs for every sequence's query tiles under the numbering the kernel decodes.
    grid = (num_tokens // constants["BLOCK_Q"] + num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](
        out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        scale * _LOG2E, num_seqs,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        **constants,
    )
    return out
