"""Thousands of concurrent SSE subscribers on one API process: its memory and Redis connections.

A private redis-server, one API process (`python -m api`, StreamHub on) and one synthetic worker
(the real worker loop, no model; scripts/bench_fleet.py). `--jobs` jobs are queued first, then
`--per-job` subscribers follow each (loadgen/sse_swarm.py: one light asyncio connection each), so
all of them are connected at once before a token exists; then the worker starts and every job
streams `--tokens` tokens to all its subscribers.

    python scripts/bench_sse_subscribers.py --jobs 100 --per-job 100     # 10,000 subscribers

Prints one JSON object: the API's resident memory before the subscribers, with all of them
connected and at its peak while streaming; the Redis connections the API process holds (matched
in CLIENT LIST by its sockets' ports) at those moments; and how many subscribers got every token
exactly once, in order, and the final event.

With `--outage-s S`, once every subscriber is connected the redis-server (append-only file,
fsynced at every write) is SIGKILLed and started again S seconds later, before any token: the
API rides the outage out (api/stream_outages.py, CARPOOL_STREAM_OUTAGE_S); the report adds the
API's CPU seconds over the outage and until every subscriber is reading again.

    python scripts/bench_sse_subscribers.py --jobs 20 --per-job 100 --outage-s 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402
from redis import Redis  # noqa: E402

from loadgen.sse_swarm import SubscriberResult, subscribe  # noqa: E402
from protocol import JobSpec, submit_job  # noqa: E402
from scripts.bench_fleet import _free_port, _redis_server, _start_api, _start_redis  # noqa: E402
from worker.engine.synthetic_engine import SyntheticEngine  # noqa: E402

MODEL = "synthetic"


def _rss_bytes(pid: int) -> int:
    return int(psutil.Process(pid).memory_info().rss)


def _api_redis_connections(redis: Redis, pid: int) -> int:
    """Connections in Redis' CLIENT LIST whose client end is a socket of process `pid`."""
    ports = {c.laddr.port for c in psutil.Process(pid).net_connections(kind="tcp") if c.laddr}
    return sum(1 for client in redis.client_list()
               if int(client["addr"].rsplit(":", 1)[1]) in ports)


