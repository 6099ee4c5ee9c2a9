"""Redis CPU per generated token at fleet scale: synthetic workers, a real API, SSE subscribers.

No model. Each synthetic worker is the real worker loop (BatchingWorker: JobQueue claims,
StreamPublisher's one round trip per step, its Lua scripts and fencing) around a SyntheticEngine
that gives every seat one token per step at a fixed step time. One API process (`python -m api`,
a subprocess) serves the jobs; httpx clients keep `--concurrency` jobs in flight, each followed by
`--subscribers` SSE readers. Redis' own CPU (INFO cpu: used_cpu_sys + used_cpu_user) is read
before and after a measurement window, on a private redis-server.

    python scripts/bench_fleet.py                       # both readers, side by side
    python scripts/bench_fleet.py --reader hub --workers 2 --seats 32 --step-ms 20 --seconds 20
    python scripts/bench_fleet.py --reader hub --shards 1,2   # streams on 1, then 2 shards
    python scripts/bench_fleet.py --reader hub --stream-interval-ms 0,200   # publish each step, then 200 ms
    python scripts/bench_fleet.py --reader hub --seats 128 --redis-cpu-share 0.04  # Redis saturated

With `--shards N` the token streams live on N private redis-servers of their own (stream
shards, CARPOOL_STREAM_REDIS_URLS) and the queue on another; each server's CPU is read apart.
One busy Redis core is the limit of each server, so the fleet's ceiling is the generated tokens/s
at which the busiest server would reach one core: tokens/s / (its CPU seconds per second).

With `--redis-cpu-share S` every redis-server runs capped at S of one core (a cgroup of its own,
CFS bandwidth: 1 ms of CPU per 1/S ms), so that the fleet, offering more than that, keeps Redis
saturated: the ceiling is then measured where it is reached, not extrapolated from a Redis that
sleeps between requests (on VMs each wake-up from idle costs it more than the commands do). It
needs a writable cgroup cpu controller (v1 or v2), as root in a container.

Reported: us of Redis CPU per generated token (the workers' own count), per
token delivered (every subscriber), the generated tokens/s one Redis core would carry at that
cost, and Redis commands per generated token. With `--by-script`, SLOWLOG records every command
in the window, so Redis' time per token is also split by Lua script (INFO commandstats lumps them
all under EVALSHA), and each script's time per call into its own commands and the rest (Lua and
the calls' glue); logging every command adds to the figures, so use it to compare scripts, not
for the totals.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import hashlib
import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
from redis import Redis  # noqa: E402
from redis.exceptions import ConnectionError as RedisConnectionError  # noqa: E402

from protocol.keys import Keys  # noqa: E402
from worker.engine.synthetic_engine import SyntheticEngine  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
_SLOWLOG_LEN = 500_000
MODEL = "synthetic"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class CpuCap:
    """One process held to `share` of a core by a cgroup of its own (CFS bandwidth control)."""

    _V1 = Path("/sys/fs/cgroup/cpu")
    _V2 = Path("/sys/fs/cgroup")

    def __init__(self, pid: int, share: float) -> None:
        if not 0.001 <= share <= 1:
            sys.exit(f"--redis-cpu-share must be in [0.001, 1], got {share}")
        quota_us = 1000  # the least quota the kernel takes
        period_us = round(quota_us / share)
        if (self._V1 / "cpu.cfs_quota_us").exists():
            self.path = self._V1 / f"carpool-bench-{pid}"
            files = {"cpu.cfs_period_us": str(period_us), "cpu.cfs_quota_us": str(quota_us)}
        elif "cpu" in (self._V2 / "cgroup.controllers").read_text(errors="ignore").split():
            self.path = self._V2 / f"carpool-bench-{pid}"
            files = {"cpu.max": f"{quota_us} {period_us}"}
        else:
            sys.exit("--redis-cpu-share needs the cgroup cpu controller (/sys/fs/cgroup)")
        try:
            self.path.mkdir(exist_ok=True)
            for name, value in files.items():
                (self.path / name).write_text(value)
            (self.path / "cgroup.procs").write_text(str(pid))
        except OSError as exc:
            sys.exit(f"--redis-cpu-share: cannot set up the cgroup {self.path} ({exc}); it needs "
                     f"write access to the cgroup cpu controller (root)")

    def remove(self) -> None:
        """Delete the cgroup (its process has exited)."""
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def _start_redis(appendonly: bool = False) -> tuple[subprocess.Popen[bytes], str]:
    """A private redis-server; with `appendonly`, every write fsynced to its file, so that the
    same command line (`process.args`) starts it again with its data."""
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("redis-server is not installed")
    port, directory = _free_port(), tempfile.mkdtemp(prefix="bench-fleet-redis-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)  # a run used to leave it in /tmp
    durability = ["--appendonly", "yes", "--appendfsync", "always"] if appendonly else ["--appendonly", "no"]
    return _redis_server([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                          *durability, "--dir", directory], f"redis://127.0.0.1:{port}/0")


def _redis_server(command: list[str], url: str) -> tuple[subprocess.Popen[bytes], str]:
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            if Redis.from_url(url).ping():
                return process, url
        except RedisConnectionError:
            time.sleep(0.05)
    sys.exit("redis-server did not start")


def _start_api(url: str, port: int, reader: str, interval_ms: float,
               shard_urls: list[str]) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "CARPOOL_REDIS_URL": url,
           "CARPOOL_STREAM_REDIS_URLS": ",".join(shard_urls),
           "CARPOOL_STREAM_HUB_INTERVAL_MS": str(interval_ms),
           "CARPOOL_PORT": str(port), "CARPOOL_STREAM_HUB": "true" if reader == "hub" else "false",
           "CARPOOL_LOG_LEVEL": "warning", "CARPOOL_MAX_QUEUE_DEPTH": "100000"}
    process = subprocess.Popen([sys.executable, "-m", "api"], cwd=REPO, env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code < 500:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    process.kill()
    sys.exit("the API did not start")


def _start_workers(url: str, args: argparse.Namespace, shard_urls: list[str],
                   stream_interval_ms: float,
                   durable_interval_ms: float) -> list[tuple[Any, threading.Thread]]:
    from worker.jobs.batching_worker import BatchingWorker
    from worker.jobs.settings import WorkerSettings

    workers = []
    for number in range(args.workers):
        settings = WorkerSettings(model=MODEL, redis_url=url, name=f"synthetic-{number}",
                                  max_num_seqs=args.seats, drain_seconds=0,
                                  stream_redis_urls=shard_urls,
                                  stream_interval_ms=stream_interval_ms,
                                  durable_interval_ms=durable_interval_ms)
        worker = BatchingWorker(settings, SyntheticEngine(args.seats, args.step_ms / 1000),  # type: ignore[arg-type]
                                Redis.from_url(url), register_presence=False)
        thread = threading.Thread(target=worker.run, name=settings.name, daemon=True)
        thread.start()
        workers.append((worker, thread))
    return workers


@dataclass(slots=True)
class Counts:
    generated: int = 0  # token events the first subscriber of each job received
    delivered: int = 0  # token events all subscribers received
    jobs_done: int = 0
    errors: list[str] = field(default_factory=list)


async def _follow(client: httpx.AsyncClient, job_id: str, counts: Counts, is_first: bool) -> None:
    async with client.stream("GET", f"/v1/jobs/{job_id}/stream") as response:
        if response.status_code != 200:
            counts.errors.append(f"stream {response.status_code}")
            return
        async for line in response.aiter_lines():
            if line == "event: token":
                counts.delivered += 1
                if is_first:
                    counts.generated += 1
            elif line == "event: done":
                return


async def _job_slot(client: httpx.AsyncClient, args: argparse.Namespace, counts: Counts,
                    stop: asyncio.Event) -> None:
    while not stop.is_set():
        response = await client.post("/v1/jobs", json={"prompt": "hello", "max_tokens": args.tokens})
        if response.status_code != 202:
            counts.errors.append(f"submit {response.status_code}: {response.text[:200]}")
            await asyncio.sleep(0.5)
            continue
        job_id = response.json()["job_id"]
        await asyncio.gather(*(_follow(client, job_id, counts, number == 0)
                               for number in range(args.subscribers)))
        counts.jobs_done += 1


def redis_cpu_seconds(redis: Redis) -> float:
    """Redis' own CPU seconds so far (INFO: used_cpu_sys + used_cpu_user)."""
    info = redis.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def command_stats(redis: Redis) -> dict[str, tuple[int, int]]:
    """Per command: (calls, microseconds Redis spent executing them)."""
    return {name.removeprefix("cmdstat_"): (int(stats["calls"]), int(stats["usec"]))
            for name, stats in redis.info("commandstats").items()}


