"""Both paths reject malformed inputs before doing any work, with a ValueError naming the argument."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kernels import paged_attention_torch, write_kv_cache_torch


def _launchers() -> list[tuple[Callable[..., object], Callable[..., object]]]:
    pairs: list[tuple[Callable[..., object], Callable[..., object]]] = [(paged_attention_torch, write_kv_cache_torch)]
    try:
        from kernels.triton_kv_cache_write import write_kv_cache_triton
        from kernels.triton_paged_attention import paged_attention_triton
    except (ImportError, RuntimeError):
        return pairs
    return pairs + [(paged_attention_triton, write_kv_cache_triton)]


LAUNCHERS = _launchers()
LAUNCHER_IDS = ["torch", "triton"][: len(LAUNCHERS)]
Args = dict[str, torch.Tensor]


def _head_dim_strided(t: torch.Tensor) -> torch.Tensor:
    """Same values, but head_dim (the last dim) no longer has stride 1."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def _not_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(0, 1).contiguous().transpose(0, 1)


def _attention_args(paged_batch) -> Args:
    b = paged_batch([1, 3], [5, 9], num_heads=4, num_kv_heads=2, head_dim=16)
    return {"query": b.query, "key_cache": b.key_cache, "value_cache": b.value_cache, "block_tables": b.block_tables,
            "seq_lens": b.seq_lens, "query_start_loc": b.query_start_loc, "scale": b.scale}


ATTENTION_BREAKAGES: list[tuple[str, Callable[[Args], None], str]] = [
    ("query_fp64", lambda a: a.update(query=a["query"].double()), "query dtype"),
    ("query_not_cache_dtype", lambda a: a.update(query=a["query"].to(torch.bfloat16)), "query dtype"),
    ("query_rank", lambda a: a.update(query=a["query"].flatten(1)), "query must be"),
    ("query_head_dim", lambda a: a.update(query=a["query"][:, :, :8]), "query head_dim"),
    ("query_heads", lambda a: a.update(query=a["query"][:, :3]), "num_kv_heads"),
    ("query_strides", lambda a: a.update(query=_head_dim_strided(a["query"])), "query must be contiguous"),
    ("cache_rank", lambda a: a.update(key_cache=a["key_cache"].flatten(0, 1)), "key_cache must be"),
    ("cache_shapes", lambda a: a.update(value_cache=a["value_cache"][:-1]), "value_cache shape"),
    ("cache_dtypes", lambda a: a.update(value_cache=a["value_cache"].half()), "value_cache dtype"),
    ("cache_contiguous", lambda a: a.update(key_cache=_not_contiguous(a["key_cache"])), "key_cache must be contig"),
    ("block_tables_dtype", lambda a: a.update(block_tables=a["block_tables"].long()),
     "block_tables must be torch.int32"),
    ("block_tables_rank", lambda a: a.update(block_tables=a["block_tables"].flatten()), "block_tables must have 2"),
    ("seq_lens_dtype", lambda a: a.update(seq_lens=a["seq_lens"].long()), "seq_lens must be torch.int32"),
    ("seq_lens_count", lambda a: a.update(seq_lens=a["seq_lens"][:1]), "seq_lens has 1"),
    ("query_start_loc_count", lambda a: a.update(query_start_loc=a["query_start_loc"][:2]),
     "query_start_loc must have"),
    ("query_start_loc_strided", lambda a: a.update(query_start_loc=a["query_start_loc"].repeat_interleave(2)[::2]),
     "query_start_loc must be contiguous"),
]


@pytest.mark.parametrize(("attention", "_write"), LAUNCHERS, ids=LAUNCHER_IDS)
@pytest.mark.parametrize(("case", "breakage", "message"), ATTENTION_BREAKAGES, ids=[c[0] for c in ATTENTION_BREAKAGES])
def test_paged_attention_rejects(paged_batch, attention, _write, case, breakage, message):
    args = _attention_args(paged_batch)
    breakage(args)
    with pytest.raises(ValueError, match=message):
        attention(**args)


def _write_args() -> Args:
    cache = torch.zeros(4, 8, 2, 16)
    return {"key": torch.zeros(5, 2, 16), "value": torch.zeros(5, 2, 16), "key_cache": cache,
            "value_cache": cache.clone(), "slot_mapping": torch.arange(5)}


WRITE_BREAKAGES: list[tuple[str, Callable[[Args], None], str]] = [
    ("key_dtype", lambda a: a.update(key=a["key"].half()), "key dtype"),
    ("value_shape", lambda a: a.update(value=a["value"][:, :1]), "value must be"),
    ("token_counts", lambda a: a.update(value=a["value"][:4]), "value has 4 tokens"),
    ("key_strides", lambda a: a.update(key=_head_dim_strided(a["key"])), "key must be contiguous"),
    ("slot_dtype", lambda a: a.update(slot_mapping=a["slot_mapping"].int()), "slot_mapping must be torch.int64"),
    ("slot_count", lambda a: a.update(slot_mapping=a["slot_mapping"][:3]), "slot_mapping has 3"),
    ("cache_contiguous", lambda a: a.update(value_cache=_not_contiguous(a["value_cache"])), "value_cache must"),
]


@pytest.mark.parametrize(("_attention", "write"), LAUNCHERS, ids=LAUNCHER_IDS)
@pytest.mark.parametrize(("case", "breakage", "message"), WRITE_BREAKAGES, ids=[c[0] for c in WRITE_BREAKAGES])
def test_write_kv_cache_rejects(_attention, write, case, breakage, message):
    args = _write_args()
    breakage(args)
    with pytest.raises(ValueError, match=message):
        write(**args)


@pytest.mark.skipif(len(LAUNCHERS) < 2, reason="triton is not importable here")
def test_triton_launchers_refuse_cpu_tensors_unless_interpreted(paged_batch):
    from kernels.triton_kv_cache_write import write_kv_cache_triton
    from kernels.triton_paged_attention import _is_interpreted, paged_attention_triton

    if _is_interpreted():
        pytest.skip("TRITON_INTERPRET=1: CPU tensors are allowed")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        paged_attention_triton(**_attention_args(paged_batch))
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        write_kv_cache_triton(**_write_args())
