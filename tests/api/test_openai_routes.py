"""The OpenAI-compatible routes: exact response and chunk formats, the official client, cancel
on disconnect. A background task plays the worker: it takes the job off the queue and writes
the stream entries a worker would."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import openai
import pytest
from api_support import CONTEXT, MODEL, Harness, parse_sse

from api.openai_choices import ChoiceJob
from api.openai_chunks import ChunkWriter
from api.openai_stream import chunk_payloads
from protocol import FinishReason, JobStatus

pytestmark = pytest.mark.anyio

CHAT = [{"role": "user", "content": "hello"}]


def _openai_client(harness: Harness, key: str = "none") -> openai.AsyncOpenAI:
    transport = httpx.ASGITransport(app=harness.app, raise_app_exceptions=False)
    return openai.AsyncOpenAI(base_url="http://carpool.test/v1", api_key=key, max_retries=0,
                              http_client=httpx.AsyncClient(transport=transport))


def _data_lines(text: str) -> list[Any]:
    out: list[Any] = []
    for event in parse_sse(text):
        if "data" in event:
            out.append("[DONE]" if event["data"] == "[DONE]" else json.loads(event["data"]))
    return out


async def test_models_lists_the_cards_of_models_a_live_worker_serves(
        harness: Harness, client: httpx.AsyncClient) -> None:
    harness.register_model("second", context=64, created_at=9.0)
    harness.register_model("unserved", created_at=5.0)  # its workers are gone
    harness.add_worker("w1")
    harness.add_worker("w2", model="second")
    harness.add_worker("w3", model="second")
    response = await client.get("/v1/models")
    # OpenAI's list and model objects with Anthropic's fields beside them (its client lists the
    # same route): type, display_name, created_at, and the page's has_more / first_id / last_id.
    assert response.json() == {"object": "list", "data": [
        {"id": MODEL, "object": "model", "created": 1, "owned_by": "carpool",
         "max_model_len": CONTEXT, "generation_defaults": {}, "type": "model",
         "display_name": MODEL, "created_at": "1970-01-01T00:00:01Z"},
        {"id": "second", "object": "model", "created": 9, "owned_by": "carpool",
         "max_model_len": 64, "generation_defaults": {}, "type": "model",
         "display_name": "second", "created_at": "1970-01-01T00:00:09Z"},
    ], "has_more": False, "first_id": MODEL, "last_id": "second"}
    models = await _openai_client(harness).models.list()
    assert [m.id for m in models.data] == [MODEL, "second"]
    assert (await client.get("/v1/models/second")).json()["max_model_len"] == 64
    missing = await client.get("/v1/models/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert (await client.get("/v1/models/unserved")).status_code == 404
    # The card expires with its last worker's heartbeat (the TTL'd stats hash).
    harness.sync.delete(harness.keys.worker_stats("w2"), harness.keys.worker_stats("w3"))
    assert [m["id"] for m in (await client.get("/v1/models")).json()["data"]] == [MODEL]


async def test_completion_waits_for_the_job(harness: Harness, client: httpx.AsyncClient) -> None:
    worker = asyncio.create_task(harness.serve_next_job(["Hel", "lo"], FinishReason.LENGTH, 2))
    response = await client.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 2})
    job_id = await worker
    assert response.status_code == 200
    assert response.headers["x-carpool-job-id"] == job_id
    body = response.json()
    assert body == {
        "id": f"cmpl-{job_id}", "object": "text_completion", "created": body["created"],
        "model": MODEL,
        "choices": [{"index": 0, "text": "Hello", "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4,
                  "prompt_tokens_details": {"cached_tokens": 0}},
    }
    assert isinstance(body["created"], int)


async def test_chat_completion_waits_for_the_job(harness: Harness,
                                                 client: httpx.AsyncClient) -> None:
    worker = asyncio.create_task(harness.serve_next_job(["Hi", " there"], FinishReason.STOP, 7))
    response = await client.post("/v1/chat/completions", json={"messages": CHAT})
    job_id = await worker
    body = response.json()
    assert body == {
        "id": f"chatcmpl-{job_id}", "object": "chat.completion", "created": body["created"],
        "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi there"},
                     "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9,
                  "prompt_tokens_details": {"cached_tokens": 0}},
    }


async def test_a_tgi_clients_placeholder_model_is_the_served_model(harness: Harness,
                                                                     client: httpx.AsyncClient) -> None:
    # huggingface_hub's InferenceClient sends "dummy" where it reaches a server by URL.
    worker = asyncio.create_task(harness.serve_next_job(["Hi"], FinishReason.STOP, 7))
    response = await client.post("/v1/chat/completions", json={"model": "dummy", "messages": CHAT})
    job_id = await worker
    assert response.status_code == 200, response.text
    assert response.json()["model"] == MODEL
    assert harness.job_spec(job_id)["model"] == MODEL


async def test_chat_without_max_tokens_may_fill_the_context(harness: Harness,
                                                            client: httpx.AsyncClient) -> None:
    worker = asyncio.create_task(harness.serve_next_job(["x"]))
    await client.post("/v1/chat/completions", json={"messages": CHAT})
    job_id = await worker
    from rq.job import Job
    from rq.serializers import JSONSerializer

    spec = Job.fetch(job_id, connection=harness.context.sync, serializer=JSONSerializer).args[0]
    assert spec["sampling"]["max_tokens"] == CONTEXT - 6  # the rendered chat takes 6 tokens
    assert spec["messages"] == CHAT


async def test_streamed_completion_chunks(harness: Harness, client: httpx.AsyncClient) -> None:
    worker = asyncio.create_task(harness.serve_next_job(["a", "", "b"], FinishReason.STOP, 2))
    response = await client.post("/v1/completions", json={"prompt": "hello", "stream": True})
    job_id = await worker
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    chunks = _data_lines(response.text)
    created = chunks[0]["created"]
    head = {"id": f"cmpl-{job_id}", "object": "text_completion", "created": created, "model": MODEL}
    assert chunks == [
        {**head, "choices": [{"index": 0, "text": "a", "logprobs": None, "finish_reason": None}]},
        {**head, "choices": [{"index": 0, "text": "b", "logprobs": None, "finish_reason": None}]},
        {**head, "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}]},
        "[DONE]",
    ]


async def test_streamed_chat_chunks_with_usage(harness: Harness, client: httpx.AsyncClient) -> None:
    worker = asyncio.create_task(harness.serve_next_job(["Hi", "!"], FinishReason.LENGTH, 6))
    response = await client.post("/v1/chat/completions", json={
        "messages": CHAT, "stream": True, "stream_options": {"include_usage": True},
        "max_tokens": 2})
    job_id = await worker
    chunks = _data_lines(response.text)
    head = {"id": f"chatcmpl-{job_id}", "object": "chat.completion.chunk",
            "created": chunks[0]["created"], "model": MODEL}

    def choice(delta: dict[str, str], finish: str | None = None) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                     "finish_reason": finish}], "usage": None}

    assert chunks == [
        choice({"role": "assistant", "content": ""}),
        choice({"content": "Hi"}),
        choice({"content": "!"}),
        choice({}, "length"),
        {**head, "choices": [], "usage": {"prompt_tokens": 6, "completion_tokens": 2,
                                          "total_tokens": 8,
                                          "prompt_tokens_details": {"cached_tokens": 0}}},
        "[DONE]",
    ]


async def test_a_chat_stream_opens_with_its_first_token_not_at_submission(
        harness: Harness, client: httpx.AsyncClient) -> None:
    """The role chunk waits for the job's first entry, as vLLM's does: benchmark clients (vLLM's
    own among them) take a stream's first chunk as its first token."""
    before = time.monotonic()
    submitted = await client.post("/v1/jobs", json={"prompt": "hello", "max_tokens": 2})
    job_id = submitted.json()["job_id"]
    writer = ChunkWriter(is_chat=True, response_id=f"chatcmpl-{job_id}", created=1, model=MODEL,
                         include_usage=False)
    sent: list[tuple[bool, dict[str, Any]]] = []  # (whether the job had a token then, chunk)
    has_token = False

    async def read() -> None:
        async for payload in chunk_payloads(harness.context, [ChoiceJob(0, 0, job_id, fresh_since=before)],
                                            writer, {}, None):
            if payload is not None:  # (None: a keep-alive comment)
                sent.append((has_token, payload))

    reading = asyncio.create_task(read())
    await asyncio.sleep(0.3)  # the job waits in the queue
    has_token = True
    harness.publish_tokens(job_id, ["Hi"])
    harness.publish_done(job_id, 1, FinishReason.LENGTH)
    await asyncio.wait_for(reading, 5)
    assert [(after, chunk["choices"][0]["delta"]) for after, chunk in sent] == [
        (True, {"role": "assistant", "content": ""}), (True, {"content": "Hi"}), (True, {})]