def _round_trips(servers: dict[str, Redis]) -> int:
    """Requests the servers have read so far (INFO stats total_reads_processed: one per client
    round trip, however many commands it pipelines). On a lightly loaded VM each wakes Redis from
    idle, and that wake-up, not the commands, is most of what a round trip costs it."""
    return sum(int(redis.info("stats")["total_reads_processed"]) for redis in servers.values())


def _published(redis: Redis) -> int:
    """Tokens the workers have published so far (their generated_tokens_total counter)."""
    return int(redis.hget(Keys().counters(), "generated_tokens_total") or 0)


def _script_names() -> dict[str, str]:
    from worker.jobs.job_scripts import JobScripts

    return {hashlib.sha1(source.encode()).hexdigest(): name
            for name, source in JobScripts.SOURCES.items()}


# SLOWLOG's client address for a command a script ran (its own caller's for everything else).
_SCRIPT_CLIENT = "?:0"


def script_split(entries: list[dict[str, Any]], names: dict[str, str]) -> dict[str, tuple[int, int, int]]:
    """SLOWLOG entries (any order) as {command, or evalsha:<script name>: (calls, usec, usec of the
    commands it ran)}. A script's commands are logged, under _SCRIPT_CLIENT, just before the
    script itself (Redis runs nothing else meanwhile), so they are counted twice: on their own
    line and in their script's third figure; the script's usec less that figure is what Lua and
    the calls' glue (arguments in, replies back into Lua values) cost."""
    totals: dict[str, tuple[int, int, int]] = {}
    nested = 0
    for entry in sorted(entries, key=lambda e: int(e["id"])):
        command = entry["command"]
        words = (command.decode(errors="replace") if isinstance(command, bytes) else str(command)).split(" ")[:2]
        name = words[0].lower()
        client = entry.get("client_address", b"")
        client = client.decode() if isinstance(client, bytes) else str(client)
        its_commands = 0
        if client == _SCRIPT_CLIENT:
            nested += int(entry["duration"])
        elif name in ("evalsha", "eval"):
            its_commands, nested = nested, 0
        if name == "evalsha" and len(words) > 1:
            name = f"evalsha:{names.get(words[1], words[1][:8])}"
        calls, usec, inner = totals.get(name, (0, 0, 0))
        totals[name] = (calls + 1, usec + int(entry["duration"]), inner + its_commands)
    return totals


