"""2,000 concurrent SSE subscribers on one API process (the 10,000 of issue #15, scaled to CI):
all connected before the first token, then Redis SIGKILLed and started again (its append-only
file) under them, then 20 jobs stream to 100 subscribers each.

Runs scripts/bench_sse_subscribers.py (a private redis-server, the real API process, a synthetic
worker, a light asyncio SSE swarm) and checks its report: every subscriber got every token once
and in order and the final event, the outage ridden out (no stream ended); the API held at most
its pool's 64 Redis connections (matched in CLIENT LIST by its sockets), whatever the number of
subscribers; its memory grew by a bounded amount per subscriber.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import pytest

from tests.integration.conftest import REPO

pytestmark = pytest.mark.reliability

NUM_JOBS = 20
PER_JOB = 100
NUM_TOKENS = 6
OUTAGE_S = 3


def test_two_thousand_subscribers_hold_bounded_memory_and_redis_connections() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = NUM_JOBS * PER_JOB + 1024  # a socket per subscriber in the swarm, as many in the API
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.skip(f"ulimit -n allows {hard} open files; the test needs {needed}")
    completed = subprocess.run(
        [sys.executable, "scripts/bench_sse_subscribers.py", "--jobs", str(NUM_JOBS),
         "--per-job", str(PER_JOB), "--tokens", str(NUM_TOKENS), "--step-ms", "1000",
         "--block-ms", "5000", "--connect-rate", "100", "--timeout", "240",
         "--outage-s", str(OUTAGE_S)],
        cwd=REPO, capture_output=True, text=True, timeout=420)
    lines = [line for line in completed.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no report (exit {completed.returncode}):\n{completed.stderr[-4000:]}"
    report = json.loads(lines[-1])
    assert (report["subscribers"], report["subscribers_complete"], report["unfinished"],
            report["errors"]) == (NUM_JOBS * PER_JOB, NUM_JOBS * PER_JOB, 0, []), report
    assert report["api_redis_connections_peak"] <= 64, report
    assert report["outage_s"] == OUTAGE_S, report
    assert report["api_rss_kb_per_subscriber"] <= 100, report
    print(f"RELIABILITY SSE subscribers: {report['subscribers']} on one API process, "
          f"{report['api_redis_connections_peak']} Redis connections, RSS "
          f"{report['api_rss_mb_before']} -> {report['api_rss_mb_peak']} MB "
          f"({report['api_rss_kb_per_subscriber']} KB a subscriber), through a {OUTAGE_S} s "
          f"Redis outage (API CPU {report['api_cpu_s_while_down']} s while it was down)")
