"""The skinny CPU linear kernel against torch's F.linear (MKL) on the model's weight shapes.

    python scripts/bench_cpu_linear.py                    # SmolLM2's shapes, 1 and 2 threads
    python scripts/bench_cpu_linear.py --rows 1,8,32 --threads 2
    python scripts/bench_cpu_linear.py --weights lm_head --rows 16,32,64,96   # the 49152-wide head
    python scripts/bench_cpu_linear.py --bf16             # also F.linear in bf16 (oneDNN)
    python scripts/bench_cpu_linear.py --bf16 --packed    # ... and on weights reordered once
    python scripts/bench_cpu_linear.py --bf16 --packed --rows 1,8,32,64,128,512 --threads 1
    python scripts/bench_cpu_linear.py --fp32-packed --weights fused_layers --rows 96,128,256,512

Every implementation of a row count is timed interleaved (one pass of each per round; the median
of --repeats rounds), so load from other processes falls on all of them alike. The header names
the CPU model, the C++ kernels' ISA and whether oneDNN may use AMX (ONEDNN_MAX_CPU_ISA caps it:
`ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16` runs the same bf16 GEMMs without AMX; ONEDNN_VERBOSE=1
names the kernel oneDNN picked, `brg_matmul:avx10_1_512_amx` where AMX runs).

For each row count, the time of one pass over all 30 layers' 7 projections (q, k, v, o, gate, up,
down), as a decode step makes it (or of the lm_head, with --weights lm_head), and the ratio.
Weights are far larger than the caches, as in a real step. kernels.dispatch.MAX_SKINNY_ROWS is
set from this table. With --bf16, a third column
times F.linear on bf16 copies of the weights: on CPUs with AVX512-BF16 or AMX it beats both fp32
paths, which is why worker.model.routing.resolve_dtype picks bf16 there. With --packed, a fourth
times the same bf16 GEMMs on weights oneDNN reordered once (kernels/cpu_packed_linear.py), and
where the kernels run AMX a fifth times Carpool's AMX kernel on weights in tile order
(kernels/cpu_amx_linear.py), which the engine packs for there instead of oneDNN's. With
--fp32-packed, a column times fp32 GEMMs on weights oneDNN reordered once, which the engine uses
between the skinny kernel's rows and kernels.dispatch.MAX_PACKED_FP32_ROWS. `--weights
fused_layers` times the shapes the engine multiplies by where it fuses q, k and v and gate and up
(worker/model/fused_layers.py).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_kernels  # noqa: E402  (its cpu_model)

from kernels import cpu_amx_linear, cpu_extension, cpu_isa, cpu_packed_linear, cpu_skinny_linear  # noqa: E402

NUM_LAYERS = 30
SHAPES = {  # [out_features, in_features] of SmolLM2-135M
    "q": (576, 576), "k": (192, 576), "v": (192, 576), "o": (576, 576),
    "gate": (1536, 576), "up": (1536, 576), "down": (576, 1536),
}
# Weight sets: their shapes and how many copies a step multiplies by.
FUSED_SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
WEIGHT_SETS = {"layers": (SHAPES, NUM_LAYERS), "fused_layers": (FUSED_SHAPES, NUM_LAYERS),
               "lm_head": ({"lm_head": (49152, 576)}, 1)}


Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def make_pass(rows: int, weights: dict[str, list[torch.Tensor]], linear: Linear,
              dtype: torch.dtype | None = None) -> Callable[[], None]:
    """One pass over every weight of the set, as a step makes it."""
    # A packed weight's dtype is oneDNN's business: the caller names the input's.
    inputs = {name: torch.randn(rows, in_features(copies[0]), dtype=dtype or copies[0].dtype)
              for name, copies in weights.items()}

    def one_pass() -> None:
        for name, copies in weights.items():
            for weight in copies:
                linear(inputs[name], weight)

    return one_pass


def in_features(weight: torch.Tensor) -> int:
    """A plain or oneDNN-packed weight is [out, in]; AMX tiles are [out/16, in/32, 16, 32]."""
    return cpu_amx_linear.weight_shape(weight)[1] if cpu_amx_linear.is_packed(weight) else weight.shape[1]


def time_interleaved(passes: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Median seconds per pass of each, one pass of each per round."""
    for one_pass in passes.values():
        one_pass()
    samples: dict[str, list[float]] = {name: [] for name in passes}
    for _ in range(repeats):
        for name, one_pass in passes.items():
            started = time.perf_counter()
            one_pass()
            samples[name].append(time.perf_counter() - started)
    return {name: statistics.median(times) for name, times in samples.items()}