def _by_script(servers: dict[str, Redis], generated: int) -> dict[str, str]:
    """Each command in the servers' SLOWLOG (EVALSHA by script name): us per generated token, us
    per call (a script's cost per job needs both: how often it runs and what one run costs) and,
    for a script, how much of a call its own commands took."""
    names = _script_names()
    totals: dict[str, tuple[int, int, int]] = {}
    for redis in servers.values():
        for name, (calls, usec, inner) in script_split(redis.slowlog_get(_SLOWLOG_LEN), names).items():
            before = totals.get(name, (0, 0, 0))
            totals[name] = (before[0] + calls, before[1] + usec, before[2] + inner)
    busiest = sorted(totals.items(), key=lambda item: -item[1][1])[:12]
    return {name: f"{usec / max(generated, 1):.2f} us/token, {usec / calls:.1f} us/call"
                  + (f" (its commands {inner / calls:.1f})" if name.startswith("eval") else "")
            for name, (calls, usec, inner) in busiest}


def _sum_stats(servers: dict[str, Redis]) -> dict[str, tuple[int, int]]:
    total: dict[str, tuple[int, int]] = {}
    for redis in servers.values():
        for name, (calls, usec) in command_stats(redis).items():
            before = total.get(name, (0, 0))
            total[name] = (before[0] + calls, before[1] + usec)
    return total


