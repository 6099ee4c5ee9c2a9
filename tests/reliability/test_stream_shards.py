"""Token streams on two stream shards (private redis-servers, append-only file on), the queue and
job records on a third: synthetic workers (the real worker loop, no model), the real API process
and SSE subscribers; one shard is SIGKILLed and restarted while jobs stream through it.

Every job must finish with every token exactly once, in order, in its subscriber's events, and its
stream must be on the shard of the worker that started it (its state records which) and nowhere
else. With CARPOOL_STREAM_OUTAGE_S the API rides the restart out and no subscriber reconnects;
with 0 it ends the streams the restart hit, and their subscribers reconnect with Last-Event-ID.

And a shard lost for good before the jobs come: every job starts on the shard that answers. And
one lost mid-stream under a worker whose jobs stream to both: only the jobs streaming there wait.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest
from redis import Redis

from protocol import JobReader, JobSpec, JobState, JobStatus, Keys, submit_job
from tests.conftest import RedisServer
from tests.reliability.api_support import ApiProcess, start_redis, stop_redis
from worker.engine.synthetic_engine import SYNTHETIC_TEXT, SyntheticEngine, synthetic_token_id
from worker.jobs.batching_worker import BatchingWorker
from worker.jobs.settings import WorkerSettings

pytestmark = pytest.mark.reliability

KEYS = Keys()
NUM_JOBS = 24
NUM_TOKENS = 120
SEATS = 8
STEP_S = 0.02


def _start_workers(main_url: str, shard_urls: list[str], stream_interval_ms: float = 0
                   ) -> list[tuple[BatchingWorker, threading.Thread]]:
    workers = []
    for number in range(2):
        settings = WorkerSettings(model="synthetic", redis_url=main_url, name=f"synthetic-{number}",
                                  stream_redis_urls=shard_urls, max_num_seqs=SEATS,
                                  drain_seconds=0, lease_seconds=6, redis_timeout_seconds=2,
                                  stream_interval_ms=stream_interval_ms)
        worker = BatchingWorker(settings, SyntheticEngine(SEATS, STEP_S),  # type: ignore[arg-type]
                                Redis.from_url(main_url), register_presence=False)
        thread = threading.Thread(target=worker.run, name=settings.name, daemon=True)
        thread.start()
        workers.append((worker, thread))
    return workers


def _wait_for_model(main_redis: Redis) -> None:
    deadline = time.monotonic() + 60
    while not main_redis.hexists(KEYS.models(), "synthetic") and time.monotonic() < deadline:
        time.sleep(0.05)


def _stop(api: ApiProcess | None, workers: list[tuple[BatchingWorker, threading.Thread]],
          servers: list[RedisServer]) -> None:
    if api is not None:
        api.stop()
    for worker, _ in workers:
        worker.request_stop(0, None)
    for _, thread in workers:
        thread.join(timeout=30)
    for server in servers:
        stop_redis(server)


async def _follow(client: httpx.AsyncClient, job_id: str, reconnects: dict[str, int]
                  ) -> list[dict[str, str]]:
    """Every event of the job's stream, reconnecting after the last id it got, as EventSource."""
    events: list[dict[str, str]] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        headers = {"Last-Event-ID": events[-1]["id"]} if events else {}
        try:
            async with client.stream("GET", f"/v1/jobs/{job_id}/stream", headers=headers) as response:
                if response.status_code == 204:
                    return events
                if response.status_code == 200:
                    event: dict[str, str] = {}
                    async for line in response.aiter_lines():
                        if not line:
                            if event:
                                events.append(event)
                                if event.get("event") == "done":
                                    return events
                            event = {}
                        elif not line.startswith(":"):
                            name, _, value = line.partition(":")
                            event[name] = value.removeprefix(" ")
        except httpx.HTTPError:
            pass
        reconnects[job_id] = reconnects.get(job_id, 0) + 1
        await asyncio.sleep(0.2)
    raise AssertionError(f"job {job_id}: no final event within 120 s ({len(events)} events)")


