"""Fair shares between API keys, measured: two keys, one submitting ten times more jobs.

A private redis-server, one real worker (`python -m worker`) on a model, one API process with two
keys. The heavy key submits `--light-jobs * 10` jobs at once, then the light key `--light-jobs`
(the light key's jobs queue behind all of the heavy key's: plain FIFO would give it nothing until
the heavy key's burst is through). Every job generates exactly `--max-tokens` tokens (min_tokens =
max_tokens). A meter snapshots Redis every few ms (one MULTI: each job's stream length and status)
and reports each key's share of the tokens generated while both keys still had jobs queued.

    python scripts/bench_fair_share.py                      # tiny random llama, equal weights
    python scripts/bench_fair_share.py --weights 2,1        # heavy key weight 2
    python scripts/bench_fair_share.py --vary               # jobs of different lengths
    python scripts/bench_fair_share.py --model smollm2
    python scripts/bench_fair_share.py --claim-cost         # Redis time per claim, no model
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
from redis import Redis  # noqa: E402

from protocol.job_reader import count_tokens  # noqa: E402
from protocol.keys import Keys  # noqa: E402
from scripts.bench_fleet import _free_port, _start_redis  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WAITING = {"queued", "preempted"}
FINAL = {"finished", "failed", "canceled"}


@dataclass(frozen=True, slots=True)
class Sample:
    at: float  # time.monotonic()
    tokens: dict[str, int]  # owner -> tokens generated so far (all of its jobs)
    queued: dict[str, int]  # owner -> jobs waiting (queued or preempted)
    num_final: int


class FairShareMeter:
    """Snapshots of the tokens each owner's jobs generated and of the jobs each still has queued."""

    def __init__(self, redis: Redis, keys: Keys, owners: dict[str, str]) -> None:
        self.redis = redis
        self.keys = keys
        self.owners = owners  # job id -> owner

    def sample(self) -> Sample:
        # One MULTI: a worker's step (its appends and finishes, also one transaction) is either
        # all in this snapshot or not at all.
        with self.redis.pipeline(transaction=True) as pipe:
            for job_id in self.owners:
                pipe.xrevrange(self.keys.stream(job_id), count=1)
                pipe.hget(self.keys.state(job_id), "status")
            replies = pipe.execute()
        tokens = dict.fromkeys(self.owners.values(), 0)
        queued = dict.fromkeys(self.owners.values(), 0)
        num_final = 0
        for index, owner in enumerate(self.owners.values()):
            last, raw = replies[2 * index], replies[2 * index + 1]
            status = raw.decode() if isinstance(raw, bytes) else str(raw)
            is_final = status in FINAL
            # By the last entry's id: an entry may hold several tokens (protocol/token_runs.py).
            tokens[owner] += count_tokens(last)
            queued[owner] += status in WAITING
            num_final += is_final
        return Sample(time.monotonic(), tokens, queued, num_final)

    def run(self, interval_s: float = 0.005, timeout_s: float = 600.0) -> list[Sample]:
        """Samples until every job is final."""
        samples = [self.sample()]
        deadline = time.monotonic() + timeout_s
        while samples[-1].num_final < len(self.owners):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.owners) - samples[-1].num_final} jobs still open")
            time.sleep(interval_s)
            samples.append(self.sample())
        return samples


def contended_tokens(samples: list[Sample]) -> tuple[dict[str, int], float]:
    """Tokens each owner generated from the first to the last sample in which every owner had a
    job queued, and that window's length in seconds."""
    both = [s for s in samples if all(count > 0 for count in s.queued.values())]
    if not both:
        raise ValueError("no sample saw every owner with a job queued")
    first, last = both[0], both[-1]
    return {owner: last.tokens[owner] - first.tokens[owner] for owner in first.tokens}, \
        last.at - first.at


