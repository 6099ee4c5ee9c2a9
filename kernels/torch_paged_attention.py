"""paged_attention_torch: the pure-torch twin of the Triton paged-attention kernel.

It is the CPU product path and the specification the Triton kernel is tested against.

Algorithm: sequences are grouped into buckets (kernels.seq_bucket); each bucket gathers its K/V
through the block tables into a padded [count, padded_ctx, num_kv_heads, head_dim] tensor and runs
one scaled_dot_product_attention with an explicit causal + length mask. Grouped-query attention
never repeats K/V: the query heads sharing a kv head are laid out as extra query rows of that kv
head, [count, num_kv_heads, group * query_len, head_dim]. Precision: fp32 and bf16 compute in their
own dtype (torch's CPU attention accumulates in fp32); fp16 is computed in fp32 because torch's CPU
fp16 attention is an order of magnitude slower.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.arg_checks import check_paged_attention_args, check_paged_attention_lengths
from kernels.seq_bucket import SeqBucket, plan_seq_buckets


def paged_attention_torch(
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
    """Causal attention of the packed query rows over each sequence's paged K/V cache.

    The max_* hints are accepted for signature parity with the Triton launcher; the twin reads the
    lengths on the host anyway (cheap on the CPU) to plan its buckets.
    """
    check_paged_attention_args(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)
    block_size = key_cache.shape[1]
    starts: list[int] = query_start_loc.tolist()
    ctx_lens: list[int] = seq_lens.tolist()
    query_lens = [end - start for start, end in zip(starts[:-1], starts[1:])]
    check_paged_attention_lengths(query_lens, ctx_lens, starts[-1], query.shape[0], block_tables.shape[1] * block_size)
    # Rows outside every sequence (padding tokens) come back as zeros, as from the Triton kernel.
    out = torch.zeros(query.shape, dtype=query.dtype, device=query.device)
    compute_dtype = torch.float32 if query.dtype == torch.float16 and not query.is_cuda else query.dtype
    buckets = plan_seq_buckets(query_lens, ctx_lens, block_size)
    # One pair of gather buffers serves every bucket: a fresh multi-MB tensor per bucket is a fresh
    # mmap that glibc page-faults in (and zeroes) again: ~40% of a decode-64 call on the CPU.
    most_blocks = max((len(b.seq_ids) * -(-b.max_seq_len // block_size) for b in buckets), default=0)
    block_numel = block_size * key_cache.shape[2] * key_cache.shape[3]
    scratch = torch.empty((2, most_blocks, block_numel), dtype=key_cache.dtype, device=key_cache.device)
    for bucket in buckets:
        seqs = _BucketSeqs.of(bucket, starts, query_lens, ctx_lens, query.device)
        k, v = _gather_kv(key_cache, value_cache, block_tables, seqs, scratch, compute_dtype)
        attend = _attend_decode if bucket.max_query_len == 1 else _attend_prefill
        attend(out, query, k, v, seqs, scale, compute_dtype)
    return out


@dataclass(frozen=True, slots=True)
class _BucketSeqs:
    """One bucket's per-sequence numbers, as [count] int64 tensors on the query's device."""

    ids: torch.Tensor
    start: torch.Tensor  # first query row
    q_len: torch.Tensor
    ctx: torch.Tensor
    total_ctx: int
    max_query_len: int
    max_ctx: int

    @staticmethod
    def of(bucket: SeqBucket, starts: list[int], query_lens: list[int], ctx_lens: list[int],
           device: torch.device) -> _BucketSeqs:
        ids = bucket.seq_ids
        ctx = [ctx_lens[s] for s in ids]
        return _BucketSeqs(
            torch.tensor(ids, device=device), torch.tensor([starts[s] for s in ids], device=device),
            torch.tensor([query_lens[s] for s in ids], device=device), torch.tensor(ctx, device=device),
            sum(ctx), bucket.max_query_len, bucket.max_seq_len,
        )


def _gather_kv(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor, seqs: _BucketSeqs,
    scratch: torch.Tensor, compute_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's K and V, padded: two [count, num_kv_heads, padded_ctx, head_dim] views into scratch."""
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    count = seqs.ids.shape[0]
    width = -(-seqs.max_ctx // block_size)
    # Table entries past a sequence's last block may hold any value; point them at block 0.
    blocks = block_tables.index_select(0, seqs.ids)[:, :width].long()
    used = (seqs.ctx + block_size - 1) // block_size
    blocks = blocks.masked_fill(torch.arange(width, device=blocks.device) >= used[:, None], 0).flatten()
    pad_rows = None
    if count * width * block_size > seqs.total_ctx:
        is_pad = torch.arange(width * block_size, device=blocks.device) >= seqs.ctx[:, None]
        pad_rows = is_pad.flatten().nonzero().squeeze(1)
    gathered = []
    for cache, buffer in zip((key_cache, value_cache), scratch):
        rows = torch.index_select(cache.view(num_blocks, -1), 0, blocks, out=buffer[:blocks.shape[0]])
        rows = rows.view(-1, num_kv_heads * head_dim)
        if pad_rows is not None:
            # Unwritten slots may hold anything, NaN included, and 0 * NaN would leak through the mask.
            rows.index_fill_(0, pad_rows, 0)
        rows = rows.to(compute_dtype).view(count, width * block_size, num_kv_heads, head_dim)
        gathered.append(rows.transpose(1, 2))
    return gathered[0], gathered[1]


def _attend_decode(
    out: torch.Tensor, query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: _BucketSeqs, scale: float,
    compute_dtype: torch.dtype,
) -> None:
    """One query row per sequence; its query heads become `group` rows of their kv head."""
    count, num_kv_heads, padded_ctx, head_dim = k.shape
    num_heads = query.shape[1]
    q = query.index_select(0, seqs.start).view(count, num_kv_heads, num_heads // num_kv_heads, head_dim)
    mask = (torch.arange(padded_ctx, device=k.device) < seqs.ctx[:, None]).view(count, 1, 1, padded_ctx)
    o = F.scaled_dot_product_attention(q.to(compute_dtype), k, v, attn_mask=mask, scale=scale)  # [count, kv, group, d]
    out.index_copy_(0, seqs.start, o.reshape(count, num_heads, head_dim).to(out.dtype))


def _attend_prefill(
    out: torch.Tensor, query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: _BucketSeqs, scale: float,
    compute_dtype: torch.dtype,
) -> None:
    """Chunks padded to q_max rows: padded rows repeat the chunk's last row and are dropped at the end."""
    count, num_kv_heads, padded_ctx, head_dim = k.shape
    num_heads = query.shape[1]
    group, q_max = num_heads // num_kv_heads, seqs.max_query_len
    j = torch.arange(q_max, device=k.device)
    rows = seqs.start[:, None] + torch.minimum(j, seqs.q_len[:, None] - 1)  # [count, q_max]
    q_pos = seqs.ctx[:, None] - seqs.q_len[:, None] + j  # absolute position of each row
    key_pos = torch.arange(padded_ctx, device=k.device)
    allowed = (key_pos <= q_pos[:, :, None]) & (key_pos < seqs.ctx[:, None, None])  # [count, q_max, padded_ctx]
    # Row order inside a kv head is (query head, token), so the mask repeats per query head.
    mask = allowed[:, None, None].expand(count, 1, group, q_max, padded_ctx).reshape(count, 1, -1, padded_ctx)
    q = query.index_select(0, rows.flatten()).view(count, q_max, num_kv_heads, group, head_dim)
    q = q.permute(0, 2, 3, 1, 4).reshape(count, num_kv_heads, group * q_max, head_dim)
    o = F.scaled_dot_product_attention(q.to(compute_dtype), k, v, attn_mask=mask, scale=scale)
    o = o.view(count, num_kv_heads, group, q_max, head_dim).permute(0, 3, 1, 2, 4).reshape(-1, num_heads, head_dim)
    keep = (j < seqs.q_len[:, None]).flatten().nonzero().squeeze(1)
    out.index_copy_(0, rows.flatten().index_select(0, keep), o.index_select(0, keep).to(out.dtype))
