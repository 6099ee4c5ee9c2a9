"""Builders for the kernel tests: random ragged paged batches and a dense attention reference.

Every batch is built adversarially: physical blocks are a random permutation, unused block-table
entries hold out-of-range garbage, and every cache slot not written by a sequence holds NaN, so
any read of a slot a sequence does not own poisons the result.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PagedBatch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    keys: list[torch.Tensor]  # per sequence, un-paged: [seq_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]
    query_lens: list[int]
    seq_lens_list: list[int]
    scale: float

    def args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]:
        return (self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens,
                self.query_start_loc, self.scale)

    def to(self, device: str) -> PagedBatch:
        return PagedBatch(
            self.query.to(device), self.key_cache.to(device), self.value_cache.to(device),
            self.block_tables.to(device), self.seq_lens.to(device), self.query_start_loc.to(device),
            [k.to(device) for k in self.keys], [v.to(device) for v in self.values],
            self.query_lens, self.seq_lens_list, self.scale,
        )


def build_paged_batch(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    extra_tokens: int = 0,
    spare_table_columns: int = 1,
) -> PagedBatch:
    """A packed batch on the CPU; `extra_tokens` query rows past the last sequence are padding."""
    assert len(query_lens) == len(seq_lens) and all(0 <= q <= c for q, c in zip(query_lens, seq_lens))
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-c // block_size) for c in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    key_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    value_cache = torch.full_like(key_cache, float("nan"))
    width = max(blocks_per_seq, default=0) + spare_table_columns
    garbage = torch.tensor([-1, num_blocks + 5, 2**31 - 1], dtype=torch.int32)
    block_tables = garbage[torch.randint(0, 3, (len(seq_lens), width), generator=gen)]
    keys, values, used = [], [], 0
    for s, ctx in enumerate(seq_lens):
        blocks = perm[used:used + blocks_per_seq[s]]
        used += blocks_per_seq[s]
        block_tables[s, :len(blocks)] = blocks.to(torch.int32)
        k = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
        for i, block in enumerate(blocks.tolist()):  # positions i * block_size ... live in the i-th block
            chunk = slice(i * block_size, min(ctx, (i + 1) * block_size))
            key_cache[block, :chunk.stop - chunk.start] = k[chunk]
            value_cache[block, :chunk.stop - chunk.start] = v[chunk]
        keys.append(k)
        values.append(v)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    query = torch.randn(starts[-1] + extra_tokens, num_heads, head_dim, generator=gen).to(dtype)
    return PagedBatch(
        query, key_cache, value_cache, block_tables,
        torch.tensor(seq_lens, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32),
        keys, values, list(query_lens), list(seq_lens), head_dim ** -0.5,
    )


def dense_attention(batch: PagedBatch) -> torch.Tensor:
    """Per sequence, float64 SDPA on the un-paged K/V with an explicit causal mask; padding rows are 0."""
    num_heads = batch.query.shape[1]
    out = torch.zeros(batch.query.shape, dtype=torch.float64)
    start = 0
    for q_len, ctx, k, v in zip(batch.query_lens, batch.seq_lens_list, batch.keys, batch.values):
        if q_len:
            group = num_heads // k.shape[1]
            q = batch.query[start:start + q_len].cpu().double().transpose(0, 1)  # [heads, q_len, d]
            kk = k.cpu().double().repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, ctx, d]
            vv = v.cpu().double().repeat_interleave(group, dim=1).transpose(0, 1)
            positions = torch.arange(ctx - q_len, ctx)  # query j sits at ctx - q_len + j
            mask = torch.arange(ctx)[None, :] <= positions[:, None]
            o = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, scale=batch.scale)
            out[start:start + q_len] = o.transpose(0, 1)
        start += q_len
    return out


# Mixed batches: decode rows, prefill chunks after a cached prefix, a fresh prompt, an idle sequence.
MIXED_QUERY_LENS = [1, 7, 1, 20, 0, 1, 33]
MIXED_SEQ_LENS = [1, 40, 17, 20, 9, 64, 50]

TOLERANCE: dict[torch.dtype, float] = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.cpu().double(), expected.cpu().double(), atol=tol, rtol=tol)


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    # Tiny ops on a shared 2-core box: a second OpenMP thread that gets descheduled stalls every op.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(params=["avx2", "avx512_bf16", "amx"])
def each_isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs the test once per CPU kernel path (kernels.cpu_isa): AVX2 everywhere, AVX-512 and AMX
    where this CPU has them, so an AMX machine also covers the paths the others take."""
    from kernels import cpu_isa

    if request.param not in cpu_isa.supported_isas():
        pytest.skip(f"this CPU (or the kernels' build) has no {request.param}")
    with cpu_isa.forced_isa(request.param):
        yield request.param


@pytest.fixture()
def paged_batch() -> Callable[..., PagedBatch]:
    return build_paged_batch


@pytest.fixture()
def dense_reference() -> Callable[[PagedBatch], torch.Tensor]:
    return dense_attention


@pytest.fixture()
def close() -> Callable[[torch.Tensor, torch.Tensor, torch.dtype], None]:
    return assert_close


@pytest.fixture()
def mixed_lens() -> tuple[list[int], list[int]]:
    return list(MIXED_QUERY_LENS), list(MIXED_SEQ_LENS)
