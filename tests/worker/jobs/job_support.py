"""Builders for the Redis-side worker tests (claims, fencing, publishing, recovery)."""

from __future__ import annotations

import json

import fakeredis
from redis import Redis

from protocol import JobReader, JobSpec, Keys, Priority, TokenEntry, submit_job
from protocol.generation import TokenLogprobs
from tests.step_notes import listen
from worker.jobs.job_queue import ClaimedJob, JobQueue
from worker.jobs.job_scripts import JobScripts
from worker.jobs.running_job import RunningJob
from worker.jobs.stream_publisher import StreamPublisher

KEYS = Keys()
BLOCK_SIZE = 16


def fake_redis() -> fakeredis.FakeRedis:
    """A fresh fakeredis whose step notifications are caught (tests.step_notes.notes_of)."""
    return listen(fakeredis.FakeRedis(server=fakeredis.FakeServer()))


def make_spec(job_id: str, priority: Priority = Priority.NORMAL, **overrides) -> JobSpec:
    fields = dict(job_id=job_id, model="tiny", prompt="Hello", max_tokens=8, temperature=0.0,
                  priority=priority, created_at=1000.0)
    fields.update(overrides)
    return JobSpec.from_dict(fields)


def submit(redis: Redis, *job_ids: str, priority: Priority = Priority.NORMAL, **overrides) -> None:
    for job_id in job_ids:
        submit_job(redis, make_spec(job_id, priority, **overrides))


def make_queue(redis: Redis, worker: str = "w1", lease_ms: int = 10_000,
               scripts: JobScripts | None = None) -> JobQueue:
    scripts = scripts or JobScripts()
    scripts.load(redis)
    return JobQueue(redis, scripts, KEYS, worker, "tiny", lease_ms, execution_ttl_s=120,
                    block_size=BLOCK_SIZE)


def make_publisher(queue: JobQueue) -> StreamPublisher:
    return StreamPublisher(queue.redis, queue.scripts, KEYS, queue.worker_name, queue.lease_ms)


def running(claim: ClaimedJob, num_prompt_tokens: int = 3) -> RunningJob:
    return RunningJob(lease=claim.lease, spec=claim.spec, state=claim.state,
                      result_ttl=claim.result_ttl, failure_ttl=claim.failure_ttl,
                      num_prompt_tokens=num_prompt_tokens,
                      token_ids=[t.token_id for t in claim.tokens],
                      texts=[t.text for t in claim.tokens], claimed_at=claim.claimed_at)



def claim_one(redis: Redis, job_id: str = "job-1", *, lease_ms: int = 10_000,
              num_prompt_tokens: int = 3, **overrides) -> tuple[RunningJob, StreamPublisher]:
    """Submit one job (spec overrides as for make_spec) and have worker w1 claim it: the
    running job and w1's publisher, as most single-job tests begin."""
    submit(redis, job_id, **overrides)
    queue = make_queue(redis, lease_ms=lease_ms)
    return running(queue.claim(1)[0], num_prompt_tokens), make_publisher(queue)

def generate(job: RunningJob, *token_ids: int) -> None:
    """Pretend the engine produced these tokens (text: the id in brackets)."""
    start = job.num_tokens
    job.add_tokens([TokenEntry(start + i, t, f"<{t}>") for i, t in enumerate(token_ids)], now=2000.0)


def expire_lease(redis: Redis, job_id: str) -> None:
    """The owner went silent: its lease key and its deadline in the leases set both lapse."""
    redis.delete(KEYS.lease(job_id))
    redis.zadd(KEYS.leases(), {job_id: 1})


def token_entry(index: int, token_id: int) -> tuple[bytes, dict[bytes, bytes]]:
    """One token's stream entry as Redis returns it (text: the id in brackets, as `generate`)."""
    return (f"0-{index + 1}".encode(), {b"kind": b"token", b"index": str(index).encode(),
                                        b"token_id": str(token_id).encode(),
                                        b"text": f"<{token_id}>".encode()})


def run_entry(first: int, *token_ids: int) -> tuple[bytes, dict[bytes, bytes]]:
    """A run's stream entry (protocol/token_runs.py) as Redis returns it."""
    return (f"0-{first + len(token_ids)}".encode(), {
        b"kind": b"tokens", b"index": str(first).encode(),
        b"token_ids": " ".join(map(str, token_ids)).encode(),
        b"text": json.dumps([f"<{t}>" for t in token_ids], separators=(",", ":")).encode()})


# Texts whose JSON must carry through Lua unchanged (quotes, slashes, non-ASCII, an escape), and
# the logprobs job-2 asks for: what the live-token tests publish and then read back.
AWKWARD_TEXTS = ['"a/b"', " é", "字", "\\n"]
AWKWARD_LOGPROBS = TokenLogprobs(-0.25, ((7, -0.25), (8, -1.5)))


def publish_awkward_texts(publisher: StreamPublisher, jobs: list[RunningJob]) -> None:
    """One step per text, every job a token of it (ids 100 + step; job-2's with logprobs)."""
    for step, text in enumerate(AWKWARD_TEXTS):
        for job in jobs:
            logprobs = AWKWARD_LOGPROBS if job.job_id == "job-2" else None
            job.add_tokens([TokenEntry(step, 100 + step, text, logprobs)], now=2000.0)
            publisher.append(job)
        publisher.flush()


def assert_awkward_texts(reader: JobReader, jobs: list[RunningJob]) -> None:
    """Each job's stream holds exactly what publish_awkward_texts published."""
    for job in jobs:
        tokens = reader.tokens(job.job_id)
        assert [(t.index, t.token_id, t.text) for t in tokens] == [
            (i, 100 + i, text) for i, text in enumerate(AWKWARD_TEXTS)]
        expected = AWKWARD_LOGPROBS if job.job_id == "job-2" else None
        assert [t.logprobs for t in tokens] == [expected] * len(AWKWARD_TEXTS)