async def _run(api: ApiProcess, shards: list[RedisServer], main_url: str) -> tuple[dict[str, list[dict[str, str]]],
                                                                    dict[str, int], int]:
    reconnects: dict[str, int] = {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=api.url, timeout=30, limits=limits) as client:
        job_ids = []
        for _ in range(NUM_JOBS):
            response = await client.post("/v1/jobs", json={"prompt": "hello",
                                                           "max_tokens": NUM_TOKENS})
            assert response.status_code == 202, response.text
            job_ids.append(response.json()["job_id"])
        followers = {job_id: asyncio.create_task(_follow(client, job_id, reconnects))
                     for job_id in job_ids}
        # The shard with the most running jobs dies mid-stream (append-only file: it comes
        # back whole).
        await asyncio.sleep(1.0)
        reader = JobReader(Redis.from_url(main_url))
        counts = [0, 0]
        for job_id in job_ids:
            recorded = reader.state(job_id).stream_shard
            if recorded >= 0:
                counts[recorded] += 1
        victim = 0 if counts[0] >= counts[1] else 1
        shards[victim].kill()
        await asyncio.sleep(1.5)
        shards[victim].start(appendonly=True)
        results = {job_id: await task for job_id, task in followers.items()}
    return results, reconnects, victim


# Publishing every step, and every 60 ms (runs of about three tokens: protocol/token_runs.py);
# the API ending the streams a shard's outage hits, and riding it out.
@pytest.mark.parametrize(("stream_interval_ms", "stream_outage_s"), [(0, 0.0), (60, 30.0)])
def test_streams_on_two_shards_survive_a_shard_restart(tmp_path: Path, stream_interval_ms: float,
                                                       stream_outage_s: float) -> None:
    main = start_redis(tmp_path / "main", appendonly=True)
    shards = [start_redis(tmp_path / f"shard-{i}", appendonly=True) for i in range(2)]
    workers: list[tuple[BatchingWorker, threading.Thread]] = []
    api = None
    try:
        shard_urls = [shard.url for shard in shards]
        workers = _start_workers(main.url, shard_urls, stream_interval_ms)
        api = ApiProcess.start(main.url, tmp_path / "api.log", stream_redis_urls=",".join(shard_urls),
                               max_queue_depth="1000", stream_outage_s=str(stream_outage_s))
        api.wait_healthy()
        main_redis = Redis.from_url(main.url)
        _wait_for_model(main_redis)
        results, reconnects, victim = asyncio.run(_run(api, shards, main.url))

        reader = JobReader(main_redis)
        shard_redis = [Redis.from_url(url) for url in shard_urls]
        homes: list[int] = []
        for job_id, events in results.items():
            tokens = [(e["id"], json.loads(e["data"])) for e in events if e["event"] == "token"]
            assert tokens == [(f"0-{i + 1}", {"index": i, "token_id": synthetic_token_id(i),
                                              "text": SYNTHETIC_TEXT})
                              for i in range(NUM_TOKENS)], job_id
            done = json.loads(events[-1]["data"])
            assert (events[-1]["event"], events[-1]["id"], done["finish_reason"],
                    done["usage"]["completion_tokens"]) == (
                "done", f"0-{NUM_TOKENS + 1}", "length", NUM_TOKENS)
            assert reader.state(job_id).status == JobStatus.FINISHED
            home = reader.state(job_id).stream_shard
            homes.append(home)
            home_read = JobReader(shard_redis[home]).read(job_id)
            assert [t.index for t in home_read.tokens] == list(range(NUM_TOKENS))
            assert (home_read.is_done, home_read.last_id) == (True, f"0-{NUM_TOKENS + 1}")
            assert shard_redis[1 - home].exists(KEYS.stream(job_id)) == 0
            assert main_redis.exists(KEYS.stream(job_id)) == 0
        # Each worker streams to a shard of its own (dealt in turn): both carry jobs.
        assert sorted(set(homes)) == [0, 1], homes
        victims = [job_id for job_id, home in zip(results, homes) if home == victim]
        if stream_outage_s:
            assert reconnects == {}  # the API followed each stream through the restart
            assert "unreachable under open streams" in api.log_path.read_text()  # which its readers did meet
        else:
            # The restart hit live subscribers: they were cut off and resumed.
            assert any(reconnects.get(job_id, 0) for job_id in victims), reconnects
        print(f"RELIABILITY stream shards ({stream_interval_ms} ms stream interval): "
              f"{NUM_JOBS} jobs x {NUM_TOKENS} tokens on 2 shards, "
              f"shard {victim} killed and restarted, the API riding it out for "
              f"{stream_outage_s:g} s; {sum(reconnects.values())} reconnects, "
              f"every token once, 0 lost")
    finally:
        _stop(api, workers, [main, *shards])


