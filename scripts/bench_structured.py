"""Throughput of a json_schema-constrained batch against the same batch unconstrained, in one run.

    python scripts/bench_structured.py                       # SmolLM2, 16 requests, 2 rounds
    python scripts/bench_structured.py --requests 64 --threads 2 --rounds 3

The constrained batch runs first; the unconstrained twin then generates exactly as many tokens per
request (max_tokens = the constrained length, ignore_eos), so the two differ only by the grammar:
the token masks (llguidance, computed on the CPU), applying them to the logits and advancing the
matchers. Rounds alternate the two, so load from other processes falls on both alike; the best
(least disturbed) round of each counts, and every round is printed. It also reports the grammar's
own cost per step and per constrained row.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from protocol.generation import SamplingParams, StructuredOutput, StructuredOutputKind  # noqa: E402

SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "city", "hobbies"],
    "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
                   "city": {"type": "string", "maxLength": 40},
                   "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3}},
}
ASKS = ["Describe a fictional person as JSON.", "Invent a character who lives in Paris.",
        "Give me a JSON profile of a retired teacher.", "Make up a person who loves chess."]


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown"


class MaskTimer:
    """Wraps the engine's StructuredOutputs to time bitmask() and advance()."""

    def __init__(self, outputs: Any) -> None:
        self.seconds = 0.0
        self.num_steps = 0
        self.num_rows = 0
        bitmask, advance = outputs.bitmask, outputs.advance

        def timed_bitmask(request_ids: list[str]) -> Any:
            started = time.perf_counter()
            mask = bitmask(request_ids)
            self.seconds += time.perf_counter() - started
            if mask is not None:
                self.num_steps += 1
                self.num_rows += int(mask.rows.numel())
            return mask

        def timed_advance(request_ids: list[str], token_ids: list[int]) -> Any:
            started = time.perf_counter()
            done = advance(request_ids, token_ids)
            self.seconds += time.perf_counter() - started
            return done

        outputs.bitmask, outputs.advance = timed_bitmask, timed_advance


def run(engine: Any, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, int, list[Any]]:
    started = time.perf_counter()
    results = engine.generate(prompts, params)
    return time.perf_counter() - started, sum(len(r.token_ids) for r in results), results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()

    from worker.engine.config import EngineConfig
    from worker.engine.engine import Engine

    engine = Engine(EngineConfig(model=args.model, device=args.device, num_threads=args.threads,
                                 max_num_seqs=args.requests))
    timer = MaskTimer(engine.structured_outputs)
    constraint = StructuredOutput(StructuredOutputKind.JSON_SCHEMA, json.dumps(SCHEMA))
    prompts = [engine.encode_chat([{"role": "user", "content": ASKS[i % len(ASKS)]}])
               for i in range(args.requests)]
    constrained = [SamplingParams(max_tokens=args.max_tokens, temperature=0.8, seed=i, structured_output=constraint)
                   for i in range(args.requests)]
    engine.generate(prompts[:2], constrained[:2])  # compile the grammar and build the tokenizer once
    _, _, results = run(engine, prompts, constrained)
    free = [SamplingParams(max_tokens=len(r.token_ids), temperature=0.8, seed=i, ignore_eos=True)
            for i, r in enumerate(results)]
    times: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
    tokens: dict[str, int] = {}
    for _ in range(args.rounds):
        timer.seconds, timer.num_steps, timer.num_rows = 0.0, 0, 0
        seconds, num_tokens, _ = run(engine, prompts, constrained)
        times["constrained"].append(seconds)
        tokens["constrained"] = num_tokens
        mask_seconds, mask_steps, mask_rows = timer.seconds, timer.num_steps, timer.num_rows
        seconds, num_tokens, _ = run(engine, prompts, free)
        times["unconstrained"].append(seconds)
        tokens["unconstrained"] = num_tokens
    print(f"CPU: {cpu_model()}; device {engine.runner.device}, dtype {engine.runner.dtype}, "
          f"torch threads {args.threads or 'default'}; {args.requests} requests, {args.model}")
    rates = {}
    for name in ("constrained", "unconstrained"):
        best = min(times[name])
        rates[name] = tokens[name] / best
        print(f"{name:>13}: {tokens[name]:5d} tokens in {best:6.2f} s = {rates[name]:7.1f} tokens/s "
              f"(rounds: {', '.join(f'{t:.2f}' for t in times[name])} s)")
    print(f"ratio constrained / unconstrained: {rates['constrained'] / rates['unconstrained']:.3f}")
    if mask_steps:
        print(f"grammar work (masks + advancing), last round: {mask_seconds * 1e3 / mask_steps:.2f} ms per step, "
              f"{mask_seconds * 1e6 / mask_rows:.0f} us per constrained row, "
              f"{mask_seconds / times['constrained'][-1]:.1%} of the run")


if __name__ == "__main__":
    main()