@pytest.mark.parametrize(("route", "body", "choices"), [
    ("/v1/chat/completions", {"messages": CHAT},
     [({"role": "assistant", "content": ""}, None), ({"content": "Hi"}, None), ({}, "stop")]),
    ("/v1/completions", {"prompt": "hello"}, [("Hi", None), ("", "stop")]),
])
async def test_a_stream_that_waits_for_its_first_token_keeps_alive_with_empty_lines(
        harness: Harness, route: str, body: dict[str, Any], choices: list[tuple[Any, str | None]]
) -> None:
    """While the job waits (four keep-alive intervals here), the stream sends empty lines, never
    a comment: a client that strips each network read before it looks for an event's end (vLLM's
    `vllm bench serve`) would glue a comment read alone onto the events after it."""
    worker = asyncio.create_task(harness.serve_next_job(["Hi"], FinishReason.STOP, 2, delay_s=0.2))
    # Straight through ASGI, so that each piece the app sends is seen as sent (a network read).
    sent = await _drive_asgi(harness, route, {**body, "stream": True}, "2.4", 10_000)
    await worker
    reads = [m["body"] for m in sent if m["type"] == "http.response.body" and m.get("body")]
    quiet = [piece for piece in reads if not piece.strip()]
    assert quiet and set(quiet) == {b"\n"}
    assert b"".join(reads).startswith(b"\n" * len(quiet) + b"data: ")
    assert not any(line.startswith(b":") for line in b"".join(reads).split(b"\n"))
    chunks = _data_lines(b"".join(reads).decode())
    assert chunks[-1] == "[DONE]"
    assert [(chunk["choices"][0].get("delta", chunk["choices"][0].get("text")),
             chunk["choices"][0]["finish_reason"]) for chunk in chunks[:-1]] == choices


