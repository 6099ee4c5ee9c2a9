"""The engine's one config object: built once, validated here, read everywhere else."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum


class LogprobsMode(str, Enum):
    """What a generated token's logprobs are of, by vLLM's names (its --logprobs-mode)."""

    RAW = "raw_logprobs"  # the model's own distribution: no processing, no temperature (vLLM's default)
    PROCESSED = "processed_logprobs"  # after bias, penalties and the request's temperature


class BatchingMode(str, Enum):
    CONTINUOUS = "continuous"  # sequences join and leave at every step
    STATIC = "static"  # a batch is formed once and runs until its last member finishes
    SEQUENTIAL = "sequential"  # one request at a time


DTYPE_ALIASES = {
    "auto": "auto",
    "float32": "float32", "fp32": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}
_DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = "smollm2"  # a bundled model name or a local Hugging Face directory
    dtype: str = "auto"  # auto: bf16 on a GPU or a CPU with AMX or AVX512-BF16, fp32 otherwise
    device: str = "auto"  # auto: cuda when available
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # None: enough for the seats' full contexts, within the memory cap
    max_num_seqs: int | None = None  # None: from the device and the KV pool (engine.batch_limits)
    max_num_batched_tokens: int | None = None  # token budget of one step; None: 8 per seat, bounded
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    mode: BatchingMode = BatchingMode.CONTINUOUS
    # True: preempted requests go back to the front of the engine's own queue (library use).
    # False: the engine drops them and reports them in StepOutput.preempted for someone to requeue.
    requeue_preempted: bool = True
    # Cap on the KV pool when num_kv_blocks is None; None: a quarter of the memory a CPU worker
    # finds available at start (at least 2 GiB where half of it allows), half of what a GPU has
    # free once the model is loaded (kv_memory.default_kv_pool_bytes).
    kv_cache_memory_gib: float | None = None
    enable_prefix_caching: bool = True  # reuse computed K/V blocks of identical prompt prefixes
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default
    # CPUs with AVX2: decode attention, RMSNorm and SiLU-and-multiply (fp32 or bf16) and few-row
    # fp32 matmuls through kernels/csrc (C++), not torch.
    enable_cpu_kernels: bool = True
    logprobs_mode: LogprobsMode = LogprobsMode.RAW

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty string, got {self.model!r}")
        dtype = DTYPE_ALIASES.get(str(self.dtype).lower()) if isinstance(self.dtype, str) else None
        if dtype is None:
            raise ValueError(f"dtype must be one of {sorted(set(DTYPE_ALIASES))}, got {self.dtype!r}")
        object.__setattr__(self, "dtype", dtype)
        if not isinstance(self.device, str) or not _DEVICE_PATTERN.fullmatch(self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        try:
            object.__setattr__(self, "mode", BatchingMode(self.mode))
        except ValueError:
            modes = [mode.value for mode in BatchingMode]
            raise ValueError(f"mode must be one of {modes}, got {self.mode!r}") from None
        _check_int("block_size", self.block_size, 1, 1024)
        if self.num_kv_blocks is not None:
            _check_int("num_kv_blocks", self.num_kv_blocks, 1, 2**31 - 1)
        if self.max_num_seqs is not None:
            _check_int("max_num_seqs", self.max_num_seqs, 1, 4096)
        if self.max_num_batched_tokens is not None:
            _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1, 1 << 20)
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 2, 1 << 24)
        if not isinstance(self.requeue_preempted, bool):
            raise ValueError(f"requeue_preempted must be a bool, got {self.requeue_preempted!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        if not isinstance(self.enable_cpu_kernels, bool):
            raise ValueError(f"enable_cpu_kernels must be a bool, got {self.enable_cpu_kernels!r}")
        if self.kv_cache_memory_gib is not None and (
                not isinstance(self.kv_cache_memory_gib, (int, float)) or not self.kv_cache_memory_gib > 0):
            raise ValueError(f"kv_cache_memory_gib must be positive (or None: sized from the memory), "
                             f"got {self.kv_cache_memory_gib!r}")
        if self.num_threads is not None:
            _check_int("num_threads", self.num_threads, 1, 1024)
        try:
            object.__setattr__(self, "logprobs_mode", LogprobsMode(self.logprobs_mode))
        except ValueError:
            modes = [mode.value for mode in LogprobsMode]
            raise ValueError(f"logprobs_mode must be one of {modes}, got {self.logprobs_mode!r}") from None


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
