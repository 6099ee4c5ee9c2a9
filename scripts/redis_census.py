"""What one job asks of Redis: every command, counted by who sent it, per job.

One job at a time goes through the real API (`python -m api`, a subprocess) and one synthetic
worker (the real worker loop around an engine that gives each seat a token per step: no model),
with `--tokens` tokens each, submitted with POST /v1/jobs and followed over SSE to its end.
Redis' MONITOR records every command of the run; they are split by sender (the worker's
connections, the rest being the API's) and into the requests a client sent (a MULTI...EXEC
transaction or a script counts once: on a mostly idle Redis each one is a wake-up, the dearest
part of a small request on VMs) and the commands scripts ran inside. Divided by the jobs run.

    python scripts/redis_census.py --jobs 5 --tokens 20
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
from bench_fleet import _free_port, _start_api, _start_redis, _start_workers  # noqa: E402
from redis import Redis  # noqa: E402

# A MONITOR line: `1733291234.123456 [0 127.0.0.1:51234] "EVALSHA" "..."` (`[0 lua]` inside a
# script).
_LINE = re.compile(r'^(\d+\.\d+) \[\d+ ([^\]]+)\] "([^"]+)"')


def _client_addresses(client: Redis) -> set[str]:
    """The local addresses of a client's connections, as MONITOR names its clients."""
    pool = client.connection_pool
    addresses = set()
    for connection in [*pool._available_connections, *pool._in_use_connections]:  # type: ignore[attr-defined]
        sock = connection._sock
        if sock is not None:
            host, port = sock.getsockname()[:2]
            addresses.add(f"{host}:{port}")
    return addresses


def _census(lines: list[str], since: float, until: float,
            worker: set[str]) -> dict[str, Counter[str]]:
    sent = {"worker": Counter[str](), "api": Counter[str]()}
    inside: Counter[str] = Counter()
    in_multi: set[str] = set()
    for line in lines:
        match = _LINE.match(line)
        if not match or not since <= float(match.group(1)) <= until:
            continue
        client, command = match.group(2), match.group(3).upper()
        if client == "lua":
            inside[command] += 1
            continue
        who = "worker" if client in worker else "api"
        if command == "MULTI":
            in_multi.add(client)
            sent[who]["MULTI...EXEC"] += 1
        elif command == "EXEC":
            in_multi.discard(client)
        elif client in in_multi:
            sent[who][f"  in MULTI: {command}"] += 1
        else:
            sent[who][command] += 1
    return {"sent by the worker": sent["worker"], "sent by the API": sent["api"],
            "run inside scripts": inside}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=20, help="max_tokens of each job")
    parser.add_argument("--seats", type=int, default=4, help="max_num_seqs of the worker")
    parser.add_argument("--step-ms", type=float, default=25.0, help="synthetic step time")
    parser.add_argument("--durable-interval-ms", type=float, default=500.0,
                        help="the worker's CARPOOL_DURABLE_INTERVAL_MS (its default, 500)")
    args = parser.parse_args()
    server, url = _start_redis()
    port = _free_port()
    api = _start_api(url, port, "hub", 0.0, [])
    monitor = None
    try:
        args.workers = 1
        ((worker, _),) = _start_workers(url, args, [], 0.0, args.durable_interval_ms)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            client.post("/v1/jobs", json={"prompt": "warm up", "max_tokens": 2})
            time.sleep(1.0)
            monitor = subprocess.Popen(["redis-cli", "-u", url, "monitor"],
                                       stdout=subprocess.PIPE, text=True)
            lines: list[str] = []
            reader = threading.Thread(target=lambda: lines.extend(monitor.stdout or []),  # type: ignore[union-attr]
                                      daemon=True)
            reader.start()
            time.sleep(0.5)
            since = time.time()
            tokens = 0
            for _ in range(args.jobs):
                job = client.post("/v1/jobs", json={"prompt": "hello",
                                                    "max_tokens": args.tokens}).json()
                with client.stream("GET", f"/v1/jobs/{job['job_id']}/stream") as response:
                    tokens += sum(1 for line in response.iter_lines() if line == "event: token")
            until = time.time()
            time.sleep(0.5)
        # The worker's one client: its queue and its publisher share it (no presence, no shards).
        census = _census(lines, since, until, _client_addresses(worker.redis))
        print(f"{args.jobs} jobs of {tokens // args.jobs} tokens, one at a time; per job:")
        for title, counts in census.items():
            total = sum(n for name, n in counts.items() if not name.startswith("  "))
            print(f"\n{title}: {total / args.jobs:.1f}")
            for name, n in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
                print(f"  {name:28s} {n / args.jobs:6.1f}")
    finally:
        if monitor is not None:
            monitor.terminate()
        api.terminate()
        api.wait(timeout=30)
        server.terminate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