async def _measure(base_url: str, servers: dict[str, Redis],
                   args: argparse.Namespace) -> dict[str, Any]:
    counts = Counts()
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, timeout=60, limits=limits) as client:
        slots = [asyncio.create_task(_job_slot(client, args, counts, stop))
                 for _ in range(args.concurrency)]
        await asyncio.sleep(args.warmup)
        if args.by_script:
            for redis in servers.values():
                redis.config_set("slowlog-log-slower-than", 0)
                redis.config_set("slowlog-max-len", _SLOWLOG_LEN)
                redis.slowlog_reset()
        cpus0 = {name: redis_cpu_seconds(redis) for name, redis in servers.items()}
        published0, trips0, jobs0 = _published(servers["main"]), _round_trips(servers), counts.jobs_done
        calls0, gen0, del0, t0 = (_sum_stats(servers), counts.generated, counts.delivered,
                                  time.monotonic())
        await asyncio.sleep(args.seconds)
        cpus1 = {name: redis_cpu_seconds(redis) for name, redis in servers.items()}
        published1, trips1, jobs1 = _published(servers["main"]), _round_trips(servers), counts.jobs_done
        calls1, gen1, del1, t1 = (_sum_stats(servers), counts.generated, counts.delivered,
                                  time.monotonic())
        by_script = _by_script(servers, published1 - published0) if args.by_script else None
        stop.set()
        await asyncio.wait(slots, timeout=60)
    # Generated: what the workers published in the window (their generated_tokens_total). The
    # subscribers' count is not it: a subscriber that joined late reads its job's earlier tokens
    # inside the window (at 256 jobs on a loaded box it ran 1.4x above what was published).
    generated, delivered = published1 - published0, del1 - del0
    first_subscriber_tokens = gen1 - gen0
    window = t1 - t0
    cpu_by_server = {name: cpus1[name] - cpus0[name] for name in servers}
    cpu_us = sum(cpu_by_server.values()) * 1e6
    # Each server saturates at one core: the busiest one sets the fleet's ceiling.
    busiest = max(cpu_by_server, key=lambda name: cpu_by_server[name])
    busiest_share = cpu_by_server[busiest] / window
    calls = {name: calls1[name][0] - calls0.get(name, (0, 0))[0] for name in calls1}
    usec = {name: calls1[name][1] - calls0.get(name, (0, 0))[1] for name in calls1}
    per_token = cpu_us / max(generated, 1)
    command_us = sum(usec.values())
    return {
        "generated_tokens": generated, "delivered_tokens": delivered,
        "first_subscriber_tokens": first_subscriber_tokens,
        "window_s": round(window, 2), "generated_tokens_per_s": round(generated / window, 1),
        "redis_cpu_s": round(cpu_us / 1e6, 3),
        "redis_cpu_us_per_generated_token_by_server": {
            name: round(cpu * 1e6 / max(generated, 1), 2) for name, cpu in cpu_by_server.items()},
        "busiest_server": busiest,
        # Of one core; with --redis-cpu-share, at that share the server was saturated.
        "busiest_server_cpu_share": round(busiest_share, 4),
        "ceiling_generated_tokens_per_s": (round(generated / window / busiest_share)
                                           if busiest_share else None),
        "redis_cpu_us_per_generated_token": round(per_token, 2),
        "redis_cpu_us_per_delivered_token": round(cpu_us / max(delivered, 1), 2),
        "generated_tokens_per_s_per_redis_core": round(1e6 / per_token) if per_token else None,
        # What commands cost inside Redis; the rest of its CPU is I/O and the event loop.
        "command_us_per_generated_token": round(command_us / max(generated, 1), 2),
        "jobs_done_per_s": round((jobs1 - jobs0) / window, 2),
        "round_trips_per_s": round((trips1 - trips0) / window, 1),
        "round_trips_per_1000_generated_tokens": round((trips1 - trips0) * 1000 / max(generated, 1), 1),
        "command_us_per_generated_token_by_command": {
            name: round(n / max(generated, 1), 2)
            for name, n in sorted(usec.items(), key=lambda item: -item[1]) if n},
        "commands_per_generated_token": {name: round(n / max(generated, 1), 3)
                                         for name, n in sorted(calls.items()) if n},
        "errors": counts.errors[:5],
        **({"slowlog_us_per_generated_token_by_script": by_script} if by_script else {}),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reader", choices=["hub", "per-subscriber", "both"], default="both",
                        help="how the API follows streams: its StreamHub, or an XREAD each")
    parser.add_argument("--hub-interval-ms", type=float, default=0.0,
                        help="the hub's least time between XREADs (stream_hub_interval_ms)")
    parser.add_argument("--stream-interval-ms", default="0",
                        help="the workers' CARPOOL_STREAM_INTERVAL_MS (0: publish every step); "
                             "several, comma-separated, run one after the other")
    parser.add_argument("--durable-interval-ms", default="0",
                        help="the workers' CARPOOL_DURABLE_INTERVAL_MS (0: every publish writes "
                             "the streams; else live tokens between); several, comma-separated, "
                             "run one after the other")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seats", type=int, default=32, help="max_num_seqs of each worker")
    parser.add_argument("--step-ms", type=float, default=25.0, help="synthetic step time")
    parser.add_argument("--tokens", type=int, default=200, help="max_tokens of each job")
    parser.add_argument("--concurrency", type=int, default=0,
                        help="jobs in flight (default: every seat, workers x seats)")
    parser.add_argument("--subscribers", type=int, default=1, help="SSE readers per job")
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--seconds", type=float, default=20.0, help="measurement window")
    parser.add_argument("--by-script", action="store_true",
                        help="split Redis' time per token by Lua script (SLOWLOG every command)")
    parser.add_argument("--redis-cpu-share", type=float, default=0.0,
                        help="cap every redis-server at this share of one core (e.g. 0.04), so "
                             "the fleet saturates it and the ceiling is measured there")
    parser.add_argument("--shards", default="0",
                        help="stream shards, a comma-separated list of counts run one after the "
                             "other (0: the streams on the queue's Redis, as by default)")
    args = parser.parse_args()
    args.concurrency = args.concurrency or args.workers * args.seats
    readers = ["per-subscriber", "hub"] if args.reader == "both" else [args.reader]
    shard_counts = [int(n) for n in args.shards.split(",")]
    intervals = [float(ms) for ms in args.stream_interval_ms.split(",")]
    durables = [float(ms) for ms in args.durable_interval_ms.split(",")]

    servers = [_start_redis() for _ in range(1 + max(shard_counts))]
    caps: list[CpuCap] = []
    url = servers[0][1]
    results = {}
    try:
        if args.redis_cpu_share:
            caps = [CpuCap(process.pid, args.redis_cpu_share) for process, _ in servers]
        for num_shards in shard_counts:
            shard_urls = [shard_url for _, shard_url in servers[1:1 + num_shards]]
            clients = {"main": Redis.from_url(url),
                       **{f"shard-{i}": Redis.from_url(u) for i, u in enumerate(shard_urls)}}
            for reader, interval_ms, durable_ms in itertools.product(readers, intervals, durables):
                for client in clients.values():
                    client.flushdb()
                workers = _start_workers(url, args, shard_urls, interval_ms, durable_ms)
                port = _free_port()
                api = _start_api(url, port, reader, args.hub_interval_ms, shard_urls)
                label = f"{reader}, {num_shards} shards" if num_shards else reader
                if len(intervals) > 1 or interval_ms:
                    label += f", {interval_ms:g} ms"
                if len(durables) > 1 or durable_ms:
                    label += f", durable {durable_ms:g} ms"
                try:
                    results[label] = asyncio.run(_measure(f"http://127.0.0.1:{port}", clients, args))
                finally:
                    api.terminate()
                    api.wait(timeout=30)
                    for worker, _ in workers:
                        worker.request_stop(0, None)
                    for _, thread in workers:
                        thread.join(timeout=30)
                print(json.dumps({"run": label, **results[label]}), flush=True)
    finally:
        for process, _ in servers:
            process.terminate()
            process.wait(timeout=10)
        for cap in caps:
            cap.remove()
    config = {k: getattr(args, k) for k in ("hub_interval_ms", "stream_interval_ms",
                                             "durable_interval_ms",
                                             "workers", "seats", "step_ms", "tokens", "concurrency",
                                            "subscribers", "seconds", "shards",
                                            "redis_cpu_share")}
    print(json.dumps({"config": config}))
    print(f"{'run':<36}{'tok/s':>9}{'us/gen tok':>12}{'us/deliv tok':>14}{'tok/s/core':>12}"
          f"{'ceiling tok/s':>15}{'trips/s':>9}{'trips/1k tok':>14}{'busiest share':>15}")
    for label, r in results.items():
        print(f"{label:<36}{r['generated_tokens_per_s']:>9}"
              f"{r['redis_cpu_us_per_generated_token']:>12}"
              f"{r['redis_cpu_us_per_delivered_token']:>14}"
              f"{r['generated_tokens_per_s_per_redis_core']!s:>12}"
              f"{r['ceiling_generated_tokens_per_s']!s:>15}{r['round_trips_per_s']:>9}"
              f"{r['round_trips_per_1000_generated_tokens']:>14}"
              f"{r['busiest_server_cpu_share']:>15}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
