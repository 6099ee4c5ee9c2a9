"""GET /v1/jobs/{id}/stream: SSE replay, Last-Event-ID resume, live following, keep-alives."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import fakeredis
import httpx
import pytest
from api_support import Harness, make_harness, parse_sse
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer

from protocol import FinishReason, Priority

pytestmark = pytest.mark.anyio


@pytest.fixture(params=[True, False], ids=["hub", "own-xread"])
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    """Every stream test twice: readers through the process's StreamHub, and each on its own."""
    h = make_harness(stream_hub=request.param)
    h.register_model()
    yield h


async def _job(client: httpx.AsyncClient) -> str:
    response = await client.post("/v1/jobs", json={"prompt": "hello world"})
    assert response.status_code == 202
    return response.json()["job_id"]


def _events(response: httpx.Response) -> list[dict[str, str]]:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    return [event for event in parse_sse(response.text) if "comment" not in event]


async def test_finished_job_replays_every_event(harness: Harness,
                                                client: httpx.AsyncClient) -> None:
    job_id = await _job(client)
    harness.finish_job(job_id, ["Hel", "lo", "!"], FinishReason.STOP, prompt_tokens=2)
    response = await client.get(f"/v1/jobs/{job_id}/stream")
    assert response.headers["x-carpool-job-id"] == job_id
    assert response.headers["cache-control"] == "no-cache"
    events = _events(response)
    assert [(e["id"], e["event"]) for e in events] == [
        ("0-1", "token"), ("0-2", "token"), ("0-3", "token"), ("0-4", "done")]
    assert [json.loads(e["data"]) for e in events[:3]] == [
        {"index": 0, "token_id": 100, "text": "Hel"},
        {"index": 1, "token_id": 101, "text": "lo"},
        {"index": 2, "token_id": 102, "text": "!"},
    ]
    assert json.loads(events[3]["data"]) == {
        "finish_reason": "stop", "error": None,
        "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}}


@pytest.mark.parametrize("resume", ["header", "query"])
async def test_resume_after_last_event_id_gets_exactly_the_rest(
        harness: Harness, client: httpx.AsyncClient, resume: str) -> None:
    job_id = await _job(client)
    harness.finish_job(job_id, ["a", "b", "c", "d"])
    if resume == "header":
        response = await client.get(f"/v1/jobs/{job_id}/stream", headers={"Last-Event-ID": "0-2"})
    else:
        response = await client.get(f"/v1/jobs/{job_id}/stream", params={"after": "0-2"})
    events = _events(response)
    assert [e["id"] for e in events] == ["0-3", "0-4", "0-5"]
    assert [json.loads(e["data"]).get("text") for e in events] == ["c", "d", None]


@pytest.mark.parametrize("after", [None, "0-3"])
async def test_a_run_streams_as_one_event_per_token_and_resumes_inside_it(
        harness: Harness, client: httpx.AsyncClient, after: str | None) -> None:
    job_id = await _job(client)
    harness.publish_tokens(job_id, ["a"])
    harness.publish_run(job_id, ["b", "c", "d", "e"], start=1)  # tokens 1-4, entry id 0-5
    harness.publish_done(job_id, 5)
    headers = {"Last-Event-ID": after} if after else {}
    events = _events(await client.get(f"/v1/jobs/{job_id}/stream", headers=headers))
    ids = ["0-1", "0-2", "0-3", "0-4", "0-5", "0-6"]
    data = [{"index": i, "token_id": 100 + i, "text": t} for i, t in enumerate("abcde")]
    skip = ids.index(after) + 1 if after else 0
    assert [e["id"] for e in events] == ids[skip:]
    assert [json.loads(e["data"]) for e in events[:-1]] == data[skip:]


async def test_a_run_published_while_a_client_watches_arrives_token_by_token(
        harness: Harness, client: httpx.AsyncClient) -> None:
    job_id = await _job(client)

    async def worker() -> None:
        await asyncio.sleep(0.05)
        harness.publish_tokens(job_id, ["one"])
        await asyncio.sleep(0.05)
        harness.publish_run(job_id, [" two", " three"], start=1)
        await asyncio.sleep(0.05)
        harness.publish_done(job_id, 3, FinishReason.LENGTH)

    task = asyncio.create_task(worker())
    response = await client.get(f"/v1/jobs/{job_id}/stream")
    await task
    events = _events(response)
    assert [(e["id"], json.loads(e["data"]).get("text")) for e in events] == [
        ("0-1", "one"), ("0-2", " two"), ("0-3", " three"), ("0-4", None)]


async def test_resume_after_the_final_event_answers_204(harness: Harness,
                                                        client: httpx.AsyncClient) -> None:
    job_id = await _job(client)
    harness.finish_job(job_id, ["a"])
    response = await client.get(f"/v1/jobs/{job_id}/stream", headers={"Last-Event-ID": "0-2"})
    assert response.status_code == 204


async def test_malformed_last_event_id_is_422(harness: Harness, client: httpx.AsyncClient) -> None:
    job_id = await _job(client)
    response = await client.get(f"/v1/jobs/{job_id}/stream", headers={"Last-Event-ID": "three"})
    assert response.status_code == 422
    detail = response.json()["detail"][0]
    assert detail["loc"] == ["header", "last-event-id"]
    assert "'three'" in detail["msg"]


@pytest.mark.parametrize(("headers", "params", "loc"), [
    # Each half of a stream id is an unsigned 64-bit integer: Redis refused this one mid-stream,
    # after the 200 had been sent, and the client saw a broken chunked body.
    ({"Last-Event-ID": "0-18446744073709551616"}, {}, ["header", "last-event-id"]),
    ({}, {"after": "99999999999999999999-0"}, ["query", "after"]),
    # Unicode digits: Python's int() reads them, Redis does not.
    ({"Last-Event-ID": "\uff11-\uff12".encode()}, {}, ["header", "last-event-id"]),
    ({}, {"after": "\u0661-\u0662"}, ["query", "after"]),
    ({}, {"after": "0-1-2"}, ["query", "after"]),
])
async def test_stream_ids_redis_would_refuse_are_422(
        harness: Harness, client: httpx.AsyncClient, headers: dict[str, str | bytes],
        params: dict[str, str], loc: list[str]) -> None:
    job_id = await _job(client)
    response = await client.get(f"/v1/jobs/{job_id}/stream", headers=headers, params=params)
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == loc


async def test_the_largest_stream_id_is_valid(harness: Harness, client: httpx.AsyncClient) -> None:
    job_id = await _job(client)
    harness.finish_job(job_id, ["a"])
    largest = "18446744073709551615-18446744073709551615"
    response = await client.get(f"/v1/jobs/{job_id}/stream", headers={"Last-Event-ID": largest})
    assert response.status_code == 204


async def test_live_job_streams_tokens_as_they_come_then_ends(
        harness: Harness, client: httpx.AsyncClient) -> None:
    job_id = await _job(client)

    async def worker() -> None:
        for index, text in enumerate(["one", " two", " three"]):
            await asyncio.sleep(0.03)
            harness.publish_tokens(job_id, [text], start=index)
        await asyncio.sleep(0.15)  # longer than the keep-alive interval (0.05 s)
        harness.publish_done(job_id, 3, FinishReason.LENGTH)

    task = asyncio.create_task(worker())
    response = await client.get(f"/v1/jobs/{job_id}/stream")
    await task
    raw = parse_sse(response.text)
    assert {"comment": "keep-alive"} in raw
    events = _events(response)
    assert [json.loads(e["data"]).get("text") for e in events] == ["one", " two", " three", None]
    assert json.loads(events[-1]["data"])["finish_reason"] == "length"


async def test_many_clients_watch_one_job(harness: Harness, client: httpx.AsyncClient) -> None:
    job_id = await _job(client)

    async def worker() -> None:
        await asyncio.sleep(0.05)
        harness.finish_job(job_id, ["x", "y"])

    task = asyncio.create_task(worker())
    responses = await asyncio.gather(*(client.get(f"/v1/jobs/{job_id}/stream") for _ in range(3)))
    await task
    seen = [[(e["id"], e["data"]) for e in _events(r)] for r in responses]
    assert seen[0] == seen[1] == seen[2]
    assert len(seen[0]) == 3


async def test_canceled_queued_job_stream_ends_with_canceled(harness: Harness,
                                                             client: httpx.AsyncClient) -> None:
    job_id = await _job(client)

    async def cancel_soon() -> None:
        await asyncio.sleep(0.05)
        await client.delete(f"/v1/jobs/{job_id}")

    task = asyncio.create_task(cancel_soon())
    events = _events(await client.get(f"/v1/jobs/{job_id}/stream"))
    await task
    assert [e["event"] for e in events] == ["done"]
    assert json.loads(events[0]["data"])["finish_reason"] == "canceled"


@pytest.mark.parametrize("taken_by", ["rq empty", "Job.delete", "Job.cancel"])
async def test_a_queued_job_rq_itself_took_away_ends_its_stream_canceled(
        harness: Harness, client: httpx.AsyncClient, taken_by: str) -> None:
    """`rq empty`, rq-dashboard's delete or rq's own cancel take a queued job off its queue;
    no worker will claim it, so its follower ends it instead of waiting for ever."""
    job_id = await _job(client)
    rq_redis = fakeredis.FakeRedis(server=harness.server)  # rq reads bytes
    queue = Queue(harness.keys.queue_name("tiny", Priority.NORMAL), connection=rq_redis,
                  serializer=JSONSerializer)

    async def rq_takes_it_soon() -> None:
        await asyncio.sleep(0.05)
        rq_job = Job.fetch(job_id, rq_redis, serializer=JSONSerializer)
        {"rq empty": lambda: queue.empty(), "Job.delete": rq_job.delete,
         "Job.cancel": rq_job.cancel}[taken_by]()

    task = asyncio.create_task(rq_takes_it_soon())
    events = _events(await client.get(f"/v1/jobs/{job_id}/stream"))
    await task
    assert [(e["id"], e["event"]) for e in events] == [("0-1", "done")]
    assert json.loads(events[0]["data"])["finish_reason"] == "canceled"
    status = (await client.get(f"/v1/jobs/{job_id}")).json()["status"]
    assert status == "canceled"


async def test_job_ended_without_a_final_entry_still_ends_the_stream(
        harness: Harness, client: httpx.AsyncClient) -> None:
    # E.g. a job failed by recovery code that only wrote its state: readers must not hang.
    job_id = await _job(client)
    harness.publish_tokens(job_id, ["a"])
    harness.sync.hset(harness.keys.state(job_id), mapping={
        "status": "failed", "finish_reason": "error", "error": "worker lost", "prompt_tokens": 2,
        "completion_tokens": 1})
    events = _events(await client.get(f"/v1/jobs/{job_id}/stream"))
    assert [(e["id"], e["event"]) for e in events] == [("0-1", "token"), ("0-2", "done")]
    assert json.loads(events[1]["data"]) == {
        "finish_reason": "error", "error": "worker lost",
        "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}}
