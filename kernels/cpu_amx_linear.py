"""bf16 `x @ weight.T (+ bias)` on AMX tiles (csrc/amx_linear.cpp), the weight packed once into tile
order; for every row count a step brings, decode steps and prefill chunks alike.

Where: CPUs with AMX (Sapphire Rapids and later Xeons) whose OS grants this process the tiles,
with the kernels' ISA at "amx" (kernels.cpu_isa; CARPOOL_CPU_ISA=avx512_bf16 pins it lower). There
`cpu_packed_linear.pack_weight` packs into this format instead of oneDNN's, because oneDNN's packed
GEMM streams few-row steps' weights well below memory speed: all 30 layers' projections of SmolLM2,
2 threads of a Sapphire Rapids VM, each call from Python, 15.1 -> 10.6 ms at 1 row, 17.6 -> 12.3 at
32, 20.0 -> 15.7 at 64, 26.5 -> 22.1 at 128, 40.8 -> 37.0 at 256 (`python scripts/bench_cpu_linear.py
--bf16 --packed --rows 1,8,32,64,128,256 --threads 2`).

Its twin is `torch.nn.functional.linear` on the unpacked weight: both accumulate in fp32 and round to
bf16 once, so they agree up to the order of the fp32 additions. A row's result never depends on
the other rows of the call.
"""

from __future__ import annotations

import torch

from kernels import cpu_extension, cpu_isa

TILE_COLUMNS = 16  # output features per tile
TILE_DEPTH = 32  # input features per tile (64 bytes of bf16 per tile row)
PANEL_COLUMNS = 32  # output features per thread task: the kernel's shape rule
# Past this many rows (a long prefill chunk) kernels.linear hands the plain weight to oneDNN instead,
# which reorders it on every call and still wins there: over SmolLM2's 30 layers, 2 threads,
# 174 vs 273 ms at 2,048 rows, 139 vs 188 at 1,536, even at 1,024 (127 vs 119), AMX ahead below.
MAX_ROWS = 1024


def is_available() -> bool:
    """True where the kernels run AMX now (extension built, CPU and OS allow it, not pinned lower)."""
    return cpu_isa.active_isa() == cpu_isa.AMX


def fits(weight: torch.Tensor) -> bool:
    """Whether `weight` ([out_features, in_features], bf16 on the CPU) has a shape the kernel takes:
    both sizes multiples of 32 (every projection of SmolLM2, Llama, Qwen2 and Mistral has them)."""
    return (weight.dim() == 2 and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and weight.shape[0] % PANEL_COLUMNS == 0 and weight.shape[1] % TILE_DEPTH == 0 and weight.numel() > 0)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight: [out_features, in_features] bf16 -> [out/16, in/32, 16, 32] tiles for amx_linear."""
    if not fits(weight):
        raise ValueError(f"AMX tiles need a 2-D bf16 CPU weight whose sizes are multiples of {PANEL_COLUMNS} and "
                         f"{TILE_DEPTH}, got {weight.dtype} {tuple(weight.shape)} on {weight.device}")
    return _extension().amx_pack_weight(weight.detach().contiguous())


def is_packed(packed: torch.Tensor) -> bool:
    """True for `pack`'s tiles (4-D), False for oneDNN's reordered weight (2-D)."""
    return packed.dim() == 4


def weight_shape(packed: torch.Tensor) -> tuple[int, int]:
    """The [out_features, in_features] of the weight `pack` made these tiles of."""
    return packed.shape[0] * TILE_COLUMNS, packed.shape[1] * TILE_DEPTH


def amx_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x: [..., in_features] bf16 on the CPU, packed = pack(weight)."""
    out_features, in_features = weight_shape(packed)
    if x.dtype != torch.bfloat16 or x.device.type != "cpu":
        raise ValueError(f"x must be a bf16 CPU tensor, got {x.dtype} on {x.device}")
    if x.shape[-1] != in_features:
        raise ValueError(f"x has {x.shape[-1]} features but the packed weight expects {in_features}")
    if bias is not None and (tuple(bias.shape) != (out_features,) or bias.device.type != "cpu"):
        raise ValueError(f"bias must be a CPU tensor of shape [{out_features}], got {tuple(bias.shape)} on "
                         f"{bias.device}")
    rows = x.numel() // in_features
    out = _extension().amx_linear(x.reshape(rows, in_features).contiguous(), packed, bias)
    return out.view(*x.shape[:-1], out_features)


def _extension():  # noqa: ANN202 (the compiled module)
    # Packing needs no AMX; the product refuses (RuntimeError) where the CPU or OS has none.
    extension = cpu_extension.load()
    if extension is None:
        raise RuntimeError("the CPU kernels are not built here; check is_available() first")
    return extension