def _raise_fd_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            sys.exit(f"ulimit -n allows {hard} open files; {needed} are needed")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def _cpu_seconds(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def _start_worker(url: str, args: argparse.Namespace) -> tuple[object, threading.Thread]:
    from worker.jobs.batching_worker import BatchingWorker
    from worker.jobs.settings import WorkerSettings

    settings = WorkerSettings(model=MODEL, redis_url=url, name="synthetic-sse",
                              max_num_seqs=args.jobs, drain_seconds=0)
    worker = BatchingWorker(settings, SyntheticEngine(args.jobs, args.step_ms / 1000),  # type: ignore[arg-type]
                            Redis.from_url(url), register_presence=False)
    thread = threading.Thread(target=worker.run, name=settings.name, daemon=True)
    thread.start()
    return worker, thread


async def _run(base_url: str, job_ids: list[str], args: argparse.Namespace, api_pid: int,
               redis: Redis, url: str, servers: list[subprocess.Popen[bytes]]) -> dict[str, object]:
    rss_before = _rss_bytes(api_pid)
    connections_before = _api_redis_connections(redis, api_pid)
    events = [asyncio.Event() for _ in range(len(job_ids) * args.per_job)]
    tasks: list[asyncio.Task[SubscriberResult]] = []
    started = time.monotonic()
    for number, event in enumerate(events):
        tasks.append(asyncio.create_task(subscribe(base_url, job_ids[number % len(job_ids)], event)))
        if number % 50 == 49:
            # A steady ramp at --connect-rate: each connect costs the API a request (auth, two
            # Redis reads); faster than it takes them, they queue in its event loop.
            await asyncio.sleep(max(0.0, started + (number + 1) / args.connect_rate
                                    - time.monotonic()))
    await asyncio.wait_for(asyncio.gather(*(event.wait() for event in events)), args.timeout)
    connect_s = time.monotonic() - started
    await asyncio.sleep(1.0)  # every subscriber is inside follow(), blocked on the hub
    rss_connected = _rss_bytes(api_pid)
    connections_connected = _api_redis_connections(redis, api_pid)
    outage: dict[str, object] = {}
    if args.outage_s > 0:
        outage = await _redis_outage(servers, url, args.outage_s, api_pid)
    worker, thread = _start_worker(url, args)
    rss_peak, connections_peak = rss_connected, connections_connected
    pending: set[asyncio.Task[SubscriberResult]] = set(tasks)
    deadline = time.monotonic() + args.timeout
    while pending and time.monotonic() < deadline:
        _, pending = await asyncio.wait(pending, timeout=0.5)
        rss_peak = max(rss_peak, _rss_bytes(api_pid))
        connections_peak = max(connections_peak, _api_redis_connections(redis, api_pid))
    worker.request_stop(0, None)  # type: ignore[attr-defined]
    thread.join(timeout=30)
    results = [task.result() for task in tasks if task.done()]
    expected = [f"0-{i + 1}" for i in range(args.tokens)]
    complete = sum(1 for r in results if r.status == 200 and r.is_done and r.token_ids == expected)
    errors = sorted({r.error or f"status {r.status}, {len(r.token_ids)} tokens, done={r.is_done}"
                     for r in results if not (r.is_done and r.token_ids == expected)})
    mb = 1024 * 1024
    return {
        "subscribers": len(tasks), "jobs": len(job_ids), "tokens_per_job": args.tokens,
        "subscribers_complete": complete, "unfinished": len(pending), "errors": errors[:5],
        "connect_s": round(connect_s, 1),
        "api_rss_mb_before": round(rss_before / mb, 1),
        "api_rss_mb_connected": round(rss_connected / mb, 1),
        "api_rss_mb_peak": round(rss_peak / mb, 1),
        "api_rss_kb_per_subscriber": round((rss_peak - rss_before) / 1024 / max(len(tasks), 1), 1),
        "api_redis_connections_before": connections_before,
        "api_redis_connections_connected": connections_connected,
        "api_redis_connections_peak": connections_peak,
        **outage,
    }


async def _redis_outage(servers: list[subprocess.Popen[bytes]], url: str, outage_s: float,
                        api_pid: int) -> dict[str, object]:
    """SIGKILL the redis-server, start it again (same command line, its file) after `outage_s`;
    the API's CPU over the outage and the 2 s after (its readers back on their streams)."""
    cpu_before = _cpu_seconds(api_pid)
    servers[0].kill()
    servers[0].wait(timeout=10)
    await asyncio.sleep(outage_s)
    cpu_down = _cpu_seconds(api_pid) - cpu_before
    servers[0], _ = _redis_server(list(servers[0].args), url)  # type: ignore[arg-type]
    await asyncio.sleep(2.0)
    return {"outage_s": outage_s, "api_cpu_s_while_down": round(cpu_down, 2),
            "api_cpu_s_back_2s": round(_cpu_seconds(api_pid) - cpu_before - cpu_down, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--per-job", type=int, default=100, help="subscribers per job")
    parser.add_argument("--tokens", type=int, default=8, help="tokens per job")
    parser.add_argument("--step-ms", type=float, default=500.0, help="one token per job each step")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--connect-rate", type=float, default=200.0,
                        help="new subscribers a second")
    parser.add_argument("--block-ms", type=int, default=1000,
                        help="the API's stream_block_ms: how often an idle subscriber wakes")
    parser.add_argument("--outage-s", type=float, default=0.0,
                        help="Redis killed for this long once all subscribers are connected "
                             "(0: no outage)")
    args = parser.parse_args()
    # This process holds one socket per subscriber, the API as many; the API inherits the limit.
    _raise_fd_limit(args.jobs * args.per_job + 1024)

    server, url = _start_redis(appendonly=args.outage_s > 0)
    servers = [server]  # (the outage starts it again)
    redis = Redis.from_url(url)
    port = _free_port()
    os.environ["CARPOOL_STREAM_BLOCK_MS"] = str(args.block_ms)  # the API process inherits it
    api = _start_api(url, port, "hub", 0.0, [])
    try:
        job_ids = []
        for _ in range(args.jobs):
            spec = JobSpec.from_dict({"job_id": uuid.uuid4().hex, "model": MODEL,
                                      "prompt": "hello", "max_tokens": args.tokens,
                                      "created_at": time.time()})
            submit_job(redis, spec)
            job_ids.append(spec.job_id)
        report = asyncio.run(_run(f"http://127.0.0.1:{port}", job_ids, args, api.pid, redis, url,
                                  servers))
    finally:
        api.terminate()
        api.wait(timeout=30)
        servers[0].terminate()
        servers[0].wait(timeout=10)
    print(json.dumps(report), flush=True)
    return 0 if report["subscribers_complete"] == report["subscribers"] else 1


if __name__ == "__main__":
    sys.exit(main())