def _wait(what: str, ready: object, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            sys.exit(f"{what} exited with {process.returncode}")
        if callable(ready) and ready():
            return
        time.sleep(0.2)
    sys.exit(f"{what} not ready in {timeout_s:.0f} s")


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code < 500
    except httpx.HTTPError:
        return False


def _model_dir(name: str) -> str:
    if name != "tiny":
        return name
    from worker.model.tiny_models import build_tiny_model

    return str(build_tiny_model(Path(tempfile.mkdtemp(prefix="bench-fair-model-")), "llama", seed=0))


def claim_cost() -> None:
    """Redis time (INFO commandstats) per claim with 1,000 jobs queued over 1, 3 and 20 keys: one
    that finds no KV room (a worker at its KV limit retries every step) and one that takes a job."""
    from protocol import JobSpec, submit_jobs
    from worker.jobs.job_queue import JobQueue
    from worker.jobs.job_scripts import JobScripts

    process, url = _start_redis()
    try:
        redis = Redis.from_url(url)
        for num_owners in (1, 3, 20):
            redis.flushdb()
            scripts = JobScripts()
            scripts.load(redis)
            submit_jobs(redis, [JobSpec.from_dict(dict(
                job_id=f"job-{i}", model="bench", prompt="x", max_tokens=8,
                owner=f"key-{i % num_owners}")) for i in range(1000)])
            queue = JobQueue(redis, scripts, Keys(), "bench", "bench", 10_000, 120, 16)
            costs = []
            for budget in (0, None):
                redis.config_resetstat()
                for _ in range(200):
                    queue.claim(1, free_kv_blocks=budget)
                costs.append(float(redis.info("commandstats")["cmdstat_evalsha"]["usec_per_call"]))
            print(f"{num_owners:>2} keys, 1000 jobs queued: {costs[0]:.0f} us per claim that finds "
                  f"no KV room, {costs[1]:.0f} us per claim of one job")
    finally:
        process.kill()
        process.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="tiny (a random llama), smollm2 or a dir")
    parser.add_argument("--light-jobs", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seats", type=int, default=6, help="the worker's max_num_seqs")
    parser.add_argument("--weights", default="1,1", help="heavy,light key weights")
    parser.add_argument("--threads", type=int, default=1, help="the worker's torch threads")
    parser.add_argument("--vary", action="store_true",
                        help="each job's length drawn from max_tokens/4..max_tokens (seeded)")
    parser.add_argument("--claim-cost", action="store_true",
                        help="only measure Redis time per claim (no model, no API)")
    args = parser.parse_args()
    if args.claim_cost:
        claim_cost()
        return
    heavy_weight, light_weight = (float(w) for w in args.weights.split(","))

    keys = Keys()
    redis_process, url = _start_redis()
    redis = Redis.from_url(url)
    api_port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "CARPOOL_REDIS_URL": url,
           "TOKENIZERS_PARALLELISM": "false"}
    processes: list[subprocess.Popen[bytes]] = [redis_process]
    try:
        worker = subprocess.Popen(
            [sys.executable, "-m", "worker", "--model", _model_dir(args.model), "--redis-url", url,
             "--name", "bench-fair", "--max-num-seqs", str(args.seats), "--num-threads",
             str(args.threads), "--dtype", "float32"],
            cwd=REPO, env=env,
            stdout=subprocess.DEVNULL)
        processes.append(worker)
        _wait("the worker", lambda: bool(redis.hlen(keys.models())), worker, 300)
        api = subprocess.Popen(
            [sys.executable, "-m", "api"], cwd=REPO, stdout=subprocess.DEVNULL,
            env={**env, "CARPOOL_PORT": str(api_port), "CARPOOL_API_KEYS": "heavy-key,light-key",
                 "CARPOOL_KEY_WEIGHTS": f"heavy-key={heavy_weight},light-key={light_weight}",
                 "CARPOOL_LOG_LEVEL": "warning", "CARPOOL_MAX_QUEUE_DEPTH": "100000"})
        processes.append(api)
        _wait("the API", lambda: _healthy(api_port), api, 120)
        owners: dict[str, str] = {}
        lengths = random.Random(0)
        with httpx.Client(base_url=f"http://127.0.0.1:{api_port}", timeout=30) as client:
            for key, count in (("heavy-key", args.light_jobs * 10), ("light-key", args.light_jobs)):
                for _ in range(count):
                    length = (lengths.randint(max(1, args.max_tokens // 4), args.max_tokens)
                              if args.vary else args.max_tokens)
                    body = {"prompt": "The quick brown fox", "max_tokens": length,
                            "min_tokens": length, "temperature": 0}
                    response = client.post("/v1/jobs", json=body,
                                           headers={"Authorization": f"Bearer {key}"})
                    response.raise_for_status()
                    owners[response.json()["job_id"]] = key.removesuffix("-key")
        samples = FairShareMeter(redis, keys, owners).run()
        tokens, window_s = contended_tokens(samples)
        total = sum(tokens.values())
        length = f"{args.max_tokens // 4}-{args.max_tokens}" if args.vary else args.max_tokens
        print(f"model {args.model}, {args.seats} seats, {length} tokens a job, weights "
              f"heavy:light {args.weights}")
        print(f"heavy key: {args.light_jobs * 10} jobs, light key: {args.light_jobs} jobs; "
              f"both had jobs queued for {window_s:.2f} s of {samples[-1].at - samples[0].at:.2f} s")
        for owner in ("heavy", "light"):
            print(f"  {owner}: {tokens[owner]} tokens = {tokens[owner] / max(1, total):.1%}")
        print(f"  heavy/light: {tokens['heavy'] / max(1, tokens['light']):.2f} "
              f"(weights say {heavy_weight / light_weight:.2f})")
    finally:
        for process in reversed(processes):
            process.kill()
            process.wait(timeout=30)


if __name__ == "__main__":
    main()