def test_jobs_start_on_the_shard_that_answers_while_the_other_is_lost(tmp_path: Path) -> None:
    # Shard 1 dies before any job is submitted and does not come back. The worker whose shard it
    # was claims jobs onto it until a call there fails: those go back to their queue unplaced,
    # and from then on it starts its jobs on shard 0 too. Before, every job it claimed was
    # placed on shard 1 for good (then stuck, each chat request a 503 after the stream grace).
    main = start_redis(tmp_path / "main", appendonly=True)
    shards = [start_redis(tmp_path / f"shard-{i}") for i in range(2)]
    workers: list[tuple[BatchingWorker, threading.Thread]] = []
    api = None
    try:
        shard_urls = [shard.url for shard in shards]
        workers = _start_workers(main.url, shard_urls)
        api = ApiProcess.start(main.url, tmp_path / "api.log", stream_redis_urls=",".join(shard_urls),
                               stream_outage_s="3")
        api.wait_healthy()
        main_redis = Redis.from_url(main.url)
        _wait_for_model(main_redis)
        shards[1].kill()

        async def ask(client: openai.AsyncOpenAI, number: int) -> str:
            messages = [{"role": "user", "content": f"question {number}"}]
            if number % 2:
                stream = await client.chat.completions.create(
                    model="synthetic", messages=messages, max_tokens=20,  # type: ignore[arg-type]
                    stream=True)
                return "".join([chunk.choices[0].delta.content or "" async for chunk in stream
                                if chunk.choices])
            answer = await client.chat.completions.create(
                model="synthetic", messages=messages, max_tokens=20)  # type: ignore[arg-type]
            return answer.choices[0].message.content or ""

        async def ask_all() -> list[str]:
            async with openai.AsyncOpenAI(base_url=f"{api.url}/v1", api_key="none",
                                          max_retries=0, timeout=60) as client:
                return await asyncio.gather(*(ask(client, number) for number in range(2 * SEATS)))

        assert asyncio.run(ask_all()) == [SYNTHETIC_TEXT * 20] * (2 * SEATS)
        state_prefix = KEYS.state("")
        job_ids = [key.decode().removeprefix(state_prefix)
                   for key in main_redis.scan_iter(KEYS.state("*"))]
        homes = [JobReader(main_redis).state(job_id).stream_shard
                 for job_id in job_ids if ":" not in job_id]  # (not its stream, lease...)
        assert homes == [0] * (2 * SEATS)
        print(f"RELIABILITY a stream shard lost for good: {2 * SEATS} chat requests answered "
              f"whole ({2 * SEATS * 20} tokens), every job on the shard that answers")
    finally:
        _stop(api, workers, [main, *shards])


LEASE_S = 10.0  # the batch waits a quarter of it for a shard that does not answer


def _pinned_worker(main_url: str, shard_urls: list[str], name: str, shard: int
                   ) -> tuple[BatchingWorker, threading.Thread]:
    settings = WorkerSettings(model="synthetic", redis_url=main_url, name=name,
                              stream_redis_urls=shard_urls, stream_shard=shard, max_num_seqs=SEATS,
                              drain_seconds=0, lease_seconds=LEASE_S, redis_timeout_seconds=1)
    worker = BatchingWorker(settings, SyntheticEngine(SEATS, STEP_S),  # type: ignore[arg-type]
                            Redis.from_url(main_url), register_presence=False)
    thread = threading.Thread(target=worker.run, name=name, daemon=True)
    thread.start()
    return worker, thread



def _submit(main_redis: Redis, number: int, max_tokens: int) -> list[str]:
    job_ids = [f"job-{uuid.uuid4().hex[:12]}" for _ in range(number)]
    for job_id in job_ids:
        submit_job(main_redis, JobSpec.from_dict(dict(
            job_id=job_id, model="synthetic", prompt="hello", max_tokens=max_tokens,
            temperature=0.0, created_at=time.time())))
    return job_ids


