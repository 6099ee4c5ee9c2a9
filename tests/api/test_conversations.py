"""The Conversations API: a conversation and its items through the official openai client
(create, retrieve, update, delete; items added, listed a page at a time, retrieved, deleted), each
key's own; and responses taking turns in one: its items come before their input, and each
completed response adds its input and output, once (streamed, whole and in the background);
failed and cancelled ones add nothing; bad requests are 400s naming the field. A test plays the
worker (api_support.Harness)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest
from api_support import KEY_A, KEY_B, MODEL, Harness
from rq.job import Job
from rq.serializers import JSONSerializer

from protocol import FinishReason

pytestmark = pytest.mark.anyio


def _openai(harness: Harness, key: str = "none") -> openai.AsyncOpenAI:
    transport = httpx.ASGITransport(app=harness.app, raise_app_exceptions=False)
    return openai.AsyncOpenAI(base_url="http://carpool.test/v1", api_key=key, max_retries=0,
                              http_client=httpx.AsyncClient(transport=transport))


def _messages(harness: Harness, job_id: str) -> list[dict[str, Any]]:
    spec = Job.fetch(job_id, connection=harness.context.sync, serializer=JSONSerializer).args[0]
    messages: list[dict[str, Any]] = spec["messages"]
    return messages


def _user(item_id: str, text: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "user", "status": "completed",
            "content": [{"type": "input_text", "text": text}]}


def _assistant(job_id: str, text: str) -> dict[str, Any]:
    return {"id": f"msg_{job_id}", "type": "message", "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


async def _items(client: httpx.AsyncClient, conversation_id: str) -> list[dict[str, Any]]:
    answer = await client.get(f"/v1/conversations/{conversation_id}/items",
                              params={"order": "asc", "limit": 100})
    assert answer.status_code == 200, answer.text
    items: list[dict[str, Any]] = answer.json()["data"]
    return items


async def test_the_official_client_manages_a_conversation_and_its_items(harness: Harness) -> None:
    client = _openai(harness)
    created = await client.conversations.create(
        items=[{"type": "message", "role": "user", "content": "Hi"},
               {"type": "message", "role": "assistant",
                "content": [{"type": "output_text", "text": "Hello!"}]}],
        metadata={"topic": "greetings"})
    assert created.id.startswith("conv_") and created.object == "conversation"
    assert created.metadata == {"topic": "greetings"}
    assert await client.conversations.retrieve(created.id) == created
    updated = await client.conversations.update(created.id, metadata={"topic": "weather"})
    assert (updated.id, updated.created_at, updated.metadata) == (
        created.id, created.created_at, {"topic": "weather"})

    page = await client.conversations.items.list(created.id)  # newest first, OpenAI's default
    assert [(item.role, item.content[0].text) for item in page.data] == [  # type: ignore[union-attr]
        ("assistant", "Hello!"), ("user", "Hi")]
    assert [part.type for item in page.data for part in item.content] == [  # type: ignore[union-attr]
        "output_text", "input_text"]
    added = await client.conversations.items.create(created.id, items=[
        {"type": "message", "role": "user", "content": "What's the weather?"},
        {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"}])
    assert [item.type for item in added.data] == ["message", "function_call",
                                                 "function_call_output"]
    assert added.has_more is False and added.first_id == added.data[0].id
    listed = [item async for item in client.conversations.items.list(created.id, order="asc",
                                                                       limit=2)]  # pages of 2
    assert [item.id for item in listed] == [*[item.id for item in reversed(page.data)],
                                            *[item.id for item in added.data]]
    call = await client.conversations.items.retrieve(added.data[1].id, conversation_id=created.id)
    assert (call.type, call.call_id, call.name, call.arguments) == (  # type: ignore[union-attr]
        "function_call", "call_1", "weather", "{}")
    after_delete = await client.conversations.items.delete(added.data[1].id,
                                                           conversation_id=created.id)
    assert after_delete.id == created.id
    left = [item async for item in client.conversations.items.list(created.id, order="asc")]
    assert [item.id for item in left] == [listed[i].id for i in (0, 1, 2, 4)]
    with pytest.raises(openai.NotFoundError, match="has no item with id"):
        await client.conversations.items.retrieve(added.data[1].id, conversation_id=created.id)

    deleted = await client.conversations.delete(created.id)
    assert (deleted.id, deleted.deleted, deleted.object) == (created.id, True,
                                                            "conversation.deleted")
    with pytest.raises(openai.NotFoundError):
        await client.conversations.retrieve(created.id)
    assert not harness.context.sync.exists(harness.keys.conversation_items(created.id))


async def test_a_conversation_is_its_keys_own(keyed_harness: Harness) -> None:
    owner = _openai(keyed_harness, KEY_A)
    mine = await owner.conversations.create()
    # A background turn of the owner's, ended and not read yet.
    await owner.responses.create(model=MODEL, input="hello", conversation=mine.id, background=True)
    await keyed_harness.serve_next_job(["Hi"])
    theirs = _openai(keyed_harness, KEY_B)
    for call in (theirs.conversations.retrieve(mine.id), theirs.conversations.delete(mine.id),
                 theirs.conversations.items.list(mine.id),
                 theirs.responses.create(model=MODEL, input="hi", conversation=mine.id),
                 theirs.responses.input_tokens.count(model=MODEL, input="hi",
                                                     conversation=mine.id)):
        with pytest.raises(openai.NotFoundError):
            await call
    assert (await owner.conversations.retrieve(mine.id)).id == mine.id
    # Another key's attempts left the owner's pending turn alone; the owner's listing settles it.
    pending = keyed_harness.keys.conversation_pending(mine.id)
    assert keyed_harness.sync.llen(pending) == 1
    items = [item async for item in owner.conversations.items.list(mine.id, order="asc")]
    assert [item.content[0].text for item in items] == ["hello", "Hi"]  # type: ignore[union-attr]
    assert keyed_harness.sync.llen(pending) == 0


async def test_responses_take_turns_in_a_conversation(harness: Harness,
                                                      client: httpx.AsyncClient) -> None:
    created = (await client.post("/v1/conversations", json={
        "items": [{"type": "message", "role": "user", "content": "My name is Ada."}]})).json()
    first_item = (await _items(client, created["id"]))[0]

    worker = asyncio.create_task(harness.serve_next_job(["Hello", " Ada"]))
    answer = await client.post("/v1/responses", json={
        "input": "Greet me", "conversation": created["id"], "instructions": "be brief"})
    first_job = await worker
    assert answer.status_code == 200, answer.text
    first = answer.json()
    assert first["conversation"] == {"id": created["id"]}
    assert _messages(harness, first_job) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "My name is Ada."}, {"role": "user", "content": "Greet me"}]
    items = await _items(client, created["id"])
    assert items == [first_item, _user(items[1]["id"], "Greet me"),
                     _assistant(first_job, "Hello Ada")]
    # The response's own input items are the ones the conversation got.
    input_items = (await client.get(f"/v1/responses/{first['id']}/input_items")).json()["data"]
    assert input_items == [items[1]]

    # The second turn, streamed, reads the first (not its instructions) and adds itself.
    worker = asyncio.create_task(harness.serve_next_job(["Bye"]))
    async with client.stream("POST", "/v1/responses", json={
            "input": "Bye now", "conversation": {"id": created["id"]}, "stream": True}) as stream:
        events = [json.loads(line[6:]) async for line in stream.aiter_lines()
                  if line.startswith("data: ")]
    second_job = await worker
    assert events[0]["response"]["conversation"] == {"id": created["id"]}
    assert events[-1]["type"] == "response.completed"
    assert _messages(harness, second_job) == [
        {"role": "user", "content": "My name is Ada."}, {"role": "user", "content": "Greet me"},
        {"role": "assistant", "content": "Hello Ada"}, {"role": "user", "content": "Bye now"}]
    items = await _items(client, created["id"])
    assert items[3:] == [_user(items[3]["id"], "Bye now"), _assistant(second_job, "Bye")]
    assert len(items) == 5


async def test_a_background_turn_joins_once_settled(harness: Harness,
                                                   client: httpx.AsyncClient) -> None:
    conversation = (await client.post("/v1/conversations", json={})).json()["id"]
    created = (await client.post("/v1/responses", json={
        "input": "hello", "conversation": conversation, "background": True})).json()
    assert await _items(client, conversation) == []  # nothing until it ends
    job_id = await harness.serve_next_job(["Hi"])
    # Listing the items settles it: its turn is there, though nobody read the response.
    items = await _items(client, conversation)
    assert items == [_user(items[0]["id"], "hello"), _assistant(job_id, "Hi")]
    assert harness.sync.llen(harness.keys.conversation_pending(conversation)) == 0
    for _ in range(2):  # read twice (and each read's settle finds it added)
        assert (await client.get(f"/v1/responses/{created['id']}")).json()["status"] == "completed"
    # A settle racing the first (the stored pending record read before it was replaced) adds
    # nothing more either.
    stored = await harness.context.responses.get(created["id"], "")
    assert await harness.context.conversations.add_once(conversation, created["id"],
                                                        stored.response["output"]) is False
    items = await _items(client, conversation)
    assert items == [_user(items[0]["id"], "hello"), _assistant(job_id, "Hi")]


async def test_the_next_turn_settles_background_turns_nobody_read(
        harness: Harness, client: httpx.AsyncClient) -> None:
    conversation = (await client.post("/v1/conversations", json={})).json()["id"]
    first = (await client.post("/v1/responses", json={
        "input": "one", "conversation": conversation, "background": True})).json()
    second = (await client.post("/v1/responses", json={
        "input": "two", "conversation": conversation, "background": True})).json()
    await harness.serve_next_job(["1"])
    running = await harness.take_job()  # the second is still running
    worker = asyncio.create_task(harness.serve_next_job(["3"]))
    third = await client.post("/v1/responses", json={"input": "three",
                                                     "conversation": conversation})
    third_job = await worker
    assert third.status_code == 200, third.text
    # The first ended: its turn joined before the third read the conversation; the second's not.
    assert _messages(harness, third_job) == [
        {"role": "user", "content": "one"}, {"role": "assistant", "content": "1"},
        {"role": "user", "content": "three"}]
    harness.finish_job(running, ["2"])
    worker = asyncio.create_task(harness.serve_next_job(["4"]))
    fourth = await client.post("/v1/responses", json={"input": "four",
                                                      "conversation": conversation})
    fourth_job = await worker
    assert fourth.status_code == 200, fourth.text
    assert [m["content"] for m in _messages(harness, fourth_job)] == [
        "one", "1", "three", "3", "two", "2", "four"]  # turns join in the order they ended
    assert harness.sync.llen(harness.keys.conversation_pending(conversation)) == 0
    assert (await _get_status(client, first["id"]), await _get_status(client, second["id"])) == (
        "completed", "completed")


async def _get_status(client: httpx.AsyncClient, response_id: str) -> str:
    status: str = (await client.get(f"/v1/responses/{response_id}")).json()["status"]
    return status


async def test_failed_and_cancelled_turns_add_nothing(harness: Harness,
                                                      client: httpx.AsyncClient) -> None:
    conversation = (await client.post("/v1/conversations", json={})).json()["id"]
    async def fail_next_job() -> None:
        harness.publish_done(await harness.take_job(), 0, FinishReason.ERROR, error="out of memory")

    worker = asyncio.create_task(fail_next_job())
    failed = await client.post("/v1/responses", json={"input": "a", "conversation": conversation})
    await worker
    assert failed.status_code == 500
    created = (await client.post("/v1/responses", json={
        "input": "b", "conversation": conversation, "background": True})).json()
    cancelled = await client.post(f"/v1/responses/{created['id']}/cancel")
    assert cancelled.json()["status"] == "cancelled"
    assert await _items(client, conversation) == []
    # A turn that ran out of max_output_tokens is an answered one: it joins.
    worker = asyncio.create_task(harness.serve_next_job(["Once"], FinishReason.LENGTH))
    cut = await client.post("/v1/responses", json={"input": "c", "conversation": conversation,
                                                   "max_output_tokens": 1})
    job_id = await worker
    assert cut.json()["status"] == "incomplete"
    items = await _items(client, conversation)
    assert [item["id"] for item in items[1:]] == [f"msg_{job_id}"]
    assert items[1]["status"] == "incomplete"


async def test_a_deleted_conversation_takes_no_more_turns(harness: Harness,
                                                         client: httpx.AsyncClient) -> None:
    conversation = (await client.post("/v1/conversations", json={})).json()["id"]
    created = (await client.post("/v1/responses", json={
        "input": "hello", "conversation": conversation, "background": True})).json()
    await harness.serve_next_job(["Hi"])
    assert (await client.delete(f"/v1/conversations/{conversation}")).status_code == 200
    # Its response still settles; the conversation is not brought back.
    assert (await client.get(f"/v1/responses/{created['id']}")).json()["status"] == "completed"
    assert not harness.context.sync.exists(harness.keys.conversation_items(conversation))
    assert (await client.get(f"/v1/conversations/{conversation}")).status_code == 404


@pytest.mark.parametrize(("method", "path", "body", "param", "message"), [
    ("POST", "/v1/conversations", {"items": [{"type": "image"}]}, "items",
     "items[0]: items of type 'image' are not supported"),
    ("POST", "/v1/conversations", {"items": [{"role": "user", "content": "x"}] * 21}, "items",
     "at most 20 items a request (got 21)"),
    ("POST", "/v1/conversations", {"metadata": {str(i): "v" for i in range(17)}}, "metadata",
     "at most 16 pairs (got 17)"),
    ("POST", "/v1/conversations", {"items": [], "title": "x"}, "title",
     "Unrecognized request argument supplied: title"),
    ("POST", "/v1/conversations/{id}", {}, "metadata",
     "Missing required parameter: 'metadata'"),
    ("POST", "/v1/conversations/{id}/items", {"items": []}, "items", "at least 1 item"),
    ("POST", "/v1/conversations/{id}/items", {"items": [{"role": "robot", "content": "x"}]},
     "items", "items[0].role must be one of user, assistant, system, developer"),
    ("GET", "/v1/conversations/{id}/items?after=msg_nope", None, "after",
     "'after' names no item of conversation"),
    ("GET", "/v1/conversations/{id}/items?order=up", None, "query.order",
     "Input should be 'asc' or 'desc'"),
    ("POST", "/v1/responses", {"input": "x", "conversation": {"id": 5}}, "conversation",
     "give the conversation's id"),
    ("POST", "/v1/responses", {"input": "x", "conversation": "{id}", "previous_response_id": "r"},
     "conversation", "give conversation or previous_response_id, not both"),
])
async def test_bad_requests_name_the_field(client: httpx.AsyncClient, method: str, path: str,
                                           body: dict[str, Any] | None, param: str,
                                           message: str) -> None:
    conversation = (await client.post("/v1/conversations", json={})).json()["id"]
    fill = json.dumps(body).replace("{id}", conversation) if body is not None else None
    answer = await client.request(method, path.replace("{id}", conversation), content=fill,
                                  headers={"content-type": "application/json"})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and message in error["message"], error


async def test_unknown_conversations_are_404s_naming_the_field(client: httpx.AsyncClient) -> None:
    answer = await client.post("/v1/responses", json={"input": "x", "conversation": "conv_nope"})
    assert answer.status_code == 404
    assert answer.json()["error"] == {
        "message": "No conversation with id 'conv_nope' (conversations are kept 86400 s after "
                   "their last change)", "type": "invalid_request_error", "param": "conversation",
        "code": "conversation_not_found"}
    for method, path in (("GET", "/v1/conversations/conv_nope"),
                         ("DELETE", "/v1/conversations/conv_nope"),
                         ("GET", "/v1/conversations/conv_nope/items")):
        answer = await client.request(method, path)
        assert (answer.status_code, answer.json()["error"]["param"]) == (404, "conversation_id")


async def test_a_long_turn_joins_whole(harness: Harness, client: httpx.AsyncClient) -> None:
    # More items than one Lua call may unpack at once (about 8,000).
    harness.register_model(context=1 << 20)
    conversation = (await client.post("/v1/conversations", json={})).json()["id"]
    turns = [{"role": "user", "content": str(i)} for i in range(9000)]
    worker = asyncio.create_task(harness.serve_next_job(["ok"]))
    answer = await client.post("/v1/responses", json={"input": turns,
                                                      "conversation": conversation})
    job_id = await worker
    assert answer.status_code == 200, answer.text
    items = harness.context.sync.lrange(harness.keys.conversation_items(conversation), 0, -1)
    assert [json.loads(item)["content"][0]["text"] for item in items] == [
        *[str(i) for i in range(9000)], "ok"]
    assert json.loads(items[-1])["id"] == f"msg_{job_id}"
