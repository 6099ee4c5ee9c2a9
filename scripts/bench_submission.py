"""What one admitted submission costs Redis: its CPU (INFO cpu: used_cpu_sys + used_cpu_user) and
the submission's wall time, as the API submits (QueueAdmission's check and the enqueue in one Lua
script, built and sent from a worker thread with the submissions arriving beside it:
api/submission_batcher.py), into a private redis-server.

    python scripts/bench_submission.py                    # 400 submissions back to back, then 5 ms apart
    python scripts/bench_submission.py --jobs 1000 --gaps-ms 0,1,25
    python scripts/bench_submission.py --concurrency 32   # 32 submitters at once, each back to back
    python scripts/bench_submission.py --concurrency 1,8,32,128 --gaps-ms 0 --rounds 2 --per-call

With `--per-call`, each run is followed by the same run with every submission a request of its
own from a worker thread of its own (as the API sent them before the batcher), alternated.

Back to back, Redis hardly sleeps between requests; paced, each request wakes it from idle, which
on VMs costs more than the commands (README, "Fleet scale").
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import anyio.to_thread  # noqa: E402
from bench_fleet import _start_redis, redis_cpu_seconds  # noqa: E402
from redis import Redis  # noqa: E402

from api.queue_admission import QueueAdmission  # noqa: E402
from api.submission_batcher import SubmissionBatcher  # noqa: E402
from protocol import JobSpec, Keys, SamplingParams, submit_job  # noqa: E402
from protocol.job_submission import prepare_submission  # noqa: E402


async def _submit(redis: Redis, admission: QueueAdmission, batcher: SubmissionBatcher | None
                  ) -> float:
    spec = JobSpec(job_id=uuid.uuid4().hex, model="bench", prompt="hello there",
                   sampling=SamplingParams(max_tokens=50), owner="bench")
    started = time.perf_counter()
    check = admission.admission("bench", 1, "bench").check
    if batcher is None:  # a request of its own, from a worker thread of its own
        await anyio.to_thread.run_sync(partial(submit_job, redis, spec, check=check))
    else:
        await batcher.submit(partial(prepare_submission, redis, [spec], check=check))
    return time.perf_counter() - started


async def _submitter(redis: Redis, admission: QueueAdmission, batcher: SubmissionBatcher | None,
                     jobs: int, gap_ms: float, walls: list[float]) -> None:
    for _ in range(jobs):
        walls.append(await _submit(redis, admission, batcher))
        if gap_ms:
            await asyncio.sleep(gap_ms / 1000)


async def _measure(redis: Redis, admission: QueueAdmission, batcher: SubmissionBatcher | None,
                   concurrency: int, jobs: int, gap_ms: float) -> str:
    cpu0, started = redis_cpu_seconds(redis), time.perf_counter()
    requests0 = batcher.requests_sent if batcher else 0
    walls: list[float] = []
    await asyncio.gather(*(_submitter(redis, admission, batcher, max(1, jobs // concurrency),
                                      gap_ms, walls) for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    cpu_us = (redis_cpu_seconds(redis) - cpu0) * 1e6
    requests = (batcher.requests_sent - requests0) / len(walls) if batcher else 1.0
    return (f"{'batched' if batcher else 'per-call'}, {concurrency} submitter(s), {gap_ms:g} ms "
            f"apart: Redis CPU {cpu_us / len(walls):.1f} us a submission, {requests:.2f} "
            f"requests a submission, wall p50 {statistics.median(walls) * 1e3:.2f} ms, p99 "
            f"{sorted(walls)[int(len(walls) * 0.99)] * 1e3:.2f} ms, "
            f"{len(walls) / elapsed:.0f} submissions/s")


async def _run(args: argparse.Namespace) -> None:
    process, url = _start_redis()
    try:
        redis = Redis.from_url(url)
        admission = QueueAdmission(Keys(), 10**9, 1)
        batcher = SubmissionBatcher(redis)
        for _ in range(50):  # warm-up: scripts loaded, connections open
            await _submit(redis, admission, batcher)
            await _submit(redis, admission, None)
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            for gap_ms in (float(gap) for gap in args.gaps_ms.split(",")):
                for _ in range(args.rounds):
                    for path in ([batcher, None] if args.per_call else [batcher]):
                        print(await _measure(redis, admission, path, concurrency, args.jobs,
                                             gap_ms))
    finally:
        process.kill()
        process.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=400)
    parser.add_argument("--gaps-ms", default="0,5", help="pauses between submissions, one run each")
    parser.add_argument("--concurrency", default="1",
                        help="submitters at once (an API process' concurrent requests), "
                             "comma-separated: one run each")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--per-call", action="store_true",
                        help="alternate each run with one submission per request")
    asyncio.run(_run(parser.parse_args()))


if __name__ == "__main__":
    main()