async def test_official_client_completions(harness: Harness) -> None:
    client = _openai_client(harness)
    worker = asyncio.create_task(harness.serve_next_job(["The", " end"], FinishReason.STOP, 2))
    completion = await client.completions.create(model=MODEL, prompt="hello world", max_tokens=4,
                                                 temperature=0.0, user="someone")
    job_id = await worker
    assert completion.id == f"cmpl-{job_id}"
    assert completion.choices[0].text == "The end"
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None and completion.usage.total_tokens == 4

    worker = asyncio.create_task(harness.serve_next_job(["x", "y"], FinishReason.LENGTH, 2))
    stream = await client.completions.create(model=MODEL, prompt="hello", max_tokens=2, stream=True)
    pieces = [chunk.choices[0].text async for chunk in stream]
    await worker
    assert pieces == ["x", "y", ""]


async def test_official_client_chat(harness: Harness) -> None:
    client = _openai_client(harness)
    worker = asyncio.create_task(harness.serve_next_job(["4"], FinishReason.STOP, 9))
    chat = await client.chat.completions.create(model=MODEL, messages=CHAT, seed=1,  # type: ignore[arg-type]
                                                extra_body={"top_k": 5, "priority": "high"})
    await worker
    assert chat.choices[0].message.content == "4"
    assert chat.choices[0].message.role == "assistant"

    worker = asyncio.create_task(harness.serve_next_job(["Hi", " you"], FinishReason.STOP, 9))
    stream = await client.chat.completions.create(
        model=MODEL, messages=CHAT, stream=True, stream_options={"include_usage": True})  # type: ignore[arg-type]
    chunks = [chunk async for chunk in stream]
    await worker
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hi you"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 2


async def test_official_client_sees_a_400_with_the_field(harness: Harness) -> None:
    client = _openai_client(harness)
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model=MODEL, messages=CHAT, n=17)  # type: ignore[arg-type]
    assert caught.value.param == "n"
    assert caught.value.code == "invalid_value"
    assert caught.value.message.endswith("Invalid value for 'n': at most 16 choices per prompt are "
                                    "accepted (got 17)")


async def test_failed_job_answers_500_or_an_error_chunk(harness: Harness,
                                                        client: httpx.AsyncClient) -> None:
    worker = asyncio.create_task(harness.serve_next_job([], FinishReason.ERROR))
    response = await client.post("/v1/completions", json={"prompt": "hello"})
    await worker
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "server_error"

    async def fail() -> None:
        job_id = await harness.take_job()
        harness.publish_tokens(job_id, ["a"])
        harness.publish_done(job_id, 1, FinishReason.ERROR, error="out of memory")

    worker = asyncio.create_task(fail())
    streamed = await client.post("/v1/completions", json={"prompt": "hello", "stream": True})
    await worker
    chunks = _data_lines(streamed.text)
    assert chunks[0]["choices"][0]["text"] == "a"
    assert chunks[1] == {"error": {"message": "The job failed: out of memory",
                                   "type": "server_error", "param": None, "code": "job_failed"}}
    assert chunks[2] == "[DONE]"
    client_ = _openai_client(harness)
    worker = asyncio.create_task(fail())
    with pytest.raises(openai.APIError, match="out of memory"):
        async for _ in await client_.completions.create(model=MODEL, prompt="hello", stream=True):
            pass
    await worker


