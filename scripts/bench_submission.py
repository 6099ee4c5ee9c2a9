"""What one admitted submission costs Redis: its CPU (INFO cpu: used_cpu_sys + used_cpu_user) and
the submission's wall time, as the API submits (QueueAdmission's check and submit_job in one Lua
script, from a worker thread), into a private redis-server.

    python scripts/bench_submission.py                    # 400 submissions back to back, then 5 ms apart
    python scripts/bench_submission.py --jobs 1000 --gaps-ms 0,1,25

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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_fleet import _start_redis, redis_cpu_seconds  # noqa: E402
from redis import Redis  # noqa: E402

from api.queue_admission import QueueAdmission  # noqa: E402
from protocol import JobSpec, Keys, SamplingParams, submit_job  # noqa: E402


async def _submit(redis: Redis, admission: QueueAdmission) -> float:
    spec = JobSpec(job_id=uuid.uuid4().hex, model="bench", prompt="hello there",
                   sampling=SamplingParams(max_tokens=50), owner="bench")
    started = time.perf_counter()
    check = admission.admission("bench", 1, "bench").check
    await asyncio.to_thread(submit_job, redis, spec, check=check)
    return time.perf_counter() - started


async def _run(args: argparse.Namespace) -> None:
    process, url = _start_redis()
    try:
        redis = Redis.from_url(url)
        admission = QueueAdmission(Keys(), 10**9, 1)
        for _ in range(50):  # warm-up: scripts loaded, connections open
            await _submit(redis, admission)
        for gap_ms in (float(gap) for gap in args.gaps_ms.split(",")):
            cpu0 = redis_cpu_seconds(redis)
            walls = []
            for _ in range(args.jobs):
                walls.append(await _submit(redis, admission))
                if gap_ms:
                    await asyncio.sleep(gap_ms / 1000)
            cpu_us = (redis_cpu_seconds(redis) - cpu0) * 1e6
            print(f"{gap_ms:g} ms apart: Redis CPU {cpu_us / args.jobs:.1f} us a submission, "
                  f"wall p50 {statistics.median(walls) * 1e3:.2f} ms")
    finally:
        process.kill()
        process.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=400)
    parser.add_argument("--gaps-ms", default="0,5", help="pauses between submissions, one run each")
    asyncio.run(_run(parser.parse_args()))


if __name__ == "__main__":
    main()
