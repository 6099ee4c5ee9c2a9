"""Where the model runs and through what: device, dtype and the CPU-kernel routing of its layers."""

from __future__ import annotations

import torch

from kernels import cpu_extension, cpu_packed_linear
from worker.model.fused_layers import route_fused_layers
from worker.model.linear_layers import route_linear_layers
from worker.model.plain_weights import restore_plain_weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for but torch sees no CUDA device")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16
    # With AMX or AVX512-BF16, bf16 GEMMs beat fp32 ones at every row count of a step (on an
    # AVX512-BF16 EPYC, 2 threads: 2.3-3.8x the fp32 skinny kernel at 8-96 rows, over all 30
    # layers; `python scripts/bench_cpu_linear.py --bf16 --packed --threads 2`). Without them
    # bf16 runs through conversions: on an AVX2-only box five times slower than fp32.
    return torch.bfloat16 if cpu_packed_linear.runs_fast_here() else torch.float32


def route_cpu_kernels(model: torch.nn.Module, enabled: bool, device: torch.device, dtype: torch.dtype) -> bool:
    """Route the model's linear, RMSNorm and gated-MLP layers and its paged attention through the
    CPU kernels where they run (fp32 or bf16 on a CPU, extension built), or back to transformers'
    own; True if they run. Linear layers: in fp32 the skinny C++ kernel for a few rows and oneDNN
    on weights reordered once for more; in bf16 oneDNN on weights reordered once (or AMX tiles).
    The extension is built (once per machine) here, not mid-step."""
    restore_plain_weights(model)  # routed and released before: packed again from the plain weights
    uses = (enabled and device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and cpu_extension.load() is not None)
    packed = uses and (cpu_packed_linear.runs_fast_here() if dtype == torch.bfloat16
                       else cpu_packed_linear.packs_fp32_here())
    route_linear_layers(model, uses, packed)
    route_fused_layers(model, uses, packed)
    return uses