def _wait_for_tokens(shard: Redis, job_ids: list[str], least: int) -> None:
    reader = JobReader(shard)
    deadline = time.monotonic() + 30
    while any(reader.num_tokens(job_id) < least for job_id in job_ids):
        assert time.monotonic() < deadline, [reader.num_tokens(job_id) for job_id in job_ids]
        time.sleep(0.05)


def _assert_whole(shard: Redis, main_redis: Redis, job_id: str, num_tokens: int) -> JobState:
    read = JobReader(shard).read(job_id)
    assert [(t.index, t.token_id) for t in read.tokens] == [
        (i, synthetic_token_id(i)) for i in range(num_tokens)], job_id
    assert (read.is_done, read.last_id) == (True, f"0-{num_tokens + 1}"), job_id
    state = JobReader(main_redis).state(job_id)
    assert (state.status, state.completion_tokens) == (JobStatus.FINISHED, num_tokens), job_id
    return state


def test_a_shard_lost_mid_stream_holds_up_only_the_jobs_streaming_there(tmp_path: Path) -> None:
    # One worker runs jobs on both shards: four it took over from a worker of shard 1 that drained
    # (they stay on the shard their streams are on) and four of its own on shard 0. Shard 1 dies
    # mid-stream. Its jobs wait for it (left to recovery); the others go on to their ends while
    # it is down, each token once, never preempted. Before, the whole batch waited on shard 1
    # for a lease and was then dropped: no job ended while it was down.
    main = start_redis(tmp_path / "main", appendonly=True)
    shards = [start_redis(tmp_path / "shard-0"), start_redis(tmp_path / "shard-1", appendonly=True)]
    workers: list[tuple[BatchingWorker, threading.Thread]] = []
    try:
        shard_urls = [shard.url for shard in shards]
        main_redis = Redis.from_url(main.url)
        shard_redis = [Redis.from_url(url) for url in shard_urls]
        first = _pinned_worker(main.url, shard_urls, "synthetic-of-shard-1", 1)
        long_jobs = _submit(main_redis, 4, max_tokens=300)
        _wait_for_tokens(shard_redis[1], long_jobs, 20)
        _stop(None, [first], [])
        workers = [_pinned_worker(main.url, shard_urls, "synthetic-of-shard-0", 0)]
        short_jobs = _submit(main_redis, 4, max_tokens=100)
        _wait_for_tokens(shard_redis[0], short_jobs, 10)
        _wait_for_tokens(shard_redis[1], long_jobs, 40)  # taken over: going on there
        shards[1].kill()
        killed_at = time.monotonic()
        reader, shard_0 = JobReader(main_redis), JobReader(shard_redis[0])
        # Ended: recorded on the main Redis, and the final entry in the stream on shard 0 (it
        # follows in the same flush).
        while not all(reader.state(job_id).status == JobStatus.FINISHED
                      and shard_0.read(job_id).is_done for job_id in short_jobs):
            assert time.monotonic() - killed_at < LEASE_S - 1, "shard 0's jobs held up"
            time.sleep(0.05)
        short_done_s = time.monotonic() - killed_at
        for job_id in short_jobs:
            assert _assert_whole(shard_redis[0], main_redis, job_id, 100).num_preemptions == 0
        assert not any(reader.state(job_id).status == JobStatus.FINISHED for job_id in long_jobs)
        # Back (its append-only file: the streams whole): recovery hands its jobs on once their
        # leases lapse, and each resumes after what its stream holds.
        shards[1].start(appendonly=True)
        deadline = time.monotonic() + 60
        while any(reader.state(job_id).status != JobStatus.FINISHED for job_id in long_jobs):
            assert time.monotonic() < deadline, [reader.state(j).status for j in long_jobs]
            time.sleep(0.1)
        for job_id in long_jobs:
            _assert_whole(shard_redis[1], main_redis, job_id, 300)
        print(f"RELIABILITY a stream shard lost mid-stream: the worker's 4 jobs streaming "
              f"elsewhere ended whole {short_done_s:.1f} s after, while it was down; its 4 "
              f"jobs waited for it and resumed whole {time.monotonic() - killed_at:.1f} s after")
    finally:
        _stop(None, workers, [main, *shards])
