"""What a durable 202 costs: job submissions per second into a private redis-server configured as
`--appendonly no`, `--appendfsync everysec` and `--appendfsync always` (what Carpool ships).

    python scripts/bench_durable_submit.py                  # 2,000 jobs, 1 and 8 submitters
    python scripts/bench_durable_submit.py --jobs 5000 --threads 1,4,16

Each submission is what the API does after admission: `protocol.submit_job` (one MULTI/EXEC: the
RQ job, the queue entry, its wake-up, the JobState, the owner's index). With `always`, Redis
fsyncs the append-only file before it answers, once per event-loop turn: concurrent submitters
share an fsync (group commit), so the cost falls as they grow. Run it on the disk Redis will use.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from redis import Redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from protocol import JobSpec, Keys, SamplingParams  # noqa: E402
from protocol.job_submission import submit_job  # noqa: E402

CONFIGS = {
    "appendonly no": ["--appendonly", "no"],
    "everysec": ["--appendonly", "yes", "--appendfsync", "everysec"],
    "always": ["--appendonly", "yes", "--appendfsync", "always"],
}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start(directory: Path, args: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    process = subprocess.Popen(
        [shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
         "127.0.0.1", "--save", "", "--dir", str(directory), *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if Redis.from_url(url).ping():
                return process, url
        except Exception:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


def _rate(url: str, num_jobs: int, num_threads: int) -> float:
    keys = Keys()
    per_thread = num_jobs // num_threads

    def submit_some() -> None:
        redis = Redis.from_url(url)
        for _ in range(per_thread):
            spec = JobSpec(job_id=uuid.uuid4().hex, model="bench", prompt="Hello there",
                           sampling=SamplingParams(max_tokens=16), owner="bench")
            submit_job(redis, spec, keys)

    threads = [threading.Thread(target=submit_some) for _ in range(num_threads)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return per_thread * num_threads / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--threads", default="1,8", help="submitters, comma-separated")
    args = parser.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    print(f"{'redis config':<16}" + "".join(f"{f'{t} submitters':>16}" for t in threads))
    for name, config in CONFIGS.items():
        rates = []
        for num_threads in threads:
            with tempfile.TemporaryDirectory() as directory:
                process, url = _start(Path(directory), config)
                try:
                    _rate(url, 100, num_threads)  # warm-up: connections, script cache
                    rates.append(_rate(url, args.jobs, num_threads))
                finally:
                    process.kill()
                    process.wait()
        print(f"{name:<16}" + "".join(f"{rate:>12.0f} /s " for rate in rates))


if __name__ == "__main__":
    main()
