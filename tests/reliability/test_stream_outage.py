"""Open streams across a Redis restart: the real API process (uvicorn) in front of a private
redis-server (append-only file, fsynced at every write) that the test SIGKILLs mid-stream and
starts again. The test writes the jobs' tokens as a worker does (stream entries and the step
notification in one transaction), some before the crash and the rest after.

Within CARPOOL_STREAM_OUTAGE_S the API rides the outage out (api/stream_outages.py): the official
openai client's stream and a /v1/jobs SSE subscriber each get every token exactly once, in order,
with no error and no reconnect. Past it, each ends as before: the OpenAI stream with an error
naming the job, the SSE stream cleanly (its client reconnects with Last-Event-ID).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from redis import Redis

from protocol import FinishReason, JobStatus, StreamEntry, stream_ids
from protocol.stream_steps import notify_steps
from tests.conftest import RedisServer
from tests.reliability.api_support import (
    KEYS,
    ApiProcess,
    register_model,
    start_redis,
    stop_redis,
)

pytestmark = pytest.mark.reliability

AOF_ARGS = ("--appendfsync", "always")
NUM_TOKENS = 8
BEFORE_CRASH = 3  # tokens written before Redis dies
OUTAGE_S = 1.5  # how long Redis stays down when the API rides it out
GRACE_S = 10.0
SHORT_GRACE_S = 1.0
CHAT = [{"role": "user", "content": "What is 2+2?"}]


@dataclass(slots=True)
class Stack:
    api: ApiProcess
    server: RedisServer
    model: str

    def redis(self) -> Redis:
        return Redis.from_url(self.server.url, socket_timeout=5)


def _stack(tiny_llama_dir: Path, tmp_path: Path, grace_s: float) -> Iterator[Stack]:
    server = start_redis(tmp_path / "redis", appendonly=True, extra_args=AOF_ARGS)
    api: ApiProcess | None = None
    try:
        model = register_model(Redis.from_url(server.url), tiny_llama_dir, max_model_len=64)
        api = ApiProcess.start(server.url, tmp_path / "api.log", stream_outage_s=str(grace_s),
                               sse_keepalive_s="0.2", stream_block_ms="200",
                               redis_timeout_s="1")
        api.wait_healthy()
        yield Stack(api=api, server=server, model=model)
    finally:
        if api is not None:
            api.stop()
        stop_redis(server)


@pytest.fixture()
def stack(tiny_llama_dir: Path, tmp_path: Path) -> Iterator[Stack]:
    yield from _stack(tiny_llama_dir, tmp_path, GRACE_S)


@pytest.fixture()
def short_grace_stack(tiny_llama_dir: Path, tmp_path: Path) -> Iterator[Stack]:
    yield from _stack(tiny_llama_dir, tmp_path, SHORT_GRACE_S)


def _write_tokens(redis: Redis, job_ids: list[str], start: int, stop: int) -> None:
    """Tokens start..stop-1 of each job (text `t<i>`, id 100 + i), as a worker's step writes them."""
    with redis.pipeline(transaction=True) as pipe:
        for job_id in job_ids:
            for index in range(start, stop):
                entry = StreamEntry(kind=StreamEntry.TOKEN, index=index, token_id=100 + index,
                                    text=f"t{index}")
                pipe.xadd(KEYS.stream(job_id), entry.to_fields(),
                          id=stream_ids.token_entry_id(index))
        notify_steps(pipe, KEYS, job_ids)
        pipe.execute()


def _write_done(redis: Redis, job_ids: list[str]) -> None:
    with redis.pipeline(transaction=True) as pipe:
        for job_id in job_ids:
            done = StreamEntry(kind=StreamEntry.DONE, finish_reason=FinishReason.STOP,
                               prompt_tokens=5, completion_tokens=NUM_TOKENS)
            pipe.xadd(KEYS.stream(job_id), done.to_fields(),
                      id=stream_ids.done_entry_id(NUM_TOKENS))
            pipe.hset(KEYS.state(job_id), mapping={
                "status": JobStatus.FINISHED.value, "finish_reason": FinishReason.STOP.value,
                "completion_tokens": NUM_TOKENS, "finished_at": time.time()})
        notify_steps(pipe, KEYS, job_ids)
        pipe.execute()


@dataclass(slots=True)
class Followers:
    """The openai client's stream of a chat completion and an SSE subscriber of a /v1/jobs job,
    each in a task of its own, recording what it got and how it ended."""

    chat_job: str
    sse_job: str
    chat_task: asyncio.Task[None]
    sse_task: asyncio.Task[None]
    chunks: list[tuple[str | None, str | None]]  # (delta content, finish_reason) per chunk
    events: list[dict[str, str]]
    ended: dict[str, float]  # follower -> monotonic time its stream ended


