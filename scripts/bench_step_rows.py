#!/usr/bin/env python3
"""Decode steps of a few sequences with the C++ decoder layer's row minimum at 1 and at
kernels.cpu_packed_linear.MIN_LAYER_ROWS, alternated every few steps in one engine (a worker pads
only where `layer_min_rows` says so: a Zen 4).

The two settings take turns on the same engine, the same sequences and the same process, so the
VM's drift (steps a fifth slower from one minute to the next on the 2-vCPU VMs here) falls on
both alike; each batch size reports each setting's median and first-quartile step time. The
minimum is read per step (kernels.cpu_step_ops), so switching it between steps is all it takes.
It matters only where oneDNN runs the bf16 matmuls (AVX512-BF16 without AMX tiles); elsewhere the
two columns measure the same code.

    python scripts/bench_step_rows.py                        # 1, 2 and 4 sequences
    python scripts/bench_step_rows.py --sequences 1,2,3,4,8 --rounds 60
    python scripts/bench_step_rows.py --min-rows 3           # another minimum against 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels import cpu_isa, cpu_step_ops  # noqa: E402
from kernels.cpu_packed_linear import MIN_LAYER_ROWS  # noqa: E402
from protocol.generation import SamplingParams  # noqa: E402
from worker.engine.config import EngineConfig  # noqa: E402
from worker.engine.engine import Engine  # noqa: E402
from worker.model import process_preloads  # noqa: E402
from worker.model.loader import load_model  # noqa: E402
from worker.model.routing import resolve_dtype  # noqa: E402

PROMPT = "Write a long essay about the history of the bicycle and its inventors."


def step_times(engine: Engine, settings: tuple[int, ...], rounds: int, steps_each: int) -> dict[int, list[float]]:
    """Seconds of each decode step, by row minimum, the settings taking turns every steps_each steps."""
    times: dict[int, list[float]] = {setting: [] for setting in settings}
    try:
        for _ in range(rounds):
            for setting in settings:
                cpu_step_ops.LAYER_MIN_ROWS = setting
                for _ in range(steps_each):
                    started = time.perf_counter()
                    engine.step()
                    times[setting].append(time.perf_counter() - started)
    finally:
        cpu_step_ops.LAYER_MIN_ROWS = None
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 where the CPU multiplies it), float32, bfloat16")
    parser.add_argument("--sequences", default="1,2,4", help="batch sizes, comma-separated")
    parser.add_argument("--rounds", type=int, default=40, help="turns of each setting per batch size")
    parser.add_argument("--steps-each", type=int, default=4, help="decode steps per turn")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--min-rows", type=int, default=MIN_LAYER_ROWS,
                        help="the row minimum to set against 1 (default: MIN_LAYER_ROWS)")
    args = parser.parse_args()
    # The engine runs as in a worker: tcmalloc preloaded where installed (worker/__main__.py).
    env = process_preloads.preload_environment(os.environ, process_preloads.wanted_libraries(
        "tcmalloc", "gnu", process_preloads.tcmalloc_library(), None))
    if env is not None:
        os.execve(sys.executable, [sys.executable, *sys.argv], env)

    torch.set_num_threads(args.threads)
    dtype = resolve_dtype(EngineConfig(dtype=args.dtype).dtype, torch.device("cpu"))
    print(f"# kernels: {cpu_isa.active_isa()}; dtype {dtype}; {args.threads} threads; "
          f"preloaded: {os.environ.get('LD_PRELOAD') or 'nothing'}", flush=True)
    loaded = load_model(args.model, dtype=dtype, device="cpu")
    prompt = loaded.tokenizer.encode(PROMPT)
    steps = args.rounds * args.steps_each * 2 + 8
    settings = (1, args.min_rows)
    print(f"{'sequences':>9}  " + "  ".join(f"{f'min rows {s}: median / p25 ms':>30}" for s in settings)
          + "  median change", flush=True)
    for count in (int(n) for n in args.sequences.split(",")):
        engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, device="cpu",
                                     max_model_len=len(prompt) + steps + 1), loaded=loaded)
        for i in range(count):
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True))
        for _ in range(8):  # the prefill and the first decodes
            engine.step()
        times = step_times(engine, settings, args.rounds, args.steps_each)
        medians = {s: statistics.median(t) * 1e3 for s, t in times.items()}
        cells = [f"{medians[s]:.2f} / {sorted(t)[len(t) // 4] * 1e3:.2f}" for s, t in times.items()]
        change = medians[settings[1]] / medians[settings[0]] - 1
        print(f"{count:>9}  " + "  ".join(f"{c:>30}" for c in cells) + f"  {change:+.1%}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
