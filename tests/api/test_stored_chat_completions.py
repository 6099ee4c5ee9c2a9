"""Stored chat completions (`store: true`) through the official openai client: a completion made
whole or streamed is kept as its client got it, with its metadata and the messages it was asked
with; listed (oldest first by default, filtered by model and metadata, a page at a time),
retrieved, given new metadata and deleted by the key that made it only; one made without store
is not kept; a failed one is not kept; a Batch API line with store is kept as its answer; bad
requests are 400s naming the field. A test plays the worker (api_support.Harness)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest
from api_support import KEY_A, KEY_B, MODEL, Harness

from api.batch_runner import BatchRunner
from protocol import FinishReason

pytestmark = pytest.mark.anyio


def _openai(harness: Harness, key: str = "none") -> openai.AsyncOpenAI:
    transport = httpx.ASGITransport(app=harness.app, raise_app_exceptions=False)
    return openai.AsyncOpenAI(base_url="http://carpool.test/v1", api_key=key, max_retries=0,
                              http_client=httpx.AsyncClient(transport=transport))


async def _stored_chat(harness: Harness, client: openai.AsyncOpenAI, texts: list[str],
                       **request: Any) -> tuple[str, str]:
    """A chat completion made with store: true; (its id, its job id)."""
    worker = asyncio.create_task(harness.serve_next_job(texts, FinishReason.STOP, 5))
    answer = await client.chat.completions.create(
        model=MODEL, messages=request.pop("messages", [{"role": "user", "content": "Hi"}]),
        store=True, **request)
    return answer.id, await worker


async def test_a_whole_completion_is_kept_with_its_metadata_and_messages(harness: Harness) -> None:
    client = _openai(harness)
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "What is "},
                                             {"type": "text", "text": "2+2?"}]}]
    worker = asyncio.create_task(harness.serve_next_job(["It is", " 4."], FinishReason.STOP, 5))
    answer = await client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                                  store=True, metadata={"topic": "math"})
    job_id = await worker
    assert answer.id == f"chatcmpl-{job_id}"

    kept = await client.chat.completions.retrieve(answer.id)
    assert kept.model_dump(exclude={"metadata"}) == answer.model_dump(exclude={"metadata"})
    assert kept.metadata == {"topic": "math"}
    assert kept.choices[0].message.content == "It is 4."

    listed = [(m.id, m.role, m.content, m.content_parts)
              async for m in client.chat.completions.messages.list(answer.id)]
    parts = [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+2?"}]
    assert [(i, r, c, p and [part.model_dump(exclude_none=True) for part in p])
            for i, r, c, p in listed] == [
        (f"{answer.id}-0", "system", "Be brief.", None),
        (f"{answer.id}-1", "user", "What is 2+2?", parts)]
    newest = await client.chat.completions.messages.list(answer.id, order="desc", limit=1)
    assert ([m.id for m in newest.data], newest.has_more) == ([f"{answer.id}-1"], True)


async def test_a_streamed_completion_is_kept_as_its_chunks_said(harness: Harness) -> None:
    client = _openai(harness)
    worker = asyncio.create_task(harness.serve_next_job(["Red", " is", " a color."],
                                                        FinishReason.LENGTH, 5))
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a color."}], max_tokens=3,
        store=True, stream=True, stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    job_id = await worker
    # The stream's [DONE] came after the completion was kept: retrieving it now finds it.
    kept = await client.chat.completions.retrieve(f"chatcmpl-{job_id}")
    assert kept.choices[0].message.content == "".join(
        chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert kept.choices[0].message.content == "Red is a color."
    assert kept.choices[0].finish_reason == "length" == chunks[-2].choices[0].finish_reason
    assert kept.usage == chunks[-1].usage
    assert (kept.created, kept.model) == (chunks[0].created, MODEL)


async def test_only_stored_and_answered_completions_are_kept(harness: Harness) -> None:
    client = _openai(harness)
    worker = asyncio.create_task(harness.serve_next_job(["x"]))
    plain = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    await worker
    worker = asyncio.create_task(harness.serve_next_job(["x"], FinishReason.ERROR))
    with pytest.raises(openai.InternalServerError):
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], store=True)
    failed_job = await worker
    for completion_id in (plain.id, f"chatcmpl-{failed_job}"):
        with pytest.raises(openai.NotFoundError, match="only when made with store: true"):
            await client.chat.completions.retrieve(completion_id)
    assert [c.id async for c in client.chat.completions.list()] == []


async def test_listing_orders_filters_and_pages(harness: Harness) -> None:
    client = _openai(harness)
    ids = [(await _stored_chat(harness, client, [str(n)], metadata=metadata))[0]
           for n, metadata in enumerate([{"team": "a", "env": "prod"}, {"team": "b"},
                                         {"team": "a"}, None])]
    assert [c.id async for c in client.chat.completions.list()] == ids  # oldest first
    page = await client.chat.completions.list(order="desc", limit=3)
    assert ([c.id for c in page.data], page.has_more) == (ids[::-1][:3], True)
    rest = await client.chat.completions.list(order="desc", limit=3, after=page.data[-1].id)
    assert ([c.id for c in rest.data], rest.has_more) == ([ids[0]], False)
    assert [c.id async for c in client.chat.completions.list(metadata={"team": "a"})] == [
        ids[0], ids[2]]
    assert [c.id async for c in client.chat.completions.list(
        metadata={"team": "a", "env": "prod"})] == [ids[0]]
    assert [c.id async for c in client.chat.completions.list(model=MODEL, limit=1)] == ids
    assert [c.id async for c in client.chat.completions.list(model="another")] == []
    listed = (await client.chat.completions.list(limit=1)).data[0]
    assert (listed.choices[0].message.content, listed.metadata) == (
        "0", {"team": "a", "env": "prod"})


async def test_metadata_is_replaced_and_a_deleted_completion_is_gone(harness: Harness) -> None:
    client = _openai(harness)
    completion_id, _ = await _stored_chat(harness, client, ["ok"], metadata={"topic": "math"})
    updated = await client.chat.completions.update(completion_id, metadata={"topic": "arith"})
    assert updated.metadata == {"topic": "arith"}
    assert (await client.chat.completions.retrieve(completion_id)).metadata == {"topic": "arith"}
    assert [c.id async for c in client.chat.completions.list(metadata={"topic": "math"})] == []
    cleared = await client.chat.completions.update(completion_id, metadata=None)
    assert cleared.metadata == {}
    record_ttl = harness.sync.ttl(harness.keys.chat_completion(completion_id))
    assert 0 < record_ttl <= harness.context.settings.result_ttl_s  # the update kept its TTL

    deleted = await client.chat.completions.delete(completion_id)
    assert (deleted.id, deleted.deleted, deleted.object) == (completion_id, True,
                                                            "chat.completion.deleted")
    for call in (client.chat.completions.retrieve(completion_id),
                 client.chat.completions.messages.list(completion_id),
                 client.chat.completions.update(completion_id, metadata={"a": "b"}),
                 client.chat.completions.delete(completion_id)):
        with pytest.raises(openai.NotFoundError):
            await call
    assert [c.id async for c in client.chat.completions.list()] == []
    assert not harness.sync.exists(harness.keys.chat_completion(completion_id))


async def test_a_stored_completion_is_its_keys_own(keyed_harness: Harness) -> None:
    owner = _openai(keyed_harness, KEY_A)
    completion_id, _ = await _stored_chat(keyed_harness, owner, ["mine"])
    theirs = _openai(keyed_harness, KEY_B)
    for call in (theirs.chat.completions.retrieve(completion_id),
                 theirs.chat.completions.messages.list(completion_id),
                 theirs.chat.completions.update(completion_id, metadata={"a": "b"}),
                 theirs.chat.completions.delete(completion_id)):
        with pytest.raises(openai.NotFoundError):
            await call
    assert [c.id async for c in theirs.chat.completions.list()] == []
    assert [c.id async for c in owner.chat.completions.list()] == [completion_id]
    assert (await owner.chat.completions.retrieve(completion_id)).metadata == {}


async def test_a_batch_line_with_store_is_kept_as_its_answer(harness: Harness) -> None:
    client = _openai(harness)
    lines = [{"custom_id": name, "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **extra}}
             for name, extra in (("kept", {"store": True, "metadata": {"from": "batch"}}),
                                 ("not", {}))]
    upload = await client.files.create(
        file=("in.jsonl", "\n".join(json.dumps(line) for line in lines).encode()),
        purpose="batch")
    batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
    runner = BatchRunner(harness.context)
    await runner.tick()  # validating -> in_progress
    await runner.tick()  # queues the lines
    kept_job = await harness.serve_next_job(["From", " a batch"])
    await harness.serve_next_job(["plain"])
    await runner.tick()
    done = await client.batches.retrieve(batch.id)
    assert done.status == "completed" and done.output_file_id is not None
    output = [json.loads(line) for line in
              (await client.files.content(done.output_file_id)).text.splitlines()]
    answers = {line["custom_id"]: line["response"]["body"] for line in output}
    async with harness.client() as http:
        kept = (await http.get(f"/v1/chat/completions/chatcmpl-{kept_job}")).json()
    assert kept == {**answers["kept"], "metadata": {"from": "batch"}}
    assert [c.id async for c in client.chat.completions.list()] == [kept["id"]]


@pytest.mark.parametrize(("body", "param"), [
    ({"store": "yes"}, "store"),
    ({"store": True, "metadata": {f"k{n}": "v" for n in range(17)}}, "metadata"),
    ({"store": True, "metadata": {"k": "v" * 513}}, "metadata"),
])
async def test_bad_store_requests_are_400s_naming_the_field(client: httpx.AsyncClient,
                                                            body: dict[str, Any],
                                                            param: str) -> None:
    answer = await client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **body})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param


@pytest.mark.parametrize(("path", "params", "param"), [
    ("/v1/chat/completions", {"order": "newest"}, "query.order"),
    ("/v1/chat/completions", {"limit": 0}, "query.limit"),
    ("/v1/chat/completions", {"limit": 101}, "query.limit"),
])
async def test_bad_listings_are_400s_naming_the_parameter(client: httpx.AsyncClient, path: str,
                                                          params: dict[str, Any],
                                                          param: str) -> None:
    answer = await client.get(path, params=params)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param


async def test_bad_updates_and_message_pages_are_400s(harness: Harness,
                                                       client: httpx.AsyncClient) -> None:
    completion_id, _ = await _stored_chat(harness, _openai(harness), ["ok"])
    for body, param in (({}, "metadata"), ({"metadata": {"k": 1}}, "metadata.k"),
                        ({"metadata": {}, "store": False}, "store")):
        answer = await client.post(f"/v1/chat/completions/{completion_id}", json=body)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == param
    answer = await client.get(f"/v1/chat/completions/{completion_id}/messages",
                              params={"after": "nope"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "after"


async def test_a_filtered_listing_scans_past_what_it_turns_down(harness: Harness) -> None:
    store = harness.context.chat_completions
    for n in range(230):  # 3 matches far apart, past the first page and the first scan batch
        metadata = {"pick": "yes"} if n in (5, 120, 229) else {"pick": "no"}
        completion = {"id": f"chatcmpl-{n:03d}", "object": "chat.completion", "model": MODEL}
        await store.keep("", completion, metadata, [{"role": "user", "content": "Hi"}])
    harness.sync.delete(harness.keys.chat_completion("chatcmpl-120"))  # expired meanwhile
    client = _openai(harness)
    page = await client.chat.completions.list(metadata={"pick": "yes"}, limit=1)
    assert ([c.id for c in page.data], page.has_more) == (["chatcmpl-005"], True)
    rest = await client.chat.completions.list(metadata={"pick": "yes"}, after="chatcmpl-005")
    assert ([c.id for c in rest.data], rest.has_more) == (["chatcmpl-229"], False)
    index = harness.keys.chat_completions_by_owner("")  # the open API's owner
    assert harness.sync.zscore(index, "chatcmpl-120") is None  # the listing dropped it
    assert harness.sync.zcard(index) == 229
    newest = await client.chat.completions.list(order="desc", limit=2)
    assert [c.id for c in newest.data] == ["chatcmpl-229", "chatcmpl-228"]
