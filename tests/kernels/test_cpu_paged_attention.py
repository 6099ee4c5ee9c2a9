"""The C++ CPU paged-attention kernel against the dense reference and its twin."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kernels import cpu_extension, cpu_isa, cpu_paged_attention, paged_attention, paged_attention_torch
from kernels.cpu_paged_attention import MAX_QUERY_ROWS, paged_attention_cpu

pytestmark = [pytest.mark.skipif(cpu_extension.load() is None, reason="no AVX2 or no compiler here"),
              pytest.mark.usefixtures("each_isa")]  # every test on the AVX2 and (where it runs) the AVX-512 path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 24, 64, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (9, 3), (14, 2)])
def test_mixed_batch_matches_dense(paged_batch, dense_reference, close, mixed_lens, head_dim, num_heads, num_kv_heads,
                                   dtype):
    # The mixed batch: decodes, a 20- and a 33-row chunk (on AMX, in bf16, at head_dim 64 and 128: tiles).
    # Groups of 1, 4 (the AVX2 path's three heads a pass, then one), 3 and 7 (3, 3, 1); head_dim 24:
    # a V slab of three vectors.
    batch = paged_batch(*mixed_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                        seed=head_dim, dtype=dtype)
    out = paged_attention_cpu(*batch.args())
    assert out.dtype == dtype
    close(out, dense_reference(batch), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
def test_decodes_and_short_chunks_over_shuffled_blocks(paged_batch, dense_reference, close, block_size, dtype):
    # Every sequence within the kernel's reach; unused table entries hold garbage, unowned slots NaN.
    query_lens = [1, 1, MAX_QUERY_ROWS, 3, 1, 0]
    seq_lens = [1, 300, MAX_QUERY_ROWS + 40, 3, 77, 12]
    batch = paged_batch(query_lens, seq_lens, num_heads=9, num_kv_heads=3, head_dim=64, block_size=block_size,
                        seed=block_size, dtype=dtype)
    close(paged_attention_cpu(*batch.args()), dense_reference(batch), dtype)


@pytest.mark.parametrize("head_dim", [32, 64, 80, 96, 128])
def test_bf16_is_the_fp32_result_rounded_once(paged_batch, head_dim):
    # bf16 K/V and queries are widened exactly, so the kernel's bf16 output must be its own fp32
    # output on the same (widened) values, rounded to bf16 once: nothing else rounds in between.
    # On AVX-512 a bf16 head of whole 32-element chunks sums its V rows in even and odd lanes (80:
    # the widening path; 96: a 64-element slab, then a 32-element one).
    batch = paged_batch([1, 1, 5, 2], [1, 300, 45, 77], num_heads=9, num_kv_heads=3, head_dim=head_dim,
                        dtype=torch.bfloat16)
    widened = [t.float() if t.is_floating_point() else t for t in batch.args()[:-1]]
    out32 = paged_attention_cpu(*widened, batch.scale)
    out16 = paged_attention_cpu(*batch.args())
    assert torch.equal(out16, out32.to(torch.bfloat16))


def test_padding_rows_are_zero_and_head_major_query_is_read_in_place(paged_batch, dense_reference, close, mixed_lens):
    batch = paged_batch(*mixed_lens, num_heads=4, num_kv_heads=2, extra_tokens=3)
    batch.query = batch.query.transpose(0, 1).contiguous().transpose(0, 1)  # as transformers hands it over
    out = paged_attention_cpu(*batch.args())
    assert torch.equal(out[-3:], torch.zeros_like(out[-3:]))
    close(out, dense_reference(batch), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(9, 3), (14, 2)])
def test_decodes_at_every_context_length_modulo_the_key_group(paged_batch, dense_reference, close, num_heads,
                                                              num_kv_heads, dtype):
    # Keys are scored eight (AVX2) or sixteen (AVX-512) at a time and the rest one by one; a decode's
    # scores fill its heads' rows end to end, so a group running past the context would show in
    # the next head's first score.
    seq_lens = list(range(1, 18)) + [23, 31, 47, 63, 64, 65]
    batch = paged_batch([1] * len(seq_lens), seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=64,
                        seed=num_heads, dtype=dtype)
    close(paged_attention_cpu(*batch.args()), dense_reference(batch), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dispatch_picks_the_kernel_for_fp32_and_bf16_on_cpu(paged_batch, close, mixed_lens, dtype):
    batch = paged_batch(*mixed_lens, num_heads=9, num_kv_heads=3, head_dim=64, dtype=dtype)
    assert cpu_paged_attention.is_available(batch.query)
    assert torch.equal(paged_attention(*batch.args()), paged_attention_cpu(*batch.args()))
    close(paged_attention(*batch.args()), paged_attention_torch(*batch.args()), dtype)


def test_a_table_entry_outside_the_pool_is_refused(paged_batch):
    batch = paged_batch([1], [20], block_size=16)  # uses two blocks
    batch.block_tables[0, 1] = batch.key_cache.shape[0]
    with pytest.raises(ValueError, match=r"block_tables\[0, 1\] = .* is not a block id"):
        paged_attention_cpu(*batch.args())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (9, 3)])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_long_chunks_with_and_without_earlier_positions(paged_batch, dense_reference, close, num_heads,
                                                        num_kv_heads, block_size, dtype):
    # Chunks past MAX_QUERY_ROWS go to the flash path: a whole prompt (causal from its first
    # position), chunks after a cached prefix (every earlier position, then causal), one at a
    # table's last slot, beside decodes and a short chunk; unowned slots hold NaN.
    long = MAX_QUERY_ROWS + 1
    query_lens = [long, 1, 300, long + 64, 7, 200]
    seq_lens = [long, 90, 300 + 517, long + 64 + 1, 40, 200 + 1]
    batch = paged_batch(query_lens, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=64,
                        block_size=block_size, seed=block_size + num_heads, dtype=dtype)
    out = paged_attention_cpu(*batch.args())
    close(out, dense_reference(batch), dtype)
    close(out, paged_attention_torch(*batch.args()), dtype)


def test_a_long_chunk_past_its_table_is_refused(paged_batch):  # by the kernel's own check
    batch = paged_batch([MAX_QUERY_ROWS + 1], [MAX_QUERY_ROWS + 1], block_size=16)
    batch.seq_lens[0] = batch.block_tables.shape[1] * 16 + 1
    with pytest.raises(ValueError):
        paged_attention_cpu(*batch.args())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [48, 64, 128, 288])
def test_the_kernels_take_every_bf16_chunk_with_avx512_bf16_or_amx_tiles(each_isa, dtype, head_dim):
    # The AVX-512 scan beats torch's flash attention at every chunk length without AMX, the AMX
    # tiles (whole tiles of 32 features, up to 256) with it; on AVX2 and in fp32, chunks past
    # MAX_QUERY_ROWS stay with flash.
    tiles = each_isa == cpu_isa.AMX and head_dim % 32 == 0 and head_dim <= 256
    unlimited = dtype == torch.bfloat16 and (each_isa == cpu_isa.AVX512_BF16 or tiles)
    expected = cpu_paged_attention.NO_ROW_LIMIT if unlimited else MAX_QUERY_ROWS
    assert cpu_paged_attention.max_query_rows(dtype, head_dim) == expected


@pytest.mark.parametrize(("query_lens", "seq_lens"), [
    ([700], [700]),  # one whole prompt: its rows in parts, 3 kv heads on the threads
    ([1, 333, 1, 65], [50, 333 + 901, 7, 65]),  # a long chunk after a prefix, decodes, a 65-row chunk
])
def test_long_bf16_chunks_run_in_the_kernels_with_avx512_bf16_or_amx(each_isa, paged_batch, dense_reference, close,
                                                                     query_lens, seq_lens):
    if each_isa == cpu_isa.AVX2:
        pytest.skip("on AVX2 long chunks go to torch's flash attention")
    batch = paged_batch(query_lens, seq_lens, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
                        seed=len(query_lens), dtype=torch.bfloat16)
    out = paged_attention_cpu(*batch.args())
    close(out, dense_reference(batch), torch.bfloat16)
    # The kernels alone (no limit: nothing left for flash) give exactly the same rows.
    alone = torch.zeros_like(out)
    cpu_extension.load().paged_attention_cpu(
        batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
        batch.query_start_loc, float(batch.scale), cpu_paged_attention.NO_ROW_LIMIT, alone)
    assert torch.equal(out, alone)


def _scan_sized(batch: Any, rows_per_piece: int = 15) -> tuple[Any, ...]:
    """The batch's arguments with each chunk cut into pieces of at most `rows_per_piece` rows, each
    piece a sequence of its own ending at its last row's position: the same rows, all of them short
    enough for the row-by-row scan, which computes each row on its own."""
    tables, seq_lens, starts = [], [], [0]
    for s, (rows, ctx) in enumerate(zip(batch.query_lens, batch.seq_lens_list)):
        for first in range(0, rows, rows_per_piece):
            end = min(rows, first + rows_per_piece)
            tables.append(batch.block_tables[s])
            seq_lens.append(ctx - rows + end)
            starts.append(starts[-1] + end - first)
    return (batch.query, batch.key_cache, batch.value_cache, torch.stack(tables),
            torch.tensor(seq_lens, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32), batch.scale)


@pytest.mark.parametrize(("head_dim", "num_heads", "num_kv_heads"), [(32, 4, 4), (64, 9, 3), (128, 8, 2), (96, 6, 2)])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_chunks_of_16_rows_or_more_take_the_tile_order_kernel_with_avx512_bf16_or_amx(
        each_isa, paged_batch, dense_reference, close, head_dim, num_heads, num_kv_heads, block_size):
    if each_isa == cpu_isa.AVX2:
        pytest.skip("AMX tiles or AVX512-BF16 blocks only")
    # Beside decodes and a 15-row chunk (the scan's): 16 rows after 200 positions (half a block of
    # 32 rows), 32 rows from position 0 and after 5 (a block ending mid-key-tile), 33 rows (a
    # second, one-row block), a whole 300-row prompt, and 290 rows after 700 positions (several
    # key blocks of 256), none a multiple of 32 keys; unowned cache slots hold NaN, which no tile
    # may read. head_dim 96: three vectors of 32 features (the AVX-512 V blocks' odd slab).
    query_lens = [1, 16, 15, 32, 32, 33, 300, 1, 290]
    seq_lens = [40, 16 + 200, 15 + 9, 32, 32 + 5, 33 + 100, 300, 555, 290 + 700]
    batch = paged_batch(query_lens, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                        block_size=block_size, seed=head_dim + block_size, dtype=torch.bfloat16)
    out = paged_attention_cpu(*batch.args())
    close(out, dense_reference(batch), torch.bfloat16)
    assert not out.isnan().any()
    # The chunk kernel rounds each probability to bf16 for the product with V (as flash attention
    # does); the scan keeps them in fp32: its rows are close to the scan's, not equal.
    scanned = paged_attention_cpu(*_scan_sized(batch))
    starts = batch.query_start_loc.tolist()
    for s, rows in enumerate(query_lens):
        mine, theirs = out[starts[s]:starts[s + 1]], scanned[starts[s]:starts[s + 1]]
        assert torch.equal(mine, theirs) == (rows < 16), f"sequence {s} ({rows} rows)"
        close(mine, theirs, torch.bfloat16)


def test_the_tile_order_kernel_runs_where_the_isa_has_it(each_isa):
    runs = cpu_extension.load().chunk_attention_runs
    assert [runs(d) for d in (32, 64, 96, 256, 48, 288)] == [each_isa != cpu_isa.AVX2] * 4 + [False, False]