async def _start_followers(stack: Stack, client: openai.AsyncOpenAI,
                           http: httpx.AsyncClient) -> Followers:
    chunks: list[tuple[str | None, str | None]] = []
    events: list[dict[str, str]] = []
    ended: dict[str, float] = {}
    chat_job: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def read_chat() -> None:
        try:
            async with client.chat.completions.with_streaming_response.create(
                    model=stack.model, messages=CHAT, max_tokens=NUM_TOKENS,
                    stream=True) as response:
                chat_job.set_result(response.headers["x-carpool-job-id"])
                async for chunk in await response.parse():
                    chunks.extend((choice.delta.content, choice.finish_reason)
                                  for choice in chunk.choices)
        finally:
            ended["chat"] = time.monotonic()

    chat_task = asyncio.create_task(read_chat())
    await asyncio.wait({chat_job, chat_task}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
    submitted = await http.post("/v1/jobs", json={"prompt": "Hello", "max_tokens": NUM_TOKENS,
                                                  "model": stack.model})
    assert submitted.status_code == 202, submitted.text
    sse_job = submitted.json()["job_id"]

    async def read_sse() -> None:
        try:
            async with http.stream("GET", f"/v1/jobs/{sse_job}/stream") as stream:
                assert stream.status_code == 200
                event: dict[str, str] = {}
                async for line in stream.aiter_lines():
                    if not line:
                        if event:
                            events.append(event)
                        event = {}
                    elif not line.startswith(":"):
                        name, _, value = line.partition(": ")
                        event[name] = value
        finally:
            ended["sse"] = time.monotonic()

    return Followers(chat_job.result(), sse_job, chat_task, asyncio.create_task(read_sse()),
                     chunks, events, ended)


async def _until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def _tokens_seen(followers: Followers) -> tuple[int, int]:
    """The tokens each follower got so far: (the chat stream's, the SSE subscriber's)."""
    return (sum(bool(content) for content, _ in followers.chunks),
            sum(event.get("event") == "token" for event in followers.events))


async def _ride_out(stack: Stack) -> Followers:
    async with openai.AsyncOpenAI(base_url=f"{stack.api.url}/v1", api_key="none",
                                  max_retries=0) as client, \
            httpx.AsyncClient(base_url=stack.api.url, timeout=30) as http:
        followers = await _start_followers(stack, client, http)
        redis = stack.redis()
        _write_tokens(redis, [followers.chat_job, followers.sse_job], 0, BEFORE_CRASH)
        await _until(lambda: min(_tokens_seen(followers)) >= BEFORE_CRASH, 10,
                     "the first tokens on both streams")
        stack.server.kill()
        await asyncio.sleep(OUTAGE_S)
        assert not followers.ended, f"a stream ended during the outage: {followers.ended}"
        stack.server.start(appendonly=True, extra_args=AOF_ARGS)
        redis = stack.redis()  # (start returned once it answered, its file loaded)
        _write_tokens(redis, [followers.chat_job, followers.sse_job], BEFORE_CRASH, NUM_TOKENS)
        _write_done(redis, [followers.chat_job, followers.sse_job])
        await asyncio.wait_for(asyncio.gather(followers.chat_task, followers.sse_task), 30)
    return followers


def test_open_streams_ride_out_a_redis_restart(stack: Stack) -> None:
    followers = asyncio.run(_ride_out(stack))
    texts = [f"t{i}" for i in range(NUM_TOKENS)]
    # Every token once, in order, then the finish: no error chunk, nothing repeated.
    assert [content for content, _ in followers.chunks if content] == texts
    assert [reason for _, reason in followers.chunks if reason] == ["stop"]
    assert [(e["id"], e["event"]) for e in followers.events] == [
        *((stream_ids.token_entry_id(i), "token") for i in range(NUM_TOKENS)),
        (stream_ids.done_entry_id(NUM_TOKENS), "done")]
    assert [json.loads(e["data"]).get("text") for e in followers.events[:-1]] == texts
    assert "unreachable under open streams" in stack.api.log_path.read_text()  # the outage did reach the readers


async def _outlast(stack: Stack) -> tuple[Followers, float]:
    async with openai.AsyncOpenAI(base_url=f"{stack.api.url}/v1", api_key="none",
                                  max_retries=0) as client, \
            httpx.AsyncClient(base_url=stack.api.url, timeout=30) as http:
        followers = await _start_followers(stack, client, http)
        _write_tokens(stack.redis(), [followers.chat_job, followers.sse_job], 0, BEFORE_CRASH)
        await _until(lambda: min(_tokens_seen(followers)) >= BEFORE_CRASH, 10,
                     "the first tokens on both streams")
        killed_at = time.monotonic()
        stack.server.kill()
        results = await asyncio.wait_for(asyncio.gather(
            followers.chat_task, followers.sse_task, return_exceptions=True), 30)
    chat_error = results[0]
    assert isinstance(chat_error, openai.APIError), results
    assert str(chat_error) == (
        "Redis became unreachable while streaming; the jobs go on: follow them at "
        f"/v1/jobs/<job id>/stream (job ids {followers.chat_job})")
    assert results[1] is None, results  # the SSE stream ended cleanly
    return followers, killed_at


def test_a_stream_ends_with_an_error_once_redis_stays_out_past_the_grace(
        short_grace_stack: Stack) -> None:
    followers, killed_at = asyncio.run(_outlast(short_grace_stack))
    assert [content for content, _ in followers.chunks if content] == ["t0", "t1", "t2"]
    assert [(e["id"], e["event"]) for e in followers.events] == [
        (stream_ids.token_entry_id(i), "token") for i in range(BEFORE_CRASH)]
    # Each held on for the grace before it gave up.
    for follower, ended_at in followers.ended.items():
        assert SHORT_GRACE_S <= ended_at - killed_at < SHORT_GRACE_S + 5, (follower, ended_at)
