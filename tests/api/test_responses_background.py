"""Background responses: answered at once as queued, polled (queued, in_progress, then the
finished response, settled once and kept), cancelled, failed, and continued only once done; with
the official openai client. A test plays the worker (api_support.Harness)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest
from api_support import MODEL, Harness, parse_sse

from protocol import FinishReason, JobStatus, Priority
from protocol.rq_keys import RQKeys

pytestmark = pytest.mark.anyio

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}


async def _create(client: httpx.AsyncClient, **fields: Any) -> dict[str, Any]:
    response = await client.post("/v1/responses", json={"input": "hello", "background": True,
                                                        **fields})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    assert response.headers["x-carpool-job-id"] == body["id"].removeprefix("resp_")
    return body


async def _get(client: httpx.AsyncClient, response_id: str) -> dict[str, Any]:
    response = await client.get(f"/v1/responses/{response_id}")
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


async def test_a_background_response_is_queued_then_polled_to_its_end(
        harness: Harness, client: httpx.AsyncClient) -> None:
    created = await _create(client, instructions="be brief", max_output_tokens=5,
                            metadata={"ticket": "7"})
    job_id = created["id"].removeprefix("resp_")
    assert (created["status"], created["background"], created["output"], created["usage"]) == (
        "queued", True, [], None)
    assert (created["instructions"], created["metadata"]) == ("be brief", {"ticket": "7"})
    queue = RQKeys.queue(harness.keys.queue_name(MODEL, Priority.NORMAL))
    assert harness.sync.lrange(queue, 0, -1) == [job_id]  # a job like any other
    assert (await _get(client, created["id"]))["status"] == "queued"
    assert await harness.take_job() == job_id
    harness.publish_tokens(job_id, ["Hi"])  # a worker holds it
    assert (await _get(client, created["id"]))["status"] == "in_progress"
    harness.publish_tokens(job_id, [" there"], start=1)
    harness.publish_done(job_id, 2, FinishReason.STOP, 7, text="Hi there")
    done = await _get(client, created["id"])
    assert done == {
        **created, "status": "completed", "completed_at": done["completed_at"],
        "output": [{"id": f"msg_{job_id}", "type": "message", "status": "completed",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Hi there", "annotations": []}]}],
        "usage": {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": 2, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": 9}}
    assert done["completed_at"] == int(harness.state(job_id).finished_at)  # the job's end
    # Settled once: the stored response is the finished one (no second build, the same time).
    assert harness.context.sync.exists(harness.keys.state(job_id))
    stored = await harness.context.responses.get(created["id"], "")
    assert stored.job_id is None and stored.response == done
    assert await _get(client, created["id"]) == done
    items = (await client.get(f"/v1/responses/{created['id']}/input_items")).json()
    assert [item["content"] for item in items["data"]] == [[{"type": "input_text", "text": "hello"}]]


async def test_a_continuation_waits_for_its_background_response(
        harness: Harness, client: httpx.AsyncClient) -> None:
    created = await _create(client)
    early = await client.post("/v1/responses", json={  # (in the background: nothing waits)
        "input": "and then?", "previous_response_id": created["id"], "background": True})
    assert early.status_code == 400
    assert early.json()["error"] == {
        "message": f"'previous_response_id' names response '{created['id']}', which is still "
                   "queued: continue it once it has completed",
        "type": "invalid_request_error", "param": "previous_response_id", "code": "invalid_value"}
    await harness.serve_next_job(["Blue"])
    worker = asyncio.create_task(harness.serve_next_job(["Green"]))
    later = await client.post("/v1/responses", json={
        "input": "and then?", "previous_response_id": created["id"]})
    job_id = await worker
    assert later.status_code == 200, later.text
    from rq.job import Job
    from rq.serializers import JSONSerializer

    spec = Job.fetch(job_id, connection=harness.context.sync, serializer=JSONSerializer).args[0]
    assert spec["messages"] == [{"role": "user", "content": "hello"},
                                {"role": "assistant", "content": "Blue"},
                                {"role": "user", "content": "and then?"}]


async def test_cancel_ends_a_queued_background_response(harness: Harness,
                                                        client: httpx.AsyncClient) -> None:
    created = await _create(client)
    job_id = created["id"].removeprefix("resp_")
    answer = await client.post(f"/v1/responses/{created['id']}/cancel")
    assert answer.status_code == 200, answer.text
    cancelled = answer.json()
    # Nothing generated: an empty message, as a cancelled response of the route has.
    assert (cancelled["status"], cancelled["output"]) == ("cancelled", [
        {"id": f"msg_{job_id}", "type": "message", "status": "incomplete", "role": "assistant",
         "content": [{"type": "output_text", "text": "", "annotations": []}]}])
    assert harness.state(job_id).status is JobStatus.CANCELED
    assert await _get(client, created["id"]) == cancelled
    # Cancelling again answers it as it is.
    assert (await client.post(f"/v1/responses/{created['id']}/cancel")).json() == cancelled


async def test_cancel_of_a_running_response_keeps_what_it_generated(
        harness: Harness, client: httpx.AsyncClient) -> None:
    created = await _create(client)
    job_id = await harness.take_job()
    harness.publish_tokens(job_id, ["Once", " upon"])

    async def worker_obeys_the_cancel() -> None:
        while not harness.sync.sismember(harness.keys.canceled(), job_id):
            await asyncio.sleep(0.01)
        harness.publish_done(job_id, 2, FinishReason.CANCELED, text="Once upon")

    worker = asyncio.create_task(worker_obeys_the_cancel())
    cancelled = (await client.post(f"/v1/responses/{created['id']}/cancel")).json()
    await worker
    assert cancelled["status"] == "cancelled"
    assert cancelled["output"][0]["content"][0]["text"] == "Once upon"
    assert cancelled["output"][0]["status"] == "incomplete"


async def test_a_failed_job_makes_a_failed_response(harness: Harness,
                                                    client: httpx.AsyncClient) -> None:
    created = await _create(client)
    job_id = await harness.take_job()
    harness.publish_done(job_id, 0, FinishReason.ERROR, error="out of memory")
    failed = await _get(client, created["id"])
    assert (failed["status"], failed["error"], failed["output"]) == (
        "failed", {"code": "server_error", "message": "The job failed: out of memory"}, [])


async def test_only_background_responses_can_be_cancelled(harness: Harness,
                                                          client: httpx.AsyncClient) -> None:
    worker = asyncio.create_task(harness.serve_next_job(["Hi"]))
    done = (await client.post("/v1/responses", json={"input": "hello"})).json()
    await worker
    answer = await client.post(f"/v1/responses/{done['id']}/cancel")
    assert answer.status_code == 400
    assert answer.json()["error"]["message"] == ("Only a response made with background: true can "
                                                 "be cancelled")
    assert (await client.post("/v1/responses/resp_nope/cancel")).status_code == 404


async def test_the_official_client_creates_polls_and_cancels(harness: Harness) -> None:
    transport = httpx.ASGITransport(app=harness.app, raise_app_exceptions=False)
    client = openai.AsyncOpenAI(base_url="http://carpool.test/v1", api_key="none", max_retries=0,
                                http_client=httpx.AsyncClient(transport=transport))
    created = await client.responses.create(model=MODEL, input="hello", background=True)
    assert (created.status, created.background) == ("queued", True)
    await harness.serve_next_job(["Hi", " you"])
    polled = await client.responses.retrieve(created.id)
    assert (polled.status, polled.output_text) == ("completed", "Hi you")
    other = await client.responses.create(model=MODEL, input="again", background=True)
    cancelled = await client.responses.cancel(other.id)
    assert cancelled.status == "cancelled"


def _events(text: str) -> list[dict[str, Any]]:
    return [json.loads(event["data"]) for event in parse_sse(text) if "data" in event]


async def _streamed(client: httpx.AsyncClient, method: str, path: str,
                    **kwargs: Any) -> list[dict[str, Any]]:
    answer = await client.request(method, path, **kwargs)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("text/event-stream")
    return _events(answer.text)


async def test_a_background_stream_is_numbered_alike_at_every_reading(
        harness: Harness, client: httpx.AsyncClient) -> None:
    async def worker() -> str:
        job_id = await harness.take_job()
        harness.publish_tokens(job_id, ["Once"])
        harness.publish_run(job_id, [" upon", " a", " time"], start=1)  # one entry, three tokens
        harness.publish_done(job_id, 4, FinishReason.STOP, 7, text="Once upon a time")
        return job_id

    running = asyncio.create_task(worker())
    live = await _streamed(client, "POST", "/v1/responses",
                           json={"input": "hello", "background": True, "stream": True})
    job_id = await running
    response_id = f"resp_{job_id}"
    assert [event["sequence_number"] for event in live] == list(range(len(live)))
    assert [event["type"] for event in live] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * 4,
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert [event["delta"] for event in live[4:8]] == ["Once", " upon", " a", " time"]
    assert live[0]["response"]["background"] is True
    # The last event carries the stored response, as GET answers it.
    stored = await _get(client, response_id)
    assert (stored["status"], stored["output"][0]["content"][0]["text"]) == (
        "completed", "Once upon a time")
    assert live[-1]["response"] == stored
    # Read again, whole or after a sequence number: the same events.
    assert await _streamed(client, "GET", f"/v1/responses/{response_id}",
                           params={"stream": "true"}) == live
    assert await _streamed(client, "GET", f"/v1/responses/{response_id}",
                           params={"stream": "true", "starting_after": 5}) == live[6:]
    assert await _streamed(client, "GET", f"/v1/responses/{response_id}",
                           params={"stream": "true", "starting_after": 99}) == []


async def test_a_polled_background_response_can_be_streamed(
        harness: Harness, client: httpx.AsyncClient) -> None:
    harness.register_model(context=4096)  # room for the tool's system prompt
    created = await _create(client, tools=[WEATHER], tool_choice="required")
    worker = asyncio.create_task(harness.serve_next_job([CALL]))
    events = await _streamed(client, "GET", f"/v1/responses/{created['id']}",
                             params={"stream": "true"})
    await worker
    stored = await _get(client, created["id"])
    [call] = stored["output"]
    added = [event["item"] for event in events if event["type"] == "response.output_item.added"]
    # The call streamed is the call stored: the same id, parsed from the same job.
    assert [(item["type"], item["id"], item["call_id"]) for item in added] == [
        ("function_call", call["id"], call["call_id"])]
    assert events[-1] == {**events[-1], "type": "response.completed", "response": stored}


async def test_only_background_responses_stream_from_get(
        harness: Harness, client: httpx.AsyncClient) -> None:
    worker = asyncio.create_task(harness.serve_next_job(["Hi"]))
    foreground = (await client.post("/v1/responses", json={"input": "hello"})).json()
    await worker
    answer = await client.get(f"/v1/responses/{foreground['id']}", params={"stream": "true"})
    assert answer.status_code == 400
    assert answer.json()["error"] == {
        "message": "Only a response made with background: true can be streamed here; this one "
                   "was answered to its request", "type": "invalid_request_error",
        "param": "stream", "code": "invalid_value"}
    created = await _create(client)
    answer = await client.get(f"/v1/responses/{created['id']}",
                              params={"stream": "true", "starting_after": -1})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "query.starting_after"
    harness.sync.delete(harness.keys.state(created["id"].removeprefix("resp_")))  # expired
    answer = await client.get(f"/v1/responses/{created['id']}", params={"stream": "true"})
    assert answer.status_code == 404 and "is gone" in answer.json()["error"]["message"]