async def test_a_job_whose_keys_go_mid_stream_ends_it_with_an_error_chunk(
        harness: Harness, client: httpx.AsyncClient) -> None:
    async def lose() -> None:  # a Redis that lost its data, or a retention shorter than the job
        job_id = await harness.take_job()
        harness.publish_tokens(job_id, ["a"])
        await asyncio.sleep(0.2)
        harness.sync.delete(harness.keys.state(job_id), harness.keys.stream(job_id))

    worker = asyncio.create_task(lose())
    streamed = await client.post("/v1/chat/completions",
                                 json={"messages": CHAT, "stream": True})
    await worker
    chunks = _data_lines(streamed.text)
    job_id = streamed.headers["x-carpool-job-id"]
    assert [chunk["choices"][0]["delta"] for chunk in chunks[:2]] == [
        {"role": "assistant", "content": ""}, {"content": "a"}]
    assert chunks[2:] == [{"error": {"message": f"Job '{job_id}' expired before it ended",
                                     "type": "invalid_request_error", "param": None,
                                     "code": "job_expired"}}, "[DONE]"]


async def _drive_asgi(harness: Harness, path: str, body: dict[str, Any], spec_version: str,
                      leave_after_chunks: int) -> list[dict[str, Any]]:
    """Run one request straight through ASGI with a client that hangs up early: after that many
    body chunks, or (0) 0.1 s after sending its request."""
    gone = asyncio.Event()
    sent: list[dict[str, Any]] = []
    payload = json.dumps(body).encode()
    first = True

    async def receive() -> dict[str, Any]:
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": payload, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if gone.is_set() and spec_version == "2.4":
            raise OSError("connection closed")
        sent.append(message)
        chunks = [m for m in sent if m["type"] == "http.response.body" and m.get("body")]
        if leave_after_chunks and len(chunks) >= leave_after_chunks:
            gone.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version},
             "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"carpool.test"), (b"content-type", b"application/json")],
             "client": ("127.0.0.1", 50000), "server": ("carpool.test", 80)}
    if not leave_after_chunks:
        asyncio.get_running_loop().call_later(0.1, gone.set)
    await asyncio.wait_for(harness.app(scope, receive, send), timeout=5)
    return sent


def _job_id(sent: list[dict[str, Any]]) -> str:
    headers = dict(sent[0]["headers"])
    return headers[b"x-carpool-job-id"].decode()


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
async def test_client_leaving_a_streamed_completion_cancels_its_job(
        harness: Harness, spec_version: str) -> None:
    async def keep_alive_chunks() -> None:
        # The job is running: a worker took it and writes a token now and then.
        job_id = await harness.take_job()
        harness.publish_tokens(job_id, ["a"])

    worker = asyncio.create_task(keep_alive_chunks())
    # Two chunks: the assistant's role, then the worker's first token.
    sent = await _drive_asgi(harness, "/v1/chat/completions",
                             {"messages": CHAT, "stream": True}, spec_version, 2)
    await worker
    assert sent[0]["status"] == 200
    job_id = _job_id(sent)
    # Running: the worker is asked to stop it at its next step.
    assert harness.sync.sismember(harness.keys.canceled(), job_id)


async def test_client_leaving_a_queued_streamed_completion_cancels_it_at_once(
        harness: Harness) -> None:
    # A completion stream's first chunk is its first token: leave before it (nothing is running).
    sent = await _drive_asgi(harness, "/v1/completions", {"prompt": "hello", "stream": True}, "2.3",
                             0)
    assert harness.state(_job_id(sent)).status is JobStatus.CANCELED


async def test_client_leaving_a_plain_completion_cancels_its_job(harness: Harness) -> None:
    sent = await _drive_asgi(harness, "/v1/completions", {"prompt": "hello"}, "2.3", 0)
    assert sent[0]["status"] == 499
    assert harness.state(_job_id(sent)).status is JobStatus.CANCELED


async def test_unsupported_but_harmless_params_are_accepted(harness: Harness,
                                                            client: httpx.AsyncClient) -> None:
    worker = asyncio.create_task(harness.serve_next_job(["ok"]))
    response = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "developer", "content": "be nice"},
                     {"role": "user", "content": [{"type": "text", "text": "hel"},
                                                  {"type": "text", "text": "lo"}], "name": "bob"}],
        "user": "u-1", "store": False, "metadata": {"a": "b"}, "parallel_tool_calls": False,
        "response_format": {"type": "text"}, "tool_choice": "none", "logprobs": False, "n": 1,
        "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
        "stream_options": None})
    job_id = await worker
    assert response.status_code == 200, response.text
    from rq.job import Job
    from rq.serializers import JSONSerializer

    spec = Job.fetch(job_id, connection=harness.context.sync, serializer=JSONSerializer).args[0]
    assert spec["messages"] == [{"role": "system", "content": "be nice"},
                                {"role": "user", "content": "hello"}]
