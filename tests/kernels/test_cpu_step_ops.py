"""StepOps (kernels/cpu_step_ops.py): a whole decoder layer in one call equals the layer made of
kernels' checked dispatchers bit for bit, and the checks it makes once per step refuse what the
dispatchers refuse."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import StepOps, cpu_extension, cpu_isa, cpu_step_ops
from kernels.cpu_packed_linear import MIN_LAYER_ROWS, pack_weight, packs_fp32_here, runs_fast_here
from kernels.cpu_paged_attention import MAX_QUERY_ROWS

pytestmark = pytest.mark.skipif(cpu_extension.load() is None, reason="the C++ CPU kernels are not built here")

HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 4, 2, 16, 64
BLOCK_SIZE, NUM_BLOCKS = 4, 320
# Long enough a sum that MKL's sgemm and oneDNN round the down projection differently (at 96 they
# agreed to the bit): a layer that took the wrong one of them fails the bit-for-bit check.
INTERMEDIATE = 320
# (dtype, whether the projections carry a packed copy), as the engine routes them (worker/model/routing.py).
WEIGHTS = [pytest.param((torch.float32, False), id="fp32"),
           pytest.param((torch.float32, True), id="fp32-packed", marks=pytest.mark.skipif(
               not packs_fp32_here(), reason="packed fp32 weights need oneDNN on AVX2 or better")),
           pytest.param((torch.bfloat16, True), id="bf16", marks=pytest.mark.skipif(
               not runs_fast_here(), reason="packed bf16 weights need AVX512-BF16 or AMX"))]


def _step(dtype: torch.dtype, query_lens: list[int], seq_lens: list[int]) -> dict:
    """A paged step: sequence s has seq_lens[s] positions, the last query_lens[s] of them new."""
    generator = torch.Generator().manual_seed(0)
    tokens = sum(query_lens)
    blocks_per_seq = max(-(-n // BLOCK_SIZE) for n in seq_lens)
    tables = torch.randperm(NUM_BLOCKS, generator=generator)[: len(seq_lens) * blocks_per_seq]
    tables = tables.view(len(seq_lens), blocks_per_seq).to(torch.int32)
    slots = [int(tables[s, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
             for s, (q, n) in enumerate(zip(query_lens, seq_lens)) for p in range(n - q, n)]
    cache_shape = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    return {
        "hidden": torch.randn(tokens, HIDDEN, generator=generator).to(dtype),
        "key_cache": torch.randn(cache_shape, generator=generator).to(dtype),
        "value_cache": torch.randn(cache_shape, generator=generator).to(dtype),
        "block_tables": tables, "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "query_start_loc": torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32),
        "slot_mapping": torch.tensor(slots, dtype=torch.int64), "max_query_len": max(query_lens),
    }


def _ops(step: dict) -> StepOps | None:
    return StepOps.of(step["hidden"], HEADS, KV_HEADS, HEAD_DIM, step["key_cache"], step["value_cache"],
                      step["block_tables"], step["seq_lens"], step["query_start_loc"], step["slot_mapping"],
                      step["max_query_len"])


def test_no_ops_for_what_the_kernels_do_not_run() -> None:
    step = _step(torch.float32, [1, 1], [4, 6])
    assert _ops({**step, "hidden": step["hidden"].half()}) is None  # fp16
    assert _ops({**step, "hidden": step["hidden"].t()}) is None  # not contiguous


def test_bad_attention_arguments_are_refused_once_per_step() -> None:
    step = _step(torch.float32, [1, 1], [4, 6])
    with pytest.raises(ValueError, match="key_cache dtype"):
        _ops({**step, "key_cache": step["key_cache"].double(), "value_cache": step["value_cache"].double()})
    with pytest.raises(ValueError, match="slot_mapping"):
        _ops({**step, "slot_mapping": step["slot_mapping"].to(torch.int32)})


def _per_op_layer(hidden: torch.Tensor, layer: dict, cos: torch.Tensor, sin: torch.Tensor,
                  key_cache: torch.Tensor, value_cache: torch.Tensor, step: dict) -> torch.Tensor:
    """The decoder layer through kernels' dispatchers, op by op, as worker/model/decoder_loop.py makes it."""
    tokens = hidden.shape[0]
    qkv = kernels.linear(kernels.rms_norm(hidden, layer["input_norm"], 1e-5), *layer["qkv"])
    kernels.rotary_embedding(qkv, cos, sin, HEADS + KV_HEADS)
    query, key, value = (part.unflatten(-1, (-1, HEAD_DIM)) for part in qkv.split(
        [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1))
    kernels.write_kv_cache(key, value, key_cache, value_cache, step["slot_mapping"])
    attended = kernels.paged_attention(query, key_cache, value_cache, step["block_tables"], step["seq_lens"],
                                       step["query_start_loc"], 0.25, step["max_query_len"],
                                       int(step["seq_lens"].max()))
    residual = kernels.linear(attended.view(tokens, -1), *layer["o_proj"])
    normed = kernels.fused_add_rms_norm(hidden, residual, layer["post_norm"], 1e-6)
    activated = kernels.silu_and_mul(kernels.linear(normed, *layer["gate_up"]))
    return kernels.linear(activated, *layer["down"]).add_(residual)


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize(("query_lens", "seq_lens"), [
    # Three decodes: in one call oneDNN gets them padded to MIN_LAYER_ROWS, op by op not: the same bits.
    ([1, 1, 1], [9, 5, 30]), ([3, 1, 16], [9, 5, 30]), ([1] * 70, [1 + i % 5 for i in range(70)]),
    # Past the skinny kernel's rows (kernels.dispatch.MAX_SKINNY_ROWS): fp32's packed copy.
    ([1] * 150, [1 + i % 7 for i in range(150)]),
    # More rows than kernels.linear gives AMX tiles (cpu_amx_linear.MAX_ROWS) or fp32's packed copy
    # (kernels.dispatch.MAX_PACKED_FP32_ROWS): oneDNN or MKL on the plain weight.
    ([MAX_QUERY_ROWS] * 9, [MAX_QUERY_ROWS + 3] * 9),
], ids=["decodes", "chunks", "70-padded", "150-past-skinny", "past-amx-rows"])
def test_a_whole_layer_in_one_call_equals_the_layer_op_by_op(weights: tuple[torch.dtype, bool],
                                                               query_lens: list[int], seq_lens: list[int],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # The padding as a Zen 4 does it (cpu_packed_linear.layer_min_rows), whatever CPU runs the test.
    monkeypatch.setattr(cpu_step_ops, "LAYER_MIN_ROWS", MIN_LAYER_ROWS)
    _check_whole_layer(*weights, query_lens, seq_lens)


def test_a_long_bf16_chunk_is_a_whole_layer_step_on_avx512_bf16() -> None:
    # Without AMX the C++ attention takes every bf16 chunk (cpu_paged_attention.max_query_rows),
    # so a step with a long prefill chunk is one call a layer too.
    if cpu_isa.AVX512_BF16 not in cpu_isa.supported_isas() or not runs_fast_here():
        pytest.skip("needs AVX512-BF16")
    with cpu_isa.forced_isa(cpu_isa.AVX512_BF16):
        _check_whole_layer(torch.bfloat16, True, [1, 300], [7, 320])


def _check_whole_layer(dtype: torch.dtype, packed: bool, query_lens: list[int], seq_lens: list[int]) -> None:
    step = _step(dtype, query_lens, seq_lens)
    ops = _ops(step)
    assert ops is not None
    generator = torch.Generator().manual_seed(2)

    def projection(rows: int, columns: int, bias: bool = False) -> tuple:
        weight = (torch.randn(rows, columns, generator=generator) / columns ** 0.5).to(dtype)
        return (weight, torch.randn(rows, generator=generator).to(dtype) if bias else None,
                pack_weight(weight) if packed else None)

    layer = {"input_norm": torch.rand(HIDDEN, generator=generator).to(dtype) + 0.5,
             "post_norm": torch.rand(HIDDEN, generator=generator).to(dtype) + 0.5,
             "qkv": projection((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN, bias=True),
             "o_proj": projection(HIDDEN, HEADS * HEAD_DIM), "gate_up": projection(2 * INTERMEDIATE, HIDDEN),
             "down": projection(HIDDEN, INTERMEDIATE)}
    hidden = step["hidden"]
    cos, sin = torch.randn(2, hidden.shape[0], HEAD_DIM, generator=generator).to(dtype)
    caches = [(step["key_cache"].clone(), step["value_cache"].clone()) for _ in range(2)]
    expected = _per_op_layer(hidden, layer, cos, sin, *caches[0], step)
    got = ops.decoder_layer(hidden, layer["input_norm"], 1e-5, layer["qkv"], layer["o_proj"], layer["post_norm"],
                            1e-6, layer["gate_up"], layer["down"], HEADS, KV_HEADS, 0.25, cos, sin, *caches[1])
    assert got.shape == hidden.shape and torch.equal(got, expected)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


def test_a_long_prefill_chunk_is_not_a_whole_layer_step() -> None:
    assert _ops(_step(torch.float32, [1, MAX_QUERY_ROWS], [4, MAX_QUERY_ROWS + 4])) is not None
    assert _ops(_step(torch.float32, [1, MAX_QUERY_ROWS + 1], [4, MAX_QUERY_ROWS + 4])) is None
