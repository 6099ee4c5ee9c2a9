"""The Batch API against the app on fakeredis: input files checked line by line, the file
routes, and batches advanced by BatchRunner ticks (driven here by hand) while the test serves
the queued jobs as a worker would."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import redis.exceptions
from api_support import KEY_A, KEY_B, MODEL, Harness, make_harness

from api.batch_files import parse_batch_input
from api.batch_runner import BatchRunner
from api.batch_store import BatchStatus
from api.errors import InvalidRequestError
from protocol import FinishReason, JobStatus, Priority
from protocol.rq_keys import RQKeys
from protocol.webhook_events import WebhookEvent

pytestmark = pytest.mark.anyio


def _line(custom_id: str, body: dict | None = None, url: str = "/v1/completions") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": body if body is not None else
                       {"model": MODEL, "prompt": f"say {custom_id}", "max_tokens": 4}})


def _jsonl(*lines: str) -> bytes:
    return ("\n".join(lines) + "\n").encode()


async def _upload(client: httpx.AsyncClient, content: bytes, purpose: str = "batch") -> httpx.Response:
    return await client.post("/v1/files", data={"purpose": purpose},
                             files={"file": ("input.jsonl", content, "application/jsonl")})


# Input files.
def test_a_good_file_parses_into_its_requests_skipping_blank_lines() -> None:
    lines = parse_batch_input(_jsonl(_line("a"), "", _line("b", url="/v1/chat/completions")), 10)
    assert [(x.index, x.line_number, x.custom_id, x.url) for x in lines] == [
        (0, 1, "a", "/v1/completions"), (1, 3, "b", "/v1/chat/completions")]
    assert lines[0].body == {"model": MODEL, "prompt": "say a", "max_tokens": 4}


@pytest.mark.parametrize(("content", "message"), [
    (_jsonl(_line("a"), "{not json"), "Line 2: not valid JSON"),
    (_jsonl(_line("a"), "[1]"), "Line 2: must be a JSON object, got list"),
    (_jsonl(_line("a"), _line("a")), "Line 2: custom_id 'a' is used on line 1 too"),
    (_jsonl(_line("a", url="/v1/embeddings")), "Line 1: 'url' must be one of /v1/chat/completions"),
    (_jsonl(json.dumps({"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}})),
     "Line 1: 'method' must be \"POST\" (got \"GET\")"),
    (_jsonl(json.dumps({"custom_id": "", "method": "POST", "url": "/v1/completions", "body": {}})),
     "Line 1: 'custom_id' must be a non-empty string"),
    (_jsonl(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": 3})),
     "Line 1: 'body' must be a JSON object"),
    (_jsonl(_line("a")) + b"\xff\n", "Line 2 is not UTF-8 (byte 0xff)"),
    (b"\n\n", "The file holds no requests"),
    (_jsonl(_line("a"), _line("b"), _line("c")), "The file holds more than 2 requests"),
])
def test_a_bad_file_is_refused_naming_the_line(content: bytes, message: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        parse_batch_input(content, max_lines=2)
    assert caught.value.message.startswith(message), caught.value.message
    assert caught.value.param == "file"


# File routes.
async def test_files_upload_retrieve_content_list_delete(client: httpx.AsyncClient) -> None:
    content = _jsonl(_line("a"), _line("b"))
    uploaded = await _upload(client, content)
    assert uploaded.status_code == 200, uploaded.text
    file = uploaded.json()
    assert file["object"] == "file" and file["purpose"] == "batch"
    assert file["bytes"] == len(content) and file["filename"] == "input.jsonl"
    assert file["expires_at"] - file["created_at"] == 7 * 24 * 3600
    assert (await client.get(f"/v1/files/{file['id']}")).json() == file
    assert (await client.get(f"/v1/files/{file['id']}/content")).content == content
    listed = (await client.get("/v1/files")).json()
    assert [f["id"] for f in listed["data"]] == [file["id"]] and listed["has_more"] is False
    assert (await client.delete(f"/v1/files/{file['id']}")).json() == {
        "id": file["id"], "object": "file", "deleted": True}
    missing = await client.get(f"/v1/files/{file['id']}")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "file_not_found"


async def test_file_upload_errors_are_clear_4xx(client: httpx.AsyncClient) -> None:
    bad_purpose = await _upload(client, _jsonl(_line("a")), purpose="fine-tune")
    assert bad_purpose.status_code == 400
    assert bad_purpose.json()["error"]["param"] == "purpose"
    bad_line = await _upload(client, _jsonl(_line("a"), "{oops"))
    assert bad_line.status_code == 400
    assert bad_line.json()["error"]["message"].startswith("Line 2: not valid JSON")
    not_multipart = await client.post("/v1/files", json={"purpose": "batch"})
    assert not_multipart.status_code == 400
    assert "multipart/form-data" in not_multipart.json()["error"]["message"]
    no_file = await client.post("/v1/files", data={"purpose": "batch"},
                                files={"other": ("x", b"1")})
    assert no_file.status_code == 400 and no_file.json()["error"]["param"] == "file"


async def test_a_file_over_the_limit_is_413_naming_the_setting() -> None:
    harness = make_harness(max_file_bytes=100)
    async with harness.client() as client:
        too_big = await _upload(client, _jsonl(_line("a"), _line("b")))
    assert too_big.status_code == 413
    assert "CARPOOL_MAX_FILE_BYTES" in too_big.json()["error"]["message"]


async def test_files_and_batches_of_another_key_read_as_missing() -> None:
    harness = make_harness(api_keys=[KEY_A, KEY_B])
    harness.register_model()
    async with harness.client(KEY_A) as a, harness.client(KEY_B) as b:
        file = (await _upload(a, _jsonl(_line("a")))).json()
        assert (await b.get(f"/v1/files/{file['id']}")).status_code == 404
        refused = await b.post("/v1/batches", json={"input_file_id": file["id"],
                                                    "endpoint": "/v1/completions",
                                                    "completion_window": "24h"})
        assert refused.status_code == 404 and refused.json()["error"]["param"] == "input_file_id"
        batch = (await a.post("/v1/batches", json={"input_file_id": file["id"],
                                                   "endpoint": "/v1/completions",
                                                   "completion_window": "24h"})).json()
        assert (await b.get(f"/v1/batches/{batch['id']}")).status_code == 404
        assert (await b.get("/v1/batches")).json()["data"] == []


# Batches.
async def _create(client: httpx.AsyncClient, content: bytes, endpoint: str = "/v1/completions",
                  **extra: object) -> dict:
    file = (await _upload(client, content)).json()
    created = await client.post("/v1/batches", json={"input_file_id": file["id"], "endpoint": endpoint,
                                                     "completion_window": "24h", **extra})
    assert created.status_code == 200, created.text
    return created.json()


async def test_create_batch_refuses_bad_requests(client: httpx.AsyncClient) -> None:
    file = (await _upload(client, _jsonl(_line("a")))).json()
    for body, param in [
        ({"input_file_id": file["id"], "endpoint": "/v1/embeddings", "completion_window": "24h"}, "endpoint"),
        ({"input_file_id": file["id"], "endpoint": "/v1/completions", "completion_window": "1h"},
         "completion_window"),
        ({"input_file_id": "file-nope", "endpoint": "/v1/completions", "completion_window": "24h"},
         "input_file_id"),
        ({"input_file_id": file["id"], "endpoint": "/v1/completions", "completion_window": "24h",
          "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ]:
        answer = await client.post("/v1/batches", json=body)
        assert answer.status_code in (400, 404), answer.text
        assert answer.json()["error"]["param"] == param


async def test_a_batch_runs_every_line_once_on_the_batch_tier(harness: Harness,
                                                               client: httpx.AsyncClient) -> None:
    content = _jsonl(_line("a"), _line("bad", {"model": MODEL, "prompt": "x", "max_tokens": 0}),
                     _line("b"), _line("stream", {"model": MODEL, "prompt": "x", "stream": True}))
    batch = await _create(client, content, metadata={"run": "1"})
    assert batch["status"] == "validating" and batch["metadata"] == {"run": "1"}
    assert batch["expires_at"] - batch["created_at"] == 24 * 3600
    runner = BatchRunner(harness.context)
    await runner.tick()  # validating -> in_progress
    status = (await client.get(f"/v1/batches/{batch['id']}")).json()
    assert status["status"] == "in_progress" and status["in_progress_at"] is not None
    assert status["request_counts"] == {"total": 4, "completed": 0, "failed": 0}
    await runner.tick()  # queues the lines; the two bad ones are answered at once
    batch_queue = RQKeys.queue(harness.keys.queue_name(MODEL, Priority.BATCH))
    assert harness.sync.llen(batch_queue) == 2
    status = (await client.get(f"/v1/batches/{batch['id']}")).json()
    assert status["request_counts"] == {"total": 4, "completed": 0, "failed": 2}
    await runner.tick()  # nothing new: nothing queued twice
    assert harness.sync.llen(batch_queue) == 2
    first = await harness.serve_next_job(["one", " two"])
    second = await harness.serve_next_job(["three"], reason=FinishReason.LENGTH)
    await runner.tick()
    done = (await client.get(f"/v1/batches/{batch['id']}")).json()
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": 4, "completed": 2, "failed": 2}
    assert done["finalizing_at"] is not None and done["completed_at"] is not None
    output = [json.loads(x) for x in
              (await client.get(f"/v1/files/{done['output_file_id']}/content")).text.splitlines()]
    assert [(x["custom_id"], x["response"]["status_code"], x["response"]["request_id"],
             x["error"]) for x in output] == [("a", 200, first, None), ("b", 200, second, None)]
    assert [x["response"]["body"]["choices"][0]["text"] for x in output] == ["one two", "three"]
    assert [x["response"]["body"]["choices"][0]["finish_reason"] for x in output] == ["stop", "length"]
    assert output[0]["response"]["body"]["id"] == f"cmpl-{first}"
    assert output[0]["response"]["body"]["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 0}}
    errors = [json.loads(x) for x in
              (await client.get(f"/v1/files/{done['error_file_id']}/content")).text.splitlines()]
    assert [(x["custom_id"], x["response"]["status_code"], x["response"]["body"]["error"]["param"])
            for x in errors] == [("bad", 400, "max_tokens"), ("stream", 400, "stream")]
    output_file = (await client.get(f"/v1/files/{done['output_file_id']}")).json()
    assert output_file["purpose"] == "batch_output"
    await runner.tick()  # a final batch is left alone: nothing is written twice
    assert (await client.get(f"/v1/batches/{batch['id']}")).json() == done


async def test_a_line_scoring_its_prompt_answers_the_prompt_alone(harness: Harness,
                                                                  client: httpx.AsyncClient) -> None:
    content = _jsonl(_line("score", {"model": MODEL, "prompt": "hello world", "echo": True,
                                     "max_tokens": 0}))
    batch = await _create(client, content)
    runner = BatchRunner(harness.context)
    await runner.tick()  # validating -> in_progress
    await runner.tick()  # queued
    await harness.serve_next_job(["unseen"], reason=FinishReason.LENGTH)
    await runner.tick()
    done = (await client.get(f"/v1/batches/{batch['id']}")).json()
    assert done["status"] == "completed", done
    (line,) = [json.loads(x) for x in
               (await client.get(f"/v1/files/{done['output_file_id']}/content")).text.splitlines()]
    choice = line["response"]["body"]["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("hello world", "length")


@pytest.mark.parametrize(("endpoint", "body", "prompt_ids"), [
    ("/v1/completions", {"prompt": "hello world the"}, [3, 4, 8]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}]},
     [1, 6, 3, 2, 1, 7]),  # the template's tokens: <|im_start|> user hello <|im_end|> ...
])
async def test_return_token_ids_lines_answer_the_ids_their_jobs_ran(
        harness: Harness, client: httpx.AsyncClient, endpoint: str, body: dict,
        prompt_ids: list[int]) -> None:
    content = _jsonl(_line("ids", {"model": MODEL, "max_tokens": 2, "return_token_ids": True,
                                   **body}, url=endpoint))
    batch = await _create(client, content, endpoint=endpoint)
    runner = BatchRunner(harness.context)
    await runner.tick()  # validating -> in_progress
    await runner.tick()  # queued
    job_id = await harness.take_job()
    assert _job_spec(harness, job_id)["prompt_token_ids"] == prompt_ids  # decided by the API
    harness.publish_entries(job_id, [(9, " a", None), (4, " world", None)])
    harness.publish_done(job_id, 2, FinishReason.LENGTH, len(prompt_ids), text=" a world")
    await runner.tick()
    done = (await client.get(f"/v1/batches/{batch['id']}")).json()
    assert done["status"] == "completed", done
    (line,) = [json.loads(x) for x in
               (await client.get(f"/v1/files/{done['output_file_id']}/content")).text.splitlines()]
    answer = line["response"]["body"]
    choice = answer["choices"][0]
    # vLLM's places: on a completion's choice; on a chat response (its choices share it).
    shown = choice["prompt_token_ids"] if endpoint == "/v1/completions" else answer["prompt_token_ids"]
    assert (shown, choice["token_ids"]) == (prompt_ids, [9, 4])


CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
WEATHER = {"type": "function", "name": "get_weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}


async def test_responses_lines_answer_stored_response_objects(harness: Harness,
                                                              client: httpx.AsyncClient) -> None:
    harness.register_model(context=4096)  # room for the tool's system prompt
    worker = asyncio.create_task(harness.serve_next_job(["Blue"]))
    earlier = (await client.post("/v1/responses", json={"input": "sky colour?"})).json()
    await worker
    url = "/v1/responses"
    content = _jsonl(
        _line("plain", {"model": MODEL, "input": "hello", "instructions": "be brief",
                        "max_output_tokens": 2, "metadata": {"n": "1"}}, url),
        _line("more", {"model": MODEL, "input": "and the sea?", "previous_response_id":
                       earlier["id"]}, url),
        _line("tool", {"model": MODEL, "input": "weather in Paris?", "tools": [WEATHER],
                       "tool_choice": "required", "store": False}, url),
        _line("bg", {"model": MODEL, "input": "x", "background": True}, url),
        _line("turn", {"model": MODEL, "input": "x", "conversation": "conv_1"}, url),
        _line("lost", {"model": MODEL, "input": "x", "previous_response_id": "resp_nope"}, url))
    batch = await _create(client, content, endpoint=url)
    runner = BatchRunner(harness.context)
    await runner.tick()  # validating -> in_progress
    await runner.tick()  # the three good lines queued on the batch tier; three answered at once
    assert harness.sync.llen(RQKeys.queue(harness.keys.queue_name(MODEL, Priority.BATCH))) == 3
    plain = await harness.serve_next_job(["Hi", " there"], reason=FinishReason.LENGTH)
    more = await harness.serve_next_job(["Green"])
    tool = await harness.serve_next_job([CALL])
    specs = [_job_spec(harness, job_id) for job_id in (plain, more, tool)]
    assert [spec["priority"] for spec in specs] == ["batch"] * 3
    assert specs[0]["messages"] == [{"role": "system", "content": "be brief"},
                                    {"role": "user", "content": "hello"}]
    assert specs[1]["messages"] == [{"role": "user", "content": "sky colour?"},
                                    {"role": "assistant", "content": "Blue"},
                                    {"role": "user", "content": "and the sea?"}]
    await runner.tick()
    done = (await client.get(f"/v1/batches/{batch['id']}")).json()
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": 6, "completed": 3, "failed": 3}
    output = {x["custom_id"]: x["response"] for x in [
        json.loads(line) for line in
        (await client.get(f"/v1/files/{done['output_file_id']}/content")).text.splitlines()]}
    assert {name: (answer["status_code"], answer["request_id"]) for name, answer in output.items()} \
        == {"plain": (200, plain), "more": (200, more), "tool": (200, tool)}
    body = output["plain"]["body"]
    assert (body["id"], body["object"], body["status"], body["incomplete_details"]) == (
        f"resp_{plain}", "response", "incomplete", {"reason": "max_output_tokens"})
    assert body["output"] == [{"id": f"msg_{plain}", "type": "message", "status": "incomplete",
                               "role": "assistant", "content": [
                                   {"type": "output_text", "text": "Hi there", "annotations": []}]}]
    assert (body["instructions"], body["metadata"], body["usage"]["output_tokens"]) == (
        "be brief", {"n": "1"}, 2)
    assert output["more"]["body"]["previous_response_id"] == earlier["id"]
    [call] = output["tool"]["body"]["output"]
    assert (call["type"], call["name"], call["arguments"]) == (
        "function_call", "get_weather", '{"city": "Paris"}')
    # Stored as the route stores them (store: false aside), and continued the same way.
    stored = await client.get(f"/v1/responses/resp_{plain}")
    assert stored.status_code == 200 and stored.json() == body
    assert (await client.get(f"/v1/responses/resp_{tool}")).status_code == 404
    worker = asyncio.create_task(harness.serve_next_job(["ok"]))
    await client.post("/v1/responses", json={"input": "go on", "previous_response_id": f"resp_{more}"})
    assert [m["content"] for m in _job_spec(harness, await worker)["messages"]] == [
        "sky colour?", "Blue", "and the sea?", "Green", "go on"]
    errors = {x["custom_id"]: x["response"] for x in [
        json.loads(line) for line in
        (await client.get(f"/v1/files/{done['error_file_id']}/content")).text.splitlines()]}
    assert {name: (answer["status_code"], answer["body"]["error"]["param"])
            for name, answer in errors.items()} == {"bg": (400, "background"),
                                                    "turn": (400, "conversation"),
                                                    "lost": (404, "previous_response_id")}


def _job_spec(harness: Harness, job_id: str) -> dict:
    from rq.job import Job
    from rq.serializers import JSONSerializer

    spec: dict = Job.fetch(job_id, connection=harness.context.sync, serializer=JSONSerializer).args[0]
    return spec


async def test_a_runner_reads_the_answered_lines_back_only_after_another_answered_some(
        harness: Harness, client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    batch = await _create(client, _jsonl(_line("a"), _line("b"), _line("c")))
    store = harness.context.batches
    reads: list[str] = []
    read_answered = store.answered

    async def counted(batch_id: str) -> set[int]:
        reads.append(batch_id)
        return await read_answered(batch_id)

    monkeypatch.setattr(store, "answered", counted)
    first, second = BatchRunner(harness.context), BatchRunner(harness.context)
    await first.tick()  # validating -> in_progress
    await first.tick()  # queues the three lines
    await harness.serve_next_job(["x"])
    await first.tick()  # answers line a itself
    await first.tick()
    assert reads == []  # the counts add up to its own answers: nothing to read back
    await harness.serve_next_job(["y"])
    await second.tick()  # another process: it knows no answer, the counts say one
    assert reads == [batch["id"]]
    await first.tick()  # line b was answered elsewhere: read back once
    await first.tick()
    assert reads == [batch["id"]] * 2
    await harness.serve_next_job(["z"])
    await first.tick()
    done = (await client.get(f"/v1/batches/{batch['id']}")).json()
    assert done["status"] == "completed" and reads == [batch["id"]] * 2
    assert done["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    output = [json.loads(x) for x in
              (await client.get(f"/v1/files/{done['output_file_id']}/content")).text.splitlines()]
    assert [(x["custom_id"], x["response"]["body"]["choices"][0]["text"]) for x in output] == [
        ("a", "x"), ("b", "y"), ("c", "z")]


async def test_a_failed_job_answers_its_line_in_the_error_file(harness: Harness,
                                                                client: httpx.AsyncClient) -> None:
    batch = await _create(client, _jsonl(_line("ok"), _line("boom")))
    runner = BatchRunner(harness.context)
    await runner.tick()
    await runner.tick()
    await harness.serve_next_job(["fine"])
    failing = await harness.take_job()
    harness.publish_done(failing, 0, FinishReason.ERROR, error="the model crashed")
    await runner.tick()
    done = (await client.get(f"/v1/batches/{batch['id']}")).json()
    assert done["status"] == "completed"
    assert done["request_counts"] == {"total": 2, "completed": 1, "failed": 1}
    (error,) = [json.loads(x) for x in
                (await client.get(f"/v1/files/{done['error_file_id']}/content")).text.splitlines()]
    assert error["custom_id"] == "boom" and error["response"]["status_code"] == 500
    assert error["response"]["body"]["error"]["message"] == "The job failed: the model crashed"


async def test_cancel_answers_finished_lines_and_cancels_the_rest(harness: Harness,
                                                                   client: httpx.AsyncClient) -> None:
    batch = await _create(client, _jsonl(_line("a"), _line("b"), _line("c")))
    runner = BatchRunner(harness.context)
    await runner.tick()
    await runner.tick()
    finished = await harness.serve_next_job(["done"])
    canceled = await client.post(f"/v1/batches/{batch['id']}/cancel")
    assert canceled.json()["status"] == "cancelling"
    assert canceled.json()["cancelling_at"] is not None
    await runner.tick()
    done = (await client.get(f"/v1/batches/{batch['id']}")).json()
    assert done["status"] == "cancelled" and done["cancelled_at"] is not None
    assert done["request_counts"] == {"total": 3, "completed": 1, "failed": 2}
    (output,) = [json.loads(x) for x in
                 (await client.get(f"/v1/files/{done['output_file_id']}/content")).text.splitlines()]
    assert output["response"]["request_id"] == finished
    errors = [json.loads(x) for x in
              (await client.get(f"/v1/files/{done['error_file_id']}/content")).text.splitlines()]
    assert [(x["custom_id"], x["error"]["code"], x["response"]) for x in errors] == [
        ("b", "batch_cancelled", None), ("c", "batch_cancelled", None)]
    lines = await harness.context.batches.lines(batch["id"])
    for index in (1, 2):
        assert harness.state(lines[index].job_ids[0]).status is JobStatus.CANCELED
    again = await client.post(f"/v1/batches/{batch['id']}/cancel")
    assert again.status_code == 200 and again.json()["status"] == "cancelled"


async def test_a_completed_batch_cannot_be_cancelled_and_mismatched_urls_fail_it(
        harness: Harness, client: httpx.AsyncClient) -> None:
    batch = await _create(client, _jsonl(_line("a"), _line("b", url="/v1/chat/completions")))
    runner = BatchRunner(harness.context)
    await runner.tick()
    failed = (await client.get(f"/v1/batches/{batch['id']}")).json()
    assert failed["status"] == "failed" and failed["failed_at"] is not None
    assert failed["errors"]["data"][0]["line"] == 2
    assert failed["errors"]["data"][0]["code"] == "invalid_url"
    refused = await client.post(f"/v1/batches/{batch['id']}/cancel")
    assert refused.status_code == 409 and "failed" in refused.json()["error"]["message"]


async def test_batches_list_newest_first_with_after_and_limit(client: httpx.AsyncClient) -> None:
    ids = [(await _create(client, _jsonl(_line("a"))))["id"] for _ in range(3)]
    page = (await client.get("/v1/batches", params={"limit": 2})).json()
    assert [b["id"] for b in page["data"]] == ids[::-1][:2] and page["has_more"] is True
    rest = (await client.get("/v1/batches", params={"limit": 2, "after": page["last_id"]})).json()
    assert [b["id"] for b in rest["data"]] == ids[:1] and rest["has_more"] is False


async def test_an_expired_batch_keeps_what_finished_and_answers_the_rest() -> None:
    harness = make_harness(batch_submit_lines=2)
    harness.register_model()
    async with harness.client() as client:
        batch = await _create(client, _jsonl(_line("a"), _line("b"), _line("c")))
        runner = BatchRunner(harness.context)
        await runner.tick()
        await runner.tick()  # queues a and b only (two lines a tick)
        finished = await harness.serve_next_job(["ok"])
        harness.sync.hset(harness.keys.batch(batch["id"]), "expires_at", 1)  # its window passed
        await runner.tick()
        done = (await client.get(f"/v1/batches/{batch['id']}")).json()
        assert done["status"] == "expired" and done["expired_at"] is not None
        assert done["request_counts"] == {"total": 3, "completed": 1, "failed": 2}
        (output,) = [json.loads(x) for x in (await client.get(
            f"/v1/files/{done['output_file_id']}/content")).text.splitlines()]
        assert output["response"]["request_id"] == finished
        errors = [json.loads(x) for x in (await client.get(
            f"/v1/files/{done['error_file_id']}/content")).text.splitlines()]
        assert [(x["custom_id"], x["error"]["code"]) for x in errors] == [
            ("b", "batch_expired"), ("c", "batch_expired")]
        lines = await harness.context.batches.lines(batch["id"])
        assert harness.state(lines[1].job_ids[0]).status is JobStatus.CANCELED


async def test_a_batch_cancelled_while_validating_still_answers_every_line(
        harness: Harness, client: httpx.AsyncClient) -> None:
    batch = await _create(client, _jsonl(_line("a"), _line("b")))
    assert (await client.post(f"/v1/batches/{batch['id']}/cancel")).json()["status"] == "cancelling"
    await BatchRunner(harness.context).tick()
    done = (await client.get(f"/v1/batches/{batch['id']}")).json()
    assert done["status"] == "cancelled"
    assert done["request_counts"] == {"total": 2, "completed": 0, "failed": 2}
    errors = [json.loads(x) for x in (await client.get(
        f"/v1/files/{done['error_file_id']}/content")).text.splitlines()]
    assert [(x["custom_id"], x["error"]["code"]) for x in errors] == [
        ("a", "batch_cancelled"), ("b", "batch_cancelled")]


async def test_lines_wait_in_the_file_while_the_batch_queue_is_full_and_polls_take_turns() -> None:
    harness = make_harness(max_batch_queue_depth=1, batch_poll_lines=1)
    harness.register_model()
    batch_queue = RQKeys.queue(harness.keys.queue_name(MODEL, Priority.BATCH))
    async with harness.client() as client:
        batch = await _create(client, _jsonl(_line("a"), _line("b"), _line("c")))
        runner = BatchRunner(harness.context)
        await runner.tick()
        served = []
        for _ in range(3):
            await runner.tick()
            assert harness.sync.llen(batch_queue) == 1  # one at a time: the rest wait their turn
            served.append(await harness.serve_next_job(["x"]))
        for _ in range(3):
            await runner.tick()
        done = (await client.get(f"/v1/batches/{batch['id']}")).json()
        output = [json.loads(x) for x in (await client.get(
            f"/v1/files/{done['output_file_id']}/content")).text.splitlines()]
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    assert [(x["custom_id"], x["response"]["request_id"]) for x in output] == list(
        zip("abc", served))


async def test_an_end_that_lost_a_race_to_a_cancel_leaves_the_batch_open_for_it(
        harness: Harness, client: httpx.AsyncClient) -> None:
    batch = await _create(client, _jsonl(_line("a")))
    runner = BatchRunner(harness.context)
    await runner.tick()
    stale = await harness.context.batches.get(batch["id"])  # in_progress, as a runner read it
    await client.post(f"/v1/batches/{batch['id']}/cancel")  # ...then a cancel lands
    assert not await runner.end_batch(stale, BatchStatus.EXPIRED, (BatchStatus.IN_PROGRESS,))
    assert batch["id"] in await harness.context.batches.open_ids()
    await runner.tick()
    assert (await client.get(f"/v1/batches/{batch['id']}")).json()["status"] == "cancelled"
    assert batch["id"] not in await harness.context.batches.open_ids()


async def test_a_cancelled_batch_stays_cancelling_until_its_running_jobs_end(
        harness: Harness, client: httpx.AsyncClient) -> None:
    batch = await _create(client, _jsonl(_line("a"), _line("b")))
    runner = BatchRunner(harness.context)
    await runner.tick()
    await runner.tick()
    running = await harness.take_job()
    harness.publish_tokens(running, ["so"])  # a worker is generating it
    await client.post(f"/v1/batches/{batch['id']}/cancel")
    await runner.tick()
    status = (await client.get(f"/v1/batches/{batch['id']}")).json()
    assert status["status"] == "cancelling"
    assert status["request_counts"] == {"total": 2, "completed": 0, "failed": 1}  # b: never ran
    assert harness.sync.sismember(harness.keys.canceled(), running)  # the worker is told
    harness.publish_done(running, 1, FinishReason.CANCELED)  # ...and stops at its next step
    await runner.tick()
    done = (await client.get(f"/v1/batches/{batch['id']}")).json()
    assert done["status"] == "cancelled"
    errors = [json.loads(x) for x in (await client.get(
        f"/v1/files/{done['error_file_id']}/content")).text.splitlines()]
    assert [(x["custom_id"], x["error"]["code"]) for x in errors] == [
        ("a", "batch_cancelled"), ("b", "batch_cancelled")]


async def test_a_batch_webhook_gets_one_event_with_its_final_status() -> None:
    h = make_harness(webhook_allowed_hosts=["127.0.0.1"])
    h.register_model()
    async with h.client() as client:
        refused = await client.post("/v1/batches", json={
            "input_file_id": (await _upload(client, _jsonl(_line("a")))).json()["id"],
            "endpoint": "/v1/completions", "completion_window": "24h",
            "webhook_url": "http://10.1.2.3/hook"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "webhook_url"
        assert "CARPOOL_WEBHOOK_ALLOWED_HOSTS" in refused.json()["error"]["message"]
        batch = await _create(client, _jsonl(_line("a"), _line("b")),
                              webhook_url="http://127.0.0.1:9/hook")
        runner = BatchRunner(h.context)
        await runner.tick()
        await runner.tick()
        await h.serve_next_job(["one"])
        await h.serve_next_job(["two"])
        await runner.tick()
        await runner.tick()  # a final batch: no second event
        done = (await client.get(f"/v1/batches/{batch['id']}")).json()
    assert done["status"] == "completed"
    batch_events = [fields for _, fields in h.sync.xrange(h.keys.webhook_events())
                    if fields["type"].startswith("batch.")]
    assert len(batch_events) == 1
    event = WebhookEvent.from_entry("1-0", batch_events[0])
    assert (event.type, event.url, event.owner) == ("batch.completed", "http://127.0.0.1:9/hook", "")
    data = json.loads(event.data)
    assert (data["id"], data["object"], data["status"]) == (batch["id"], "batch", "completed")
    assert data["output_file_id"] == done["output_file_id"]
    assert data["request_counts"]["total"] == 2


async def test_a_cancelled_batch_sends_batch_cancelled() -> None:
    h = make_harness(webhook_allowed_hosts=["127.0.0.1"])
    h.register_model()
    async with h.client() as client:
        batch = await _create(client, _jsonl(_line("a")), webhook_url="http://127.0.0.1:9/hook")
        runner = BatchRunner(h.context)
        await runner.tick()
        await runner.tick()
        assert (await client.post(f"/v1/batches/{batch['id']}/cancel")).status_code == 200
        for _ in range(3):
            await runner.tick()
        assert (await client.get(f"/v1/batches/{batch['id']}")).json()["status"] == "cancelled"
    types = [fields["type"] for _, fields in h.sync.xrange(h.keys.webhook_events())
             if fields["type"].startswith("batch.")]
    assert types == ["batch.cancelled"]


async def test_the_runner_stops_when_a_cancel_comes_out_as_a_redis_error(harness: Harness) -> None:
    # A client library may turn a cancel that reaches a failing call into that call's error; the
    # runner must end anyway, or the API's shutdown waits on it for good.
    runner = BatchRunner(harness.context)
    ticking = asyncio.Event()

    async def tick() -> None:
        ticking.set()
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            raise redis.exceptions.ConnectionError("Error 111 connecting") from None

    runner.tick = tick  # type: ignore[method-assign]
    task = asyncio.create_task(runner.run_forever())
    await ticking.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, timeout=2)
