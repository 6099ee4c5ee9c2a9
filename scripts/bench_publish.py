"""Redis CPU per token of the worker's publish alone: the append script over a full batch.

A private redis-server; `--jobs` jobs claimed by one JobQueue; each step gives every job one token
and sends it with StreamPublisher (one MULTI/EXEC: the append script, stats, and the metrics when
their interval is due), as the worker loop does. Redis' CPU (INFO cpu) over `--steps` steps,
divided by the tokens appended.

    python scripts/bench_publish.py --jobs 64 --steps 400
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_fleet import _start_redis  # noqa: E402
from redis import Redis  # noqa: E402

from protocol import JobSpec, Keys, SamplingParams, TokenEntry, WorkerStats, submit_job  # noqa: E402
from worker.jobs.job_queue import JobQueue  # noqa: E402
from worker.jobs.job_scripts import JobScripts  # noqa: E402
from worker.jobs.running_job import RunningJob  # noqa: E402
from worker.jobs.stream_publisher import StreamPublisher  # noqa: E402


def _cpu_s(redis: Redis) -> float:
    info = redis.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=64)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--tokens-per-publish", type=int, default=1,
                        help="tokens of each job per publish (a worker with a stream interval "
                             "sends several steps' tokens at once, as one entry per job)")
    parser.add_argument("--metrics-interval-ms", type=float, default=1000.0,
                        help="the worker's CARPOOL_METRICS_INTERVAL_MS (0: metrics at every "
                             "publish)")
    parser.add_argument("--durable-interval-ms", type=float, default=0.0,
                        help="the worker's CARPOOL_DURABLE_INTERVAL_MS (0: every publish writes "
                             "the streams; else live tokens in between)")
    parser.add_argument("--step-ms", type=float, default=0.0,
                        help="least time a step takes (sleeps the rest), as an engine's would")
    args = parser.parse_args()
    server, url = _start_redis()
    try:
        redis = Redis.from_url(url)
        keys, scripts = Keys(), JobScripts()
        scripts.load(redis)
        for number in range(args.jobs):
            submit_job(redis, JobSpec(job_id=f"job-{number}", model="synthetic", prompt="hello",
                                      sampling=SamplingParams(
                                          max_tokens=args.steps * args.tokens_per_publish + 1)),
                       keys)
        queue = JobQueue(redis, scripts, keys, "bench", "synthetic", lease_ms=30_000, execution_ttl_s=120,
                         block_size=16)
        jobs = [RunningJob(lease=c.lease, spec=c.spec, state=c.state, result_ttl=c.result_ttl,
                           failure_ttl=c.failure_ttl, num_prompt_tokens=3, token_ids=[], texts=[],
                           claimed_at=c.claimed_at) for c in queue.claim(args.jobs)]
        assert len(jobs) == args.jobs
        publisher = StreamPublisher(redis, scripts, keys, "bench", 30_000,
                                    metrics_interval_s=args.metrics_interval_ms / 1000,
                                    durable_interval_s=args.durable_interval_ms / 1000)
        redis.config_resetstat()
        cpu0, started = _cpu_s(redis), time.monotonic()
        for step in range(args.steps):
            step_started = time.monotonic()
            now = time.time()
            for job in jobs:
                first = step * args.tokens_per_publish
                job.add_tokens([TokenEntry(first + i, 1000 + (first + i) % 500, " tok")
                                for i in range(args.tokens_per_publish)], now)
                publisher.append(job)
                publisher.observe("inter_token_latency_seconds", 0.025)  # as the worker does
            publisher.stats(WorkerStats(name="bench", model="synthetic", mode="continuous",
                                        updated_at=now, num_running=len(jobs)), 30)
            report = publisher.flush()
            assert not report.refused
            time.sleep(max(0.0, args.step_ms / 1000 - (time.monotonic() - step_started)))
        cpu_us = (_cpu_s(redis) - cpu0) * 1e6
        tokens = args.jobs * args.steps * args.tokens_per_publish
        commands = redis.info("commandstats")
        print(json.dumps({"jobs": args.jobs, "steps": args.steps,
                          "tokens_per_publish": args.tokens_per_publish, "tokens": tokens,
                          "wall_s": round(time.monotonic() - started, 2),
                          "redis_cpu_us_per_token": round(cpu_us / tokens, 2),
                          # Redis' time inside commands (nested ones included in EXEC and
                          # EVALSHA), per token.
                          "command_us_per_token": {
                              name.removeprefix("cmdstat_"): round(stat["usec"] / tokens, 2)
                              for name, stat in commands.items()
                              if stat["usec"] / tokens >= 0.01},
                          "tokens_per_s_per_redis_core": round(tokens / (cpu_us / 1e6))}))
    finally:
        server.terminate()
        server.wait(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
