"""The glue between transformers' attention interface and the paged KV cache in `kernels`.

transformers hands every keyword of the model's forward down to the attention function, so the
per-step metadata rides along as one keyword (`PagedAttentionBackend.KWARG`): no global state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface

from kernels import paged_attention, paged_attention_torch, write_kv_cache, write_kv_cache_torch


@dataclass(slots=True)
class AttentionMetadata:
    """Everything the attention layers need for one packed step, built once per step."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32: context length including this step's tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    max_query_len: int
    max_seq_len: int
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: key, value caches
    use_cpu_kernels: bool = True  # False: CPU tensors take the torch twin (benchmarks' ablation)


class PagedAttentionBackend:
    """An attention implementation transformers can dispatch to by name."""

    NAME = "carpool_paged"
    KWARG = "carpool_attention_metadata"

    @classmethod
    def register(cls) -> str:
        # The registry is transformers' process-wide table; registering the same function twice
        # is harmless. No mask function is registered on purpose: for a name missing from
        # AttentionMaskInterface, masking_utils returns None before building anything (5.24),
        # whereas a registered no-op would first run its packed-sequence scan (a host sync).
        AttentionInterface.register(cls.NAME, paged_attention_forward)
        return cls.NAME


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    # query: [1, num_heads, num_tokens, head_dim]; key, value: [1, num_kv_heads, num_tokens, head_dim]
    metadata: AttentionMetadata | None = kwargs.get(PagedAttentionBackend.KWARG)
    if metadata is None:
        raise RuntimeError(
            f"{PagedAttentionBackend.NAME} attention needs {PagedAttentionBackend.KWARG}= in the "
            "model's forward; only the Carpool model runner can call this model"
        )
    key_cache, value_cache = metadata.kv_caches[module.layer_idx]
    q = query[0].transpose(0, 1)  # [num_tokens, num_heads, head_dim]
    kernels_on = metadata.use_cpu_kernels or q.is_cuda
    write = write_kv_cache if kernels_on else write_kv_cache_torch
    write(key[0].transpose(0, 1), value[0].transpose(0, 1), key_cache, value_cache, metadata.slot_mapping)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    attend = paged_attention if kernels_on else paged_attention_torch
    out = attend(
        q, key_cache, value_cache, metadata.block_tables, metadata.seq_lens,
        metadata.query_start_loc, scale, metadata.max_query_len, metadata.max_seq_len,
    )
    return out.unsqueeze(0), None  # [1, num_tokens, num_heads, head_dim], as transformers expects
