"""What memory the KV pool may take: what the machine (or the process's container) still has, or
what a GPU has free, and the pool's cap when the worker's settings name none."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MEMINFO_PATH = "/proc/meminfo"
# (limit, usage) of the process's memory cgroup: v2, then v1. A container's limit shows here, not
# in /proc/meminfo, which is the host's.
CGROUP_MEMORY_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                       ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))
GIB = 2**30
FIXED_POOL_BYTES = 2 * GIB  # the cap where neither Linux nor CUDA can tell the memory


def default_kv_pool_bytes(available: int | None, device_type: str = "cpu") -> int:
    """The KV pool's cap when none is set, from the memory `available` to it once the model is
    loaded (memory_for_kv; None where it cannot be told: then 2 GiB).

    On a CPU a quarter of it, and at least 2 GiB where 4 or more are available. A fixed 2 GiB held
    128 SmolLM2 answers to about 700 positions, so longer ones were preempted and recomputed
    (1,024-token answers 0.84x the throughput of a 4 GiB pool), while vLLM's CPU worker sizes its
    own from the memory. A quarter leaves room for the API, Redis and two more workers started on
    the same machine at once (each sees the memory before the others take theirs).

    On a GPU half of what is free. The fixed 2 GiB it had before held 4,096 tokens of a 7B Llama's
    K/V (512 KiB a token in fp16) on a GPU of any size, where vLLM takes 90 % of the GPU
    (gpu_memory_utilization); half leaves room for a step's activations and CUDA's workspace,
    which are not measured before the pool is sized, and for a second engine or worker on the
    same GPU (it gets half of what the first left)."""
    if available is None:
        return FIXED_POOL_BYTES
    if device_type == "cuda":
        return available // 2
    return max(min(FIXED_POOL_BYTES, available // 2), available // 4)


def memory_for_kv(device: torch.device) -> int | None:
    """The memory a KV pool on `device` may draw on, the model loaded: a CPU's available memory
    (available_memory_bytes), a CUDA GPU's free memory as CUDA counts it (other processes'
    allocations included); None on other devices or where it cannot be told."""
    if device.type == "cpu":
        return_free_memory()
        return available_memory_bytes()
    if device.type == "cuda":
        import torch

        try:
            free, _total = torch.cuda.mem_get_info(device)
        except (RuntimeError, AssertionError):  # no usable CUDA driver after all
            return None
        return int(free)
    return None


def return_free_memory() -> None:
    """Hand the allocator's free pages back to the OS, so that MemAvailable counts them: the
    model's loading and routing free hundreds of MB (plain weights released, weights concatenated)
    that tcmalloc (the worker's allocator) would otherwise keep for this process alone, out of the
    pool's reckoning. tcmalloc's MallocExtension_ReleaseFreeMemory where it is loaded, else glibc's
    malloc_trim; neither frees anything in use."""
    process = ctypes.CDLL(None)
    for name, args in (("MallocExtension_ReleaseFreeMemory", ()), ("malloc_trim", (0,))):
        function = getattr(process, name, None)
        if function is not None:
            function(*args)
            return


def available_memory_bytes() -> int | None:
    """The memory this process can still take without swapping or being killed: Linux'
    MemAvailable, or less where the process's cgroup (a container's memory limit) leaves less;
    None where /proc/meminfo cannot tell."""
    try:
        with open(MEMINFO_PATH) as meminfo:
            available = next((int(line.split()[1]) * 1024 for line in meminfo
                              if line.startswith("MemAvailable:")), None)
    except (OSError, ValueError, IndexError):
        return None
    if available is None:
        return None
    for limit_path, usage_path in CGROUP_MEMORY_FILES:
        try:
            limit_text = Path(limit_path).read_text().strip()
            if limit_text == "max":  # cgroup v2: no limit
                continue
            room = int(limit_text) - int(Path(usage_path).read_text().strip())
        except (OSError, ValueError):
            continue  # not this cgroup version
        # v1's "no limit" is a huge number (min keeps MemAvailable); its usage counts the page
        # cache too, so a limited v1 container gets a smaller pool than it could.
        return max(0, min(available, room))
    return available
