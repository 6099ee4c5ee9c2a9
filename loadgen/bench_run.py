"""`carpool bench`: one command for the lesson's comparison over REST.

It starts a Redis if none answers and the API, then for each batching mode a fresh worker on the
same model, offers the same workload at each arrival rate, and writes a table, JSON and PNGs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from loadgen.load_generator import LoadGenerator, LoadReport
from loadgen.plots import plot_latency_distributions, plot_throughput_vs_rate
from loadgen.workload import build_workload

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BenchConfig:
    model: str = "smollm2"
    redis_url: str = "redis://127.0.0.1:6379/0"
    api_port: int = 8765
    modes: tuple[str, ...] = ("continuous", "static", "sequential")
    rates: tuple[float, ...] = (1.0, 4.0)
    num_requests: int = 32
    max_output: int = 128
    max_num_seqs: int = 32
    out_dir: Path = Path("bench_out")
    seed: int = 0


def run_bench(config: BenchConfig) -> list[LoadReport]:
    from worker.local_redis import LocalRedis

    config.out_dir.mkdir(parents=True, exist_ok=True)
    redis = LocalRedis.ensure(config.redis_url)
    api_url = f"http://127.0.0.1:{config.api_port}"
    api = subprocess.Popen([sys.executable, "-m", "api", "--port", str(config.api_port),
                            "--redis-url", config.redis_url])
    reports: list[LoadReport] = []
    try:
        workload = build_workload(config.num_requests, seed=config.seed, max_output=config.max_output)
        for mode in config.modes:
            worker = subprocess.Popen([
                sys.executable, "-m", "worker", "--model", config.model, "--redis-url",
                config.redis_url, "--mode", mode, "--max-num-seqs", str(config.max_num_seqs),
                "--name", f"bench-{mode}",
            ])
            try:
                _wait_for_worker(api_url, f"bench-{mode}", worker)
                for rate in config.rates:
                    log.info("mode %s, %s jobs/s, %d jobs", mode, rate, len(workload))
                    report = asyncio.run(LoadGenerator(api_url).run(mode, workload, rate, config.seed))
                    reports.append(report)
                    print(json.dumps(report.summary()), flush=True)
            finally:
                worker.terminate()
                worker.wait(timeout=60)
    finally:
        api.terminate()
        api.wait(timeout=30)
        redis.stop()
    _write_outputs(reports, config)
    return reports


def _wait_for_worker(api_url: str, name: str, worker: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if worker.poll() is not None:
            raise RuntimeError(f"worker {name} exited with {worker.returncode} during start-up")
        try:
            stats = httpx.get(f"{api_url}/v1/stats", timeout=2).json()
            if any(w["name"] == name for w in stats.get("workers", [])):
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"worker {name} did not come up in {timeout_s} s")


def _write_outputs(reports: list[LoadReport], config: BenchConfig) -> None:
    rows = [r.summary() for r in reports]
    (config.out_dir / "bench.json").write_text(json.dumps(rows, indent=2))
    print(format_table(rows))
    top_rate = max(config.rates)
    plot_latency_distributions([r for r in reports if r.rate == top_rate],
                               config.out_dir / "latency_cdf.png")
    if len(config.rates) > 1:
        plot_throughput_vs_rate(reports, config.out_dir / "throughput_vs_rate.png")
    print(f"wrote {config.out_dir}/bench.json and PNG plots")


def format_table(rows: list[dict[str, object]]) -> str:
    header = (f"{'mode':<11} {'rate':>5} {'jobs':>4} {'tok/s':>7} {'jobs/s':>6} "
              f"{'TTFT p50/p90/p99 s':>20} {'ITL p50/p99 ms':>15} {'E2E p50/p90/p99 s':>20} "
              f"{'slots':>5} {'preempt':>7}")
    lines = [header, "-" * len(header)]
    for row in rows:
        ttft, itl, e2e = row["ttft_p50_p90_p99"], row["itl_p50_p90_p99"], row["e2e_p50_p90_p99"]
        rate = "all" if math.isinf(row["rate"]) else f"{row['rate']:g}"
        lines.append(
            f"{row['label']:<11} {rate:>5} {row['jobs']:>4} {row['tokens_per_s']:>7} "
            f"{row['jobs_per_s']:>6} {'/'.join(f'{x:.2f}' for x in ttft):>20} "
            f"{itl[0] * 1000:>7.1f}/{itl[2] * 1000:<7.1f} {'/'.join(f'{x:.2f}' for x in e2e):>20} "
            f"{row['slot_utilisation']:>5.0%} {row['preemptions']:>7}"
        )
    return "\n".join(lines)
