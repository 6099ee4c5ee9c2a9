"""`carpool bench`: one command for the lesson's comparison over REST.

It starts a private Redis and the API on free local ports, then for each batching mode a fresh
worker on the same model, offers the same workload at each arrival rate, and writes a table
(text and Markdown), JSON and PNGs. Everything listens on 127.0.0.1 only.

A private Redis by default: a shared one may hold other workers, which would take the bench's
jobs (and a different model or mode would answer them) and count in its slot utilisation.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from loadgen.load_generator import LoadGenerator, LoadReport
from loadgen.plots import plot_latency_distributions, plot_throughput_vs_rate
from loadgen.workload import build_workload

log = logging.getLogger(__name__)

MODES = ("continuous", "static", "sequential")


@dataclass(frozen=True, slots=True)
class BenchConfig:
    model: str = "smollm2"
    redis_url: str | None = None  # None: a private redis-server on a free local port
    api_port: int = 0  # 0: a free local port
    modes: tuple[str, ...] = MODES
    rates: tuple[float, ...] = (1.0, 4.0)
    # Per-mode rates replacing `rates` (sequential mode is slow: fewer rates keep a run short).
    mode_rates: dict[str, tuple[float, ...]] = field(default_factory=dict)
    num_requests: int = 32
    max_output: int = 128
    max_num_seqs: int = 32
    worker_threads: int | None = None  # torch intra-op threads per worker; None: torch's default
    out_dir: Path = Path("bench_out")
    seed: int = 0
    command: str = ""  # the command line, recorded with the results

    def rates_for(self, mode: str) -> tuple[float, ...]:
        return self.mode_rates.get(mode, self.rates)


def parse_rates(text: str) -> tuple[float, ...]:
    """'0.5,1,inf' -> (0.5, 1.0, inf); 'all' is a synonym of inf (every job at once)."""
    rates = tuple(math.inf if part.strip().lower() in ("inf", "all") else float(part)
                  for part in text.split(",") if part.strip())
    if not rates or any(not rate > 0 for rate in rates):
        raise ValueError(f"rates must be positive jobs/s or 'inf', got {text!r}")
    return rates


def parse_mode_rates(items: list[str]) -> dict[str, tuple[float, ...]]:
    """['sequential=1,inf'] -> {'sequential': (1.0, inf)}."""
    result = {}
    for item in items:
        mode, sep, rates = item.partition("=")
        if not sep or mode not in MODES:
            raise ValueError(f"expected MODE=RATES with MODE one of {', '.join(MODES)}, got {item!r}")
        result[mode] = parse_rates(rates)
    return result


def run_bench(config: BenchConfig) -> list[LoadReport]:
    from launcher.local_redis import LocalRedis

    # Per-request and per-poll lines would bury the results.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    config.out_dir.mkdir(parents=True, exist_ok=True)
    redis_url = config.redis_url or f"redis://127.0.0.1:{_free_port()}/0"
    redis = LocalRedis.ensure(redis_url)
    if redis.kind == "existing":
        log.warning("benchmarking on the existing Redis at %s: any other worker on it will take "
                    "some of the jobs (leave --redis-url out for a private one)", redis_url)
    api_port = config.api_port or _free_port()
    api_url = f"http://127.0.0.1:{api_port}"
    api = subprocess.Popen([sys.executable, "-m", "api", "--host", "127.0.0.1", "--port",
                            str(api_port), "--redis-url", redis_url, "--log-level", "warning"])
    reports: list[LoadReport] = []
    started = time.monotonic()
    try:
        workload = build_workload(config.num_requests, seed=config.seed, max_output=config.max_output)
        for mode in config.modes:
            name = f"bench-{mode}-{os.getpid()}"
            command = [sys.executable, "-m", "worker", "--model", config.model, "--redis-url",
                       redis_url, "--mode", mode, "--max-num-seqs", str(config.max_num_seqs),
                       "--name", name, "--log-level", "WARNING"]
            if config.worker_threads is not None:
                command += ["--num-threads", str(config.worker_threads)]
            worker = subprocess.Popen(command)
            try:
                _wait_for_worker(api_url, name, worker)
                for rate in config.rates_for(mode):
                    log.info("mode %s, arrivals %s, %d jobs", mode, _rate_text(rate), len(workload))
                    report = asyncio.run(LoadGenerator(api_url).run(mode, workload, rate, config.seed,
                                                                    worker_name=name))
                    reports.append(report)
                    print(json.dumps(_jsonable(report.summary())), flush=True)
            finally:
                worker.terminate()
                worker.wait(timeout=60)
    finally:
        api.terminate()
        api.wait(timeout=30)
        redis.stop()
    _write_outputs(reports, config, time.monotonic() - started)
    return reports


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


def replot(out_dir: Path) -> list[LoadReport]:
    """Rebuild the table, JSON and PNGs of an earlier run from its records.json (no load offered)."""
    saved = json.loads((out_dir / "bench.json").read_text())
    reports = [LoadReport.from_dict(run) for run in json.loads((out_dir / "records.json").read_text())]
    config = BenchConfig(model=saved["model"], num_requests=saved["num_requests"],
                         max_output=saved["max_output"], max_num_seqs=saved["max_num_seqs"],
                         seed=saved["seed"], worker_threads=saved["worker_threads"],
                         out_dir=out_dir, command=saved["command"])
    _write_outputs(reports, config, saved["wall_s"])
    return reports


def _write_outputs(reports: list[LoadReport], config: BenchConfig, wall_s: float) -> None:
    rows = [r.summary() for r in reports]
    # Every token's arrival time: `carpool bench --replot DIR` redraws from it.
    (config.out_dir / "records.json").write_text(json.dumps([r.to_dict() for r in reports]))
    (config.out_dir / "bench.json").write_text(json.dumps({
        "command": config.command, "model": config.model, "num_requests": config.num_requests,
        "max_output": config.max_output, "max_num_seqs": config.max_num_seqs, "seed": config.seed,
        "worker_threads": config.worker_threads, "wall_s": round(wall_s, 1),
        "runs": [_jsonable(row) for row in rows],
    }, indent=2))
    (config.out_dir / "bench.md").write_text(format_markdown(rows) + "\n")
    print(format_table(rows))
    title = (f"{config.model}: {config.num_requests} chat jobs, {config.max_output} output tokens "
             f"at most, {config.max_num_seqs} seats")
    plot_latency_distributions(reports, config.out_dir / "latency_cdf.png", title=title)
    plot_throughput_vs_rate(reports, config.out_dir / "throughput_vs_rate.png", title=title)
    print(f"wrote {config.out_dir}/bench.json, records.json, bench.md, latency_cdf.png and "
          f"throughput_vs_rate.png (the run took {wall_s:.0f} s)")


def _jsonable(row: dict[str, object]) -> dict[str, object]:
    """JSON has no Infinity: the all-at-once rate is written as the string "inf"."""
    return {**row, "rate": "inf" if math.isinf(row["rate"]) else row["rate"]}


def _rate_text(rate: float) -> str:
    return "all at once" if math.isinf(rate) else f"{rate:g} jobs/s"


def _triple(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    return " / ".join(f"{x * scale:.{digits}f}" for x in values)


def format_table(rows: list[dict[str, object]]) -> str:
    header = (f"{'mode':<11} {'rate':>5} {'jobs':>4} {'tok/s':>7} {'jobs/s':>6} "
              f"{'TTFT p50/p90/p99 s':>20} {'ITL p50/p90/p99 ms':>21} {'E2E p50/p90/p99 s':>20} "
              f"{'slots':>5} {'preempt':>7} {'ITL mean client/worker ms':>25}")
    lines = [header, "-" * len(header)]
    for row in rows:
        ttft, itl, e2e = row["ttft_p50_p90_p99"], row["itl_p50_p90_p99"], row["e2e_p50_p90_p99"]
        rate = "all" if math.isinf(row["rate"]) else f"{row['rate']:g}"
        failed = f" ({row['failed']} failed)" if row["failed"] else ""
        means = "/".join("-" if row.get(key) is None else f"{row[key] * 1000:.1f}"
                         for key in ("itl_mean_client_s", "itl_mean_worker_s"))
        lines.append(
            f"{row['label']:<11} {rate:>5} {row['jobs']:>4} {row['tokens_per_s']:>7} "
            f"{row['jobs_per_s']:>6} {'/'.join(f'{x:.2f}' for x in ttft):>20} "
            f"{'/'.join(f'{x * 1000:.0f}' for x in itl):>21} {'/'.join(f'{x:.2f}' for x in e2e):>20} "
            f"{row['slot_utilisation']:>5.0%} {row['preemptions']:>7} {means:>25}{failed}"
        )
    return "\n".join(lines)


def format_markdown(rows: list[dict[str, object]]) -> str:
    """The same table as Markdown, for the README."""
    lines = ["| mode | arrivals | tokens/s | jobs/s | TTFT p50 / p90 / p99 (s) "
             "| inter-token p50 / p90 / p99 (ms) | end-to-end p50 / p90 / p99 (s) "
             "| slot utilisation | preemptions |",
             "|---|---|--:|--:|--:|--:|--:|--:|--:|"]
    for row in rows:
        failed = f" ({row['failed']} of {row['jobs']} failed)" if row["failed"] else ""
        lines.append(
            f"| {row['label']}{failed} | {_rate_text(row['rate'])} | {row['tokens_per_s']:.1f} "
            f"| {row['jobs_per_s']:.2f} | {_triple(row['ttft_p50_p90_p99'])} "
            f"| {_triple(row['itl_p50_p90_p99'], 1000, 0)} | {_triple(row['e2e_p50_p90_p99'])} "
            f"| {row['slot_utilisation']:.0%} | {row['preemptions']} |")
    return "\n".join(lines)
