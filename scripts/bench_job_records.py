"""What a job's records cost Redis, Carpool's next to rq's own: Redis CPU (INFO cpu), commands
(INFO commandstats, those run inside scripts included) and requests (what the clients sent) per
job, on a private redis-server, the two alternated in one run.

- Carpool: each job submitted as the API does (its admission check and the enqueue in one script,
  one request a job), claimed `--claim-batch` at a time, its first token written to its stream,
  `--durable-writes` runs of tokens after it, then its last tokens and its end (finish), each
  publish carrying `--flush-batch` jobs (one MULTI/EXEC, as a worker's step carries its batch);
  `--tokens` tokens a job.
- rq: `Queue.enqueue` of a function that returns what a Carpool result holds for the same tokens
  (text and token ids), then rq's own `SimpleWorker` in burst mode runs them all.

Neither side generates anything: this is the bookkeeping a job costs, which does not shrink with
the job, so it sets the Redis ceiling for short jobs (README, "Fleet scale"). With `--by-script`,
Carpool's side also splits each Lua script's time per job into the commands it ran and the rest:
Lua itself and each call's glue (its arguments into Redis, its reply back into Lua values).

    python scripts/bench_job_records.py
    python scripts/bench_job_records.py --jobs 2000 --rounds 3 --tokens 50
    python scripts/bench_job_records.py --rounds 1 --by-script
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rq  # noqa: E402
from bench_fleet import _script_names, _start_redis, redis_cpu_seconds, script_split  # noqa: E402
from redis import Redis  # noqa: E402
from redis.connection import AbstractConnection  # noqa: E402
from rq import Queue, SimpleWorker  # noqa: E402

from api.queue_admission import QueueAdmission  # noqa: E402
from protocol import (  # noqa: E402
    FinishReason,
    JobSpec,
    JobStatus,
    Keys,
    SamplingParams,
    TokenEntry,
    job_submission,
    submit_job,
)
from worker.jobs.job_queue import JobQueue  # noqa: E402
from worker.jobs.job_scripts import JobScripts  # noqa: E402
from worker.jobs.running_job import RunningJob  # noqa: E402
from worker.jobs.stream_publisher import JobEnd, StreamPublisher  # noqa: E402

MODEL = "bench"
_requests = 0  # requests sent to any Redis by this process (a pipeline or transaction is one)


def _count_requests() -> None:
    real_send = AbstractConnection.send_packed_command

    def counting_send(self: AbstractConnection, command: Any, check_health: bool = True) -> None:
        global _requests
        _requests += 1
        real_send(self, command, check_health)

    AbstractConnection.send_packed_command = counting_send  # type: ignore[method-assign]


def rq_job_result(num_tokens: int) -> dict[str, Any]:
    """What rq's worker stores for a job: a result of Carpool's size for `num_tokens` tokens."""
    return {"text": " tok" * num_tokens, "token_ids": list(range(1000, 1000 + num_tokens)),
            "finish_reason": "length", "completion_tokens": num_tokens}


class Meter:
    """Redis' CPU, commands and this process' requests over phases, per job."""

    def __init__(self, redis: Redis, jobs: int) -> None:
        self.redis, self.jobs = redis, jobs
        self.rows: dict[str, tuple[float, float, float]] = {}
        self.scripts: dict[str, tuple[int, int, int]] = {}  # --by-script: bench_fleet.script_split

    def _commands(self) -> int:
        return sum(int(stat["calls"]) for name, stat in self.redis.info("commandstats").items()
                   if name != "cmdstat_info")  # the meter's own

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        cpu0, commands0 = redis_cpu_seconds(self.redis), self._commands()
        requests0 = _requests  # after the meter's own INFO requests, and read before the next
        yield
        requests = _requests - requests0
        self.rows[name] = ((redis_cpu_seconds(self.redis) - cpu0) * 1e6 / self.jobs,
                           (self._commands() - commands0) / self.jobs, requests / self.jobs)

    def total(self) -> tuple[float, float, float]:
        return (sum(r[0] for r in self.rows.values()), sum(r[1] for r in self.rows.values()),
                sum(r[2] for r in self.rows.values()))


def carpool_jobs(url: str, args: argparse.Namespace) -> Meter:
    redis = Redis.from_url(url)
    redis.flushall()
    keys, scripts = Keys(), JobScripts()
    scripts.load(redis)
    admission = QueueAdmission(keys, 10**9, 1)
    meter = Meter(redis, args.jobs)
    if args.by_script:
        redis.config_set("slowlog-log-slower-than", 0)
        redis.config_set("slowlog-max-len", 200 * args.jobs)
        redis.slowlog_reset()
    prompt = "Tell me something about the sea. " * 4
    with meter.phase("submit"):
        for _ in range(args.jobs):
            spec = JobSpec(job_id=uuid.uuid4().hex, model=MODEL, prompt=prompt, owner="bench",
                           sampling=SamplingParams(max_tokens=args.tokens))
            submit_job(redis, spec, keys, check=admission.admission(MODEL, 1, "bench").check)
    queue = JobQueue(redis, scripts, keys, "bench-worker", MODEL, lease_ms=30_000,
                     execution_ttl_s=120, block_size=16)
    claims = []
    with meter.phase("claim"):
        while len(claims) < args.jobs:
            claims += queue.claim(args.claim_batch)
    jobs = [RunningJob(lease=c.lease, spec=c.spec, state=c.state, result_ttl=c.result_ttl,
                       failure_ttl=c.failure_ttl, num_prompt_tokens=32, claimed_at=c.claimed_at)
            for c in claims]
    publisher = StreamPublisher(redis, scripts, keys, "bench-worker", 30_000,
                                metrics_interval_s=1.0)
    runs = [1] + _split(args.tokens - 1, args.durable_writes + 1)  # first token, runs, the last

    def publish(name: str, write: Callable[[RunningJob], None]) -> None:
        with meter.phase(name):
            for start in range(0, len(jobs), args.flush_batch):
                for job in jobs[start:start + args.flush_batch]:
                    write(job)
                publisher.flush()

    def tokens(job: RunningJob, count: int) -> None:
        first, now = job.num_tokens, time.time()
        job.add_tokens([TokenEntry(first + i, 1000 + first + i, " tok") for i in range(count)],
                       now)

    def first_token(job: RunningJob) -> None:
        tokens(job, runs[0])
        publisher.append(job, may_go_live=False)

    publish("first token", first_token)
    for number, count in enumerate(runs[1:-1]):
        def run(job: RunningJob, count: int = count) -> None:
            tokens(job, count)
            publisher.append(job, may_go_live=False)

        publish(f"tokens, run {number + 1}", run)

    def finish(job: RunningJob) -> None:
        tokens(job, runs[-1])
        publisher.finish(job, JobEnd(JobStatus.FINISHED, FinishReason.LENGTH))

    publish("last tokens and finish", finish)
    if args.by_script:
        # The submission's script is registered per admission check (protocol/job_submission.py).
        names = {**_script_names(),
                 **{script.sha: "submit" for script in job_submission._SCRIPTS.values()}}
        meter.scripts = script_split(redis.slowlog_get(200 * args.jobs), names)
        redis.config_set("slowlog-log-slower-than", 10_000)
    return meter


def _split(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def rq_jobs(url: str, args: argparse.Namespace) -> Meter:
    redis = Redis.from_url(url)
    redis.flushall()
    meter = Meter(redis, args.jobs)
    queue = Queue("bench", connection=redis)
    with meter.phase("enqueue"):
        for _ in range(args.jobs):
            # By name: rq's worker imports the function, and __main__ is not importable.
            queue.enqueue("scripts.bench_job_records.rq_job_result", args.tokens,
                          result_ttl=500)
    worker = SimpleWorker([queue], connection=redis)
    with meter.phase("worker"):
        worker.work(burst=True, logging_level="WARNING")
    return meter


def _print(title: str, meter: Meter) -> None:
    print(f"{title}")
    for name, (cpu, commands, requests) in [*meter.rows.items(), ("all", meter.total())]:
        print(f"  {name:28s} {cpu:8.1f} us {commands:8.1f} commands {requests:6.2f} requests")
    if meter.scripts:
        print("  by script, per job (SLOWLOG, every command logged: for the split, not the totals)")
    for name, (calls, usec, inner) in sorted(meter.scripts.items(), key=lambda item: -item[1][1]):
        if name.startswith("evalsha"):
            print(f"  {name:28s} {usec / meter.jobs:8.1f} us {calls / meter.jobs:8.2f} calls, its "
                  f"commands {inner / meter.jobs:6.1f} us, Lua and the calls' glue "
                  f"{(usec - inner) / meter.jobs:6.1f} us")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=2, help="Carpool then rq, this many times")
    parser.add_argument("--tokens", type=int, default=50, help="tokens a job")
    parser.add_argument("--claim-batch", type=int, default=2, help="jobs a claim takes")
    parser.add_argument("--flush-batch", type=int, default=2,
                        help="jobs whose writes one publish carries")
    parser.add_argument("--by-script", action="store_true",
                        help="split Carpool's scripts' time into their commands and the rest (SLOWLOG)")
    parser.add_argument("--durable-writes", type=int, default=2,
                        help="stream writes between a job's first token and its end (a 50-token "
                             "job at 25 ms a step, written every 500 ms: 2)")
    args = parser.parse_args()
    if args.tokens < args.durable_writes + 2:
        parser.error("--tokens must leave a token for the first write, each run and the end")
    _count_requests()
    server, url = _start_redis()
    try:
        for round_number in range(1, args.rounds + 1):
            _print(f"round {round_number}: Carpool, {args.tokens}-token jobs, per job",
                   carpool_jobs(url, args))
            _print(f"round {round_number}: rq {rq.__version__} (enqueue, SimpleWorker), per job",
                   rq_jobs(url, args))
    finally:
        server.terminate()
        server.wait(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