def describe_machine() -> str:
    amx = torch.cpu._is_amx_tile_supported()
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "unset")
    return (f"{bench_kernels.cpu_model()}; torch {torch.__version__}; C++ kernels: {cpu_isa.active_isa()}; "
            f"AMX tiles: {amx}; ONEDNN_MAX_CPU_ISA={cap}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,4,8,16,24,32,48,64")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeats", type=int, default=5, help="rounds; the median pass is reported")
    parser.add_argument("--weights", choices=sorted(WEIGHT_SETS), default="layers")
    parser.add_argument("--bf16", action="store_true", help="also time F.linear with bf16 weights and inputs")
    parser.add_argument("--packed", action="store_true", help="with --bf16: also on weights reordered once")
    parser.add_argument("--fp32-packed", action="store_true",
                        help="also fp32 on weights oneDNN reordered once")
    args = parser.parse_args(argv)
    if cpu_extension.load() is None:
        raise SystemExit("the CPU kernels cannot be built here (no AVX2 or no compiler)")
    shapes, copies = WEIGHT_SETS[args.weights]
    weights = {name: [torch.randn(*shape) for _ in range(copies)] for name, shape in shapes.items()}
    bf16_weights = {name: [w.bfloat16() for w in ws] for name, ws in weights.items()} if args.bf16 else {}
    bf16_header = f"{'bf16 F.linear ms':>18}{'bf16 vs skinny':>16}" if args.bf16 else ""
    packed_weights, amx_weights = {}, {}
    if args.bf16 and args.packed:
        # oneDNN's reorder even where AMX runs (pack_weight would take AMX tiles there): both columns.
        pinned = cpu_isa.forced_isa(cpu_isa.AVX512_BF16) if cpu_amx_linear.is_available() else contextlib.nullcontext()
        with pinned:
            packed_weights = {name: [cpu_packed_linear.pack_weight(w) for w in ws] for name, ws in bf16_weights.items()}
        bf16_header += f"{'bf16 packed ms':>16}{'packed vs F.linear':>20}"
        if cpu_amx_linear.is_available():
            amx_weights = {name: [cpu_amx_linear.pack(w) for w in ws] for name, ws in bf16_weights.items()}
            bf16_header += f"{'amx ms':>9}{'amx vs packed':>15}"
    fp32_packed_weights = {}
    if args.fp32_packed:
        fp32_packed_weights = {name: [cpu_packed_linear.pack_weight(w) for w in ws] for name, ws in weights.items()}
        bf16_header += f"{'fp32 packed ms':>16}{'vs F.linear':>13}"
    print(describe_machine())
    print(f"{'threads':>7}{'rows':>6}{'F.linear ms':>13}{'skinny ms':>11}{'speed-up':>10}{bf16_header}")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for rows in (int(r) for r in args.rows.split(",")):
            passes = {"fp32": make_pass(rows, weights, F.linear),
                      "skinny": make_pass(rows, weights, cpu_skinny_linear.skinny_linear)}
            if args.bf16:
                passes["bf16"] = make_pass(rows, bf16_weights, F.linear)
            if packed_weights:
                passes["packed"] = make_pass(rows, packed_weights, cpu_packed_linear.packed_linear, torch.bfloat16)
            if fp32_packed_weights:
                passes["fp32 packed"] = make_pass(rows, fp32_packed_weights, cpu_packed_linear.packed_linear,
                                                  torch.float32)
            if amx_weights:
                passes["amx"] = make_pass(rows, amx_weights, cpu_amx_linear.amx_linear, torch.bfloat16)
            times = time_interleaved(passes, args.repeats)
            reference, skinny = times["fp32"], times["skinny"]
            line = f"{threads:>7}{rows:>6}{reference * 1e3:>13.1f}{skinny * 1e3:>11.1f}{reference / skinny:>9.2f}x"
            if args.bf16:
                bf16 = times["bf16"]
                line += f"{bf16 * 1e3:>18.1f}{skinny / bf16:>15.2f}x"
            if packed_weights:
                packed = times["packed"]
                line += f"{packed * 1e3:>16.1f}{bf16 / packed:>19.2f}x"
            if amx_weights:
                line += f"{times['amx'] * 1e3:>9.1f}{times['packed'] / times['amx']:>14.2f}x"
            if fp32_packed_weights:
                line += f"{times['fp32 packed'] * 1e3:>16.1f}{reference / times['fp32 packed']:>12.2f}x"
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
