"""Picture of batch seats over steps, static against continuous batching, on the same workload.

    python scripts/plot_slot_timeline.py [--model smollm2|PATH] [--num-requests 24] [--seats 8]
                                         [--out docs/slot_timeline.png]

The schedule depends only on the lengths (every request generates exactly `max_tokens`, with
ignore_eos), so the default tiny random model draws the same picture as SmolLM2, in seconds.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadgen.plots import plot_slot_timelines  # noqa: E402
from loadgen.workload import build_workload  # noqa: E402
from protocol.generation import SamplingParams  # noqa: E402
from worker.engine.config import BatchingMode, EngineConfig  # noqa: E402
from worker.engine.engine import Engine  # noqa: E402
from worker.model.tiny_models import build_tiny_model  # noqa: E402


def seat_timeline(engine: Engine, workload: list, seats: int) -> list[list[str | None]]:
    """Run the workload; for each step, which request sits in which seat (None = empty)."""
    for i, item in enumerate(workload):
        params = SamplingParams(max_tokens=item.max_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(f"r{i}", engine.encode_chat(item.messages), params)
    seat_of: dict[str, int] = {}
    steps: list[list[str | None]] = []
    while engine.has_unfinished():
        output = engine.step()
        riding = [o.request_id for o in output.outputs]
        riding += [s.request_id for s in engine.scheduler.running if s.request_id not in riding]
        for rid in [r for r in seat_of if r not in riding]:
            del seat_of[rid]  # got out: the seat is free from the next stop on
        for rid in riding:
            if rid not in seat_of:
                seat_of[rid] = min(set(range(seats)) - set(seat_of.values()))
        row: list[str | None] = [None] * seats
        for rid, seat in seat_of.items():
            row[seat] = rid
        steps.append(row)
    return steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: a tiny random Llama")
    parser.add_argument("--num-requests", type=int, default=24)
    parser.add_argument("--seats", type=int, default=8)
    parser.add_argument("--max-output", type=int, default=96)
    parser.add_argument("--out", type=Path, default=Path("docs/slot_timeline.png"))
    args = parser.parse_args()
    model = args.model or str(build_tiny_model(Path(tempfile.mkdtemp()) / "tiny", "llama"))
    workload = build_workload(args.num_requests, seed=0, max_output=args.max_output)
    timelines = {}
    for mode in (BatchingMode.STATIC, BatchingMode.CONTINUOUS):
        engine = Engine(EngineConfig(model=model, mode=mode, max_num_seqs=args.seats,
                                     dtype="float32", num_threads=1))
        timelines[mode.value] = seat_timeline(engine, workload, args.seats)
        print(f"{mode.value}: {len(timelines[mode.value])} steps")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot_slot_timelines(timelines, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
