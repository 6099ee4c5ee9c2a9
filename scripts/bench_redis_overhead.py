"""What Redis costs a batching worker per iteration, with a full batch of running jobs.

Runs the real worker loop (BatchingWorker) in this process on the CPU against a real
redis-server (a private one on a free port unless --redis-url is given), with `--num-jobs`
jobs that all run at once, and times every Redis round trip (the per-iteration publish, and
claims) against the whole iteration. Only iterations where the full batch is decoding count.

    python scripts/bench_redis_overhead.py                      # SmolLM2, 64 jobs
    python scripts/bench_redis_overhead.py --model PATH --num-jobs 64 --iterations 50
"""

from __future__ import annotations

import argparse
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from redis import Redis  # noqa: E402
from redis.exceptions import ConnectionError as RedisConnectionError  # noqa: E402

from protocol import JobSpec, Keys, SamplingParams, submit_jobs  # noqa: E402


@dataclass(slots=True)
class Timings:
    iteration_s: list[float] = field(default_factory=list)
    redis_s: list[float] = field(default_factory=list)
    round_trips: list[int] = field(default_factory=list)
    num_running: list[int] = field(default_factory=list)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_redis() -> tuple[subprocess.Popen, str, Path]:
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("redis-server is not installed; pass --redis-url")
    port, directory = _free_port(), Path(tempfile.mkdtemp(prefix="bench-redis-"))
    process = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                "--appendonly", "no", "--dir", str(directory)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(100):
        try:
            if Redis.from_url(url).ping():
                return process, url, directory
        except RedisConnectionError:
            time.sleep(0.05)
    sys.exit("redis-server did not start")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--redis-url", help="default: a private redis-server on a free port")
    parser.add_argument("--num-jobs", type=int, default=64)
    parser.add_argument("--iterations", type=int, default=40, help="full-batch iterations timed")
    parser.add_argument("--num-threads", type=int, default=None)
    args = parser.parse_args()

    server = None
    url = args.redis_url
    if url is None:
        server, url, _ = _start_redis()
    redis = Redis.from_url(url)
    redis.flushdb()
    try:
        return _run(args, url, redis)
    finally:
        redis.flushdb()
        if server is not None:
            server.terminate()
            server.wait(timeout=10)


def _run(args: argparse.Namespace, url: str, redis: Redis) -> int:
    from worker.engine.engine import Engine
    from worker.jobs.batching_worker import BatchingWorker
    from worker.jobs.settings import WorkerSettings

    settings = WorkerSettings(model=args.model, redis_url=url, name="bench",
                              max_num_seqs=args.num_jobs, lease_seconds=60, drain_seconds=0,
                              num_threads=args.num_threads)
    engine = Engine(settings.engine_config())
    worker = BatchingWorker(settings, engine, redis)
    timings = Timings()
    state = {"last": 0.0, "redis": 0.0, "trips": 0, "running": 0}

    def timed(method):
        def wrapper(*a, **k):
            started = time.perf_counter()
            try:
                return method(*a, **k)
            finally:
                state["redis"] += time.perf_counter() - started
                state["trips"] += 1
        return wrapper

    worker.publisher.flush = timed(worker.publisher.flush)
    worker.queue.claim = timed(worker.queue.claim)
    real_step = engine.step

    def step():
        now = time.perf_counter()
        # An iteration: from one step's start to the next (admit + step + publish).
        if state["last"] and state["running"] == args.num_jobs:
            timings.iteration_s.append(now - state["last"])
            timings.redis_s.append(state["redis"])
            timings.round_trips.append(state["trips"])
        state.update(last=now, redis=0.0, trips=0)
        out = real_step()
        state["running"] = out.stats.num_running if out.stats.num_prefill_tokens == 0 else 0
        if len(timings.iteration_s) >= args.iterations:
            worker._stop_requested = True  # drain_seconds=0: requeue and return
        return out

    engine.step = step
    model = settings.served_model_name
    max_tokens = args.iterations + 64  # enough to stay in decode for the whole measurement
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    specs = [JobSpec(job_id=uuid.uuid4().hex, model=model, prompt=f"Tell me story number {i}.",
                     sampling=sampling)
             for i in range(args.num_jobs)]
    submit_jobs(redis, specs, Keys())
    worker.run()

    share = sum(timings.redis_s) / sum(timings.iteration_s)
    print(f"model: {args.model} ({'SmolLM2-135M' if args.model == 'smollm2' else 'local'}), "
          f"jobs in the batch: {args.num_jobs}, timed iterations: {len(timings.iteration_s)}")
    print(f"iteration: median {statistics.median(timings.iteration_s) * 1000:.1f} ms; "
          f"Redis per iteration: median {statistics.median(timings.redis_s) * 1000:.2f} ms, "
          f"round trips per iteration: {sorted(set(timings.round_trips))}")
    print(f"Redis share of iteration time: {share * 100:.2f}% (target < 3%)")
    print("command: python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
