"""n choices, lists of prompts, token-id prompts, echo, usage (cached tokens, continuous stats),
/tokenize and /detokenize, and the model's generation_config defaults, on fakeredis."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from api_support import MODEL, Harness, parse_sse, word_tokenizer
from rq.job import Job
from rq.serializers import JSONSerializer

from protocol import FinishReason, ModelCard, StreamEntry, stream_ids

pytestmark = pytest.mark.anyio
CHAT = [{"role": "user", "content": "hello"}]


def _spec(harness: Harness, job_id: str) -> dict[str, Any]:
    return Job.fetch(job_id, connection=harness.context.sync, serializer=JSONSerializer).args[0]


async def _serve(harness: Harness, replies: list[list[str]], prompt_tokens: int = 2,
                 cached_tokens: int = 0) -> list[str]:
    """Take len(replies) jobs in queue order and write each one's tokens and final entry."""
    job_ids = [await harness.take_job() for _ in replies]
    for job_id, texts in zip(job_ids, replies):
        harness.publish_tokens(job_id, texts)
    for job_id, texts in zip(job_ids, replies):
        entry = StreamEntry(kind=StreamEntry.DONE, finish_reason=FinishReason.LENGTH,
                            prompt_tokens=prompt_tokens, completion_tokens=len(texts),
                            cached_tokens=cached_tokens)
        harness.sync.xadd(harness.keys.stream(job_id), entry.to_fields(),
                          id=stream_ids.done_entry_id(len(texts)))
        harness.sync.hset(harness.keys.state(job_id), mapping={"status": "finished"})
    return job_ids


def _data(text: str) -> list[Any]:
    return ["[DONE]" if e["data"] == "[DONE]" else json.loads(e["data"])
            for e in parse_sse(text) if "data" in e]


async def test_n_choices_are_n_seeded_jobs_merged_by_index(harness: Harness,
                                                          client: httpx.AsyncClient) -> None:
    worker = asyncio.create_task(_serve(harness, [["a", "b"], ["c"], ["d", "e", "f"]],
                                        cached_tokens=1))
    response = await client.post("/v1/completions", json={
        "prompt": "hello world", "n": 3, "seed": 5, "max_tokens": 3})
    job_ids = await worker
    assert response.status_code == 200, response.text
    assert response.headers["x-carpool-job-id"] == job_ids[0]
    assert response.headers["x-carpool-job-ids"] == ",".join(job_ids)
    assert [_spec(harness, j)["sampling"]["seed"] for j in job_ids] == [5, 6, 7]
    body = response.json()
    assert body["id"] == f"cmpl-{job_ids[0]}"
    assert body["choices"] == [
        {"index": 0, "text": "ab", "logprobs": None, "finish_reason": "length"},
        {"index": 1, "text": "c", "logprobs": None, "finish_reason": "length"},
        {"index": 2, "text": "def", "logprobs": None, "finish_reason": "length"},
    ]
    # The prompt counts once (as OpenAI and vLLM count it), completions over all choices.
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8,
                             "prompt_tokens_details": {"cached_tokens": 1}}


async def test_a_list_of_prompts_text_and_token_ids_with_echo(harness: Harness,
                                                             client: httpx.AsyncClient) -> None:
    worker = asyncio.create_task(_serve(harness, [["x"], ["y"], ["z"], ["w"]]))
    response = await client.post("/v1/completions", json={
        "prompt": ["hello", [3, 4, 1]], "n": 2, "echo": True, "max_tokens": 2})
    job_ids = await worker
    specs = [_spec(harness, j) for j in job_ids]
    assert [s.get("prompt") for s in specs] == ["hello", "hello", None, None]
    assert [s.get("prompt_token_ids") for s in specs] == [None, None, [3, 4, 1], [3, 4, 1]]
    decoded = word_tokenizer().decode([3, 4, 1], skip_special_tokens=False)
    body = response.json()
    assert [(c["index"], c["text"]) for c in body["choices"]] == [
        (0, "hellox"), (1, "helloy"), (2, decoded + "z"), (3, decoded + "w")]
    assert body["usage"]["prompt_tokens"] == 4  # two prompts of 2 (as the fake worker says)
    assert body["usage"]["completion_tokens"] == 4


async def test_echo_with_truncate_prompt_tokens_shows_what_the_model_saw(
        harness: Harness, client: httpx.AsyncClient) -> None:
    # The model sees a truncated prompt's last tokens: echo answers with those, as vLLM's.
    worker = asyncio.create_task(_serve(harness, [["x"], ["y"]]))
    response = await client.post("/v1/completions", json={
        "prompt": ["hello world the a", [3, 4, 8, 9]], "echo": True, "max_tokens": 1,
        "truncate_prompt_tokens": 2})
    await worker
    assert response.status_code == 200, response.text
    seen = word_tokenizer().decode([8, 9], skip_special_tokens=False)  # "the a"
    assert [c["text"] for c in response.json()["choices"]] == [seen + "x", seen + "y"]
    worker = asyncio.create_task(_serve(harness, [["z"]]))
    whole = await client.post("/v1/completions", json={  # shorter than the truncation: as given
        "prompt": "hello world", "echo": True, "max_tokens": 1, "truncate_prompt_tokens": 5})
    await worker
    assert [c["text"] for c in whole.json()["choices"]] == ["hello worldz"]


async def test_streamed_choices_carry_their_index_and_usage_on_every_chunk(
        harness: Harness, client: httpx.AsyncClient) -> None:
    worker = asyncio.create_task(_serve(harness, [["a", "b"], ["c"]]))
    response = await client.post("/v1/chat/completions", json={
        "messages": CHAT, "n": 2, "stream": True, "max_tokens": 2,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    await worker
    chunks = _data(response.text)
    assert chunks[-1] == "[DONE]"
    final = chunks[-2]
    assert final["choices"] == []
    assert final["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5,
                              "prompt_tokens_details": {"cached_tokens": 0}}
    by_index: dict[int, list[tuple[Any, Any, Any]]] = {0: [], 1: []}
    for chunk in chunks[:-2]:
        (choice,) = chunk["choices"]
        usage = chunk["usage"]
        by_index[choice["index"]].append((choice["delta"], choice["finish_reason"],
                                          usage["completion_tokens"]))
        assert usage["prompt_tokens"] in (2, 6)  # the API's count of the chat, then the worker's
    assert by_index[0] == [({"role": "assistant", "content": ""}, None, 0),
                           ({"content": "a"}, None, 1), ({"content": "b"}, None, 2),
                           ({}, "length", 2)]
    assert by_index[1] == [({"role": "assistant", "content": ""}, None, 0),
                           ({"content": "c"}, None, 1), ({}, "length", 1)]


async def test_streamed_completion_echo_comes_first(harness: Harness,
                                                    client: httpx.AsyncClient) -> None:
    worker = asyncio.create_task(_serve(harness, [["x"]]))
    response = await client.post("/v1/completions", json={
        "prompt": "hello", "echo": True, "stream": True, "max_tokens": 1})
    await worker
    texts = [c["choices"][0]["text"] for c in _data(response.text)[:-1]]
    assert texts == ["hello", "x", ""]


async def test_echo_with_max_tokens_0_scores_the_prompt_and_shows_nothing_generated(
        harness: Harness, client: httpx.AsyncClient) -> None:
    # OpenAI's legacy API and vLLM: the choice is the prompt alone; the job runs one token (the
    # prompt's logprobs come with it), counted in usage as vLLM counts it, never shown.
    worker = asyncio.create_task(_serve(harness, [["x"], ["y"]]))
    response = await client.post("/v1/completions", json={
        "prompt": ["hello", "world"], "echo": True, "max_tokens": 0})
    job_ids = await worker
    assert [_spec(harness, j)["sampling"]["max_tokens"] for j in job_ids] == [1, 1]
    body = response.json()
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "hello", "length"), (1, "world", "length")]
    assert body["usage"]["completion_tokens"] == 2
    worker = asyncio.create_task(_serve(harness, [["x"]]))
    response = await client.post("/v1/completions", json={
        "prompt": "hello", "echo": True, "stream": True, "max_tokens": 0})
    await worker
    chunks = _data(response.text)[:-1]
    assert [(c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in chunks] == [
        ("hello", None), ("", "length")]


async def test_max_tokens_0_without_echo_is_refused(harness: Harness,
                                                    client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 0})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "max_tokens" and "echo" in error["message"]
    assert sum(harness.sync.llen(f"rq:queue:{name}") for name in harness.keys.queue_names(MODEL)) == 0


@pytest.mark.parametrize(("given", "tier"), [(-5, "high"), (0, "normal"), (2, "low"),
                                             ("batch", "batch")])
async def test_vllms_integer_priority_picks_the_tier_by_its_sign(
        harness: Harness, client: httpx.AsyncClient, given: object, tier: str) -> None:
    worker = asyncio.create_task(_serve(harness, [["x"]]))
    response = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1,
                                                          "priority": given})
    (job_id,) = await worker
    assert response.status_code == 200, response.text
    assert _spec(harness, job_id)["priority"] == tier


async def test_a_priority_neither_a_tier_nor_an_integer_is_refused(client: httpx.AsyncClient) -> None:
    for bad in ("urgent", True, 1.5):
        response = await client.post("/v1/completions", json={"prompt": "hello", "priority": bad})
        assert response.status_code == 400, bad
        assert response.json()["error"]["param"] == "priority"


async def test_all_n_jobs_are_admitted_or_none() -> None:
    from api_support import make_harness

    harness = make_harness(max_queue_depth=3)
    harness.register_model()
    async with harness.client() as client:
        response = await client.post("/v1/completions", json={"prompt": "hello", "n": 4})
    assert response.status_code == 429
    assert response.json()["error"]["code"] == "queue_full"
    assert sum(harness.sync.llen(f"rq:queue:{name}") for name in harness.keys.queue_names(MODEL)) == 0


async def test_tokenize_and_detokenize_as_vllm(harness: Harness, client: httpx.AsyncClient) -> None:
    response = await client.post("/tokenize", json={"model": MODEL, "prompt": "hello world"})
    assert response.json() == {"count": 2, "max_model_len": 32, "tokens": [3, 4]}
    chat = await client.post("/tokenize", json={"messages": CHAT})
    # <|im_start|> user hello <|im_end|> <|im_start|> assistant (the word tokenizer's view)
    assert chat.json()["tokens"] == [1, 6, 3, 2, 1, 7]
    no_turn = await client.post("/tokenize", json={"messages": CHAT,
                                                   "add_generation_prompt": False})
    assert no_turn.json()["tokens"] == [1, 6, 3, 2]
    back = await client.post("/detokenize", json={"tokens": [3, 4]})
    assert back.json() == {"prompt": word_tokenizer().decode([3, 4], skip_special_tokens=False)}
    bad = await client.post("/detokenize", json={"tokens": [3, 99]})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "tokens"
    assert "token id 99, outside the vocabulary" in bad.json()["error"]["message"]
    both = await client.post("/tokenize", json={"prompt": "a", "messages": CHAT})
    assert both.status_code == 400
    assert "exactly one of 'prompt' and 'messages'" in both.json()["error"]["message"]


async def test_tokenize_answers_tgis_body_as_tgi_does(harness: Harness, client: httpx.AsyncClient) -> None:
    response = await client.post("/tokenize", json={"inputs": "hello  world the"})
    assert response.status_code == 200
    assert response.json() == [{"id": 3, "text": "hello", "start": 0, "stop": 5},
                               {"id": 4, "text": "world", "start": 7, "stop": 12},
                               {"id": 8, "text": "the", "start": 13, "stop": 16}]
    # TGI truncates from the left: the last `truncate` tokens, their spans in the whole input.
    truncated = await client.post("/tokenize", json={"inputs": "hello  world the", "model": MODEL,
                                                     "parameters": {"truncate": 2}})
    assert truncated.json() == response.json()[1:]
    # Errors in TGI's shape: 422, `error` naming the field, `error_type`.
    for body, field in (({"inputs": ""}, "inputs"), ({"inputs": "a", "parameters": {"truncate": 0}},
                                                      "parameters.truncate"),
                        ({"inputs": "a", "prompt": "a"}, "prompt"), ({"inputs": "a", "add_special_tokens": 1},
                                                                      "add_special_tokens")):
        bad = await client.post("/tokenize", json=body)
        assert bad.status_code == 422, body
        assert bad.json()["error_type"] == "validation" and field in bad.json()["error"], bad.json()
    # vLLM's body keeps vLLM's (OpenAI's) error shape, the field named without the union's tag.
    vllm_bad = await client.post("/tokenize", json={"prompt": 5})
    assert vllm_bad.status_code == 400 and vllm_bad.json()["error"]["param"] == "prompt"
    unknown = await client.post("/tokenize", json={"inputs": "a", "model": "no-such-model"})
    assert unknown.status_code == 404 and unknown.json()["error_type"] == "not_found"


async def test_the_models_generation_config_fills_what_a_request_leaves_out(
        harness: Harness, client: httpx.AsyncClient) -> None:
    card = ModelCard(name=MODEL, max_model_len=32, eos_token="<|im_end|>",
                     bos_token="<|im_start|>", created_at=1.0,
                     generation_defaults={"temperature": 0.3, "top_k": 20, "max_tokens": 5,
                                          "no_such_field": 1.5})
    harness.sync.hset(harness.keys.models(), MODEL, card.to_json())
    harness.add_worker(model=MODEL)  # /v1/models lists the models a live worker serves
    models = (await client.get("/v1/models")).json()
    assert models["data"][0]["generation_defaults"] == {"temperature": 0.3, "top_k": 20,
                                                        "max_tokens": 5}

    worker = asyncio.create_task(_serve(harness, [["x"]]))
    await client.post("/v1/chat/completions", json={"messages": CHAT})
    (job_id,) = await worker
    sampling = _spec(harness, job_id)["sampling"]
    assert (sampling["temperature"], sampling["top_k"], sampling["max_tokens"]) == (0.3, 20, 5)

    worker = asyncio.create_task(_serve(harness, [["x"]]))
    await client.post("/v1/completions", json={"prompt": "hello", "temperature": 0.9,
                                               "max_tokens": 7})
    (job_id,) = await worker
    sampling = _spec(harness, job_id)["sampling"]
    assert (sampling["temperature"], sampling["top_k"], sampling["max_tokens"]) == (0.9, 20, 7)


# OpenAI's nullable fields, and vLLM's extras whose defaults are null, each sent as null.
NULLS = {"temperature": None, "top_p": None, "n": None, "stream": None, "presence_penalty": None,
         "frequency_penalty": None, "seed": None, "stop": None, "logit_bias": None, "user": None,
         "stream_options": None, "top_k": None, "min_p": None, "repetition_penalty": None,
         "logprobs": None}


@pytest.mark.parametrize(("path", "body", "nulls"), [
    ("/v1/chat/completions", {"messages": CHAT},
     {**NULLS, "max_tokens": None, "max_completion_tokens": None, "top_logprobs": None,
      "tools": None, "tool_choice": None, "response_format": None, "parallel_tool_calls": None}),
    ("/v1/completions", {"prompt": "hello"},
     {**NULLS, "max_tokens": None, "echo": None, "best_of": None, "suffix": None}),
    ("/v1/responses", {"input": "hello"},
     {"temperature": None, "top_p": None, "max_output_tokens": None, "stream": None,
      "store": None, "tools": None, "tool_choice": None, "text": None, "top_k": None,
      "min_p": None, "presence_penalty": None, "prompt": None, "background": None}),
])
async def test_null_is_a_field_left_out(harness: Harness, client: httpx.AsyncClient, path: str,
                                        body: dict[str, Any], nulls: dict[str, Any]) -> None:
    # OpenAI's reference types them "number or null"; clients that serialize a whole config
    # send the nulls, and they mean the model's own defaults, as in vLLM.
    card = ModelCard(name=MODEL, max_model_len=32, eos_token="<|im_end|>",
                     bos_token="<|im_start|>", created_at=1.0,
                     generation_defaults={"temperature": 0.3, "top_p": 0.8, "top_k": 20,
                                          "max_tokens": 5})
    harness.sync.hset(harness.keys.models(), MODEL, card.to_json())
    samplings = []
    for sent in (body, {**body, **nulls}):
        worker = asyncio.create_task(_serve(harness, [["x"]]))
        response = await client.post(path, json=sent)
        (job_id,) = await worker
        assert response.status_code == 200, response.text
        samplings.append(_spec(harness, job_id)["sampling"])
    assert samplings[1] == samplings[0]
    assert (samplings[1]["temperature"], samplings[1]["top_p"], samplings[1]["top_k"],
            samplings[1]["max_tokens"]) == (0.3, 0.8, 20, 5)


async def test_the_published_schema_says_which_fields_take_null(client: httpx.AsyncClient) -> None:
    schemas = (await client.get("/openapi.json")).json()["components"]["schemas"]
    for name, nullable, required in (("ChatCompletionRequest", "temperature", "messages"),
                                     ("CompletionRequest", "echo", "prompt"),
                                     ("ResponsesRequest", "store", "input")):
        properties = schemas[name]["properties"]
        assert {"type": "null"} in properties[nullable]["anyOf"], name
        assert "anyOf" not in properties[required] or {"type": "null"} not in properties[
            required]["anyOf"], name


async def test_a_client_leaving_cancels_every_choice(harness: Harness) -> None:
    from test_openai_routes import _drive_asgi

    from protocol import JobStatus

    sent = await _drive_asgi(harness, "/v1/completions", {"prompt": "hello", "n": 3}, "2.3", 0)
    assert sent[0]["status"] == 499
    job_ids = dict(sent[0]["headers"])[b"x-carpool-job-ids"].decode().split(",")
    assert len(job_ids) == 3
    assert [harness.state(j).status for j in job_ids] == [JobStatus.CANCELED] * 3
    streamed = await _drive_asgi(harness, "/v1/completions",
                                 {"prompt": "hello", "n": 2, "stream": True}, "2.3", 0)
    job_ids = dict(streamed[0]["headers"])[b"x-carpool-job-ids"].decode().split(",")
    assert [harness.state(j).status for j in job_ids] == [JobStatus.CANCELED] * 2


async def test_max_completion_tokens_is_not_capped_by_the_models_default(
        harness: Harness, client: httpx.AsyncClient) -> None:
    card = ModelCard(name=MODEL, max_model_len=32, created_at=1.0,
                     generation_defaults={"max_tokens": 5})
    harness.sync.hset(harness.keys.models(), MODEL, card.to_json())
    worker = asyncio.create_task(_serve(harness, [["x"]]))
    await client.post("/v1/chat/completions", json={"messages": CHAT, "max_completion_tokens": 9})
    (job_id,) = await worker
    assert _spec(harness, job_id)["sampling"]["max_tokens"] == 9


CONTINUED = [{"role": "user", "content": "count"}, {"role": "assistant", "content": "one two"}]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_chat_echo_puts_the_last_assistant_message_first(harness: Harness, client: httpx.AsyncClient,
                                                              stream: bool) -> None:
    """vLLM's chat echo: the last message, being the assistant's, heads every choice's content
    (in a stream, its own chunk after the role), as a continued reply reads whole."""
    worker = asyncio.create_task(_serve(harness, [[" three"], [" four"]]))
    response = await client.post("/v1/chat/completions", json={
        "messages": CONTINUED, "echo": True, "n": 2, "stream": stream, "max_tokens": 1})
    await worker
    assert response.status_code == 200, response.text
    if not stream:
        assert [c["message"]["content"] for c in response.json()["choices"]] == [
            "one two three", "one two four"]
        return
    deltas: dict[int, list[Any]] = {0: [], 1: []}
    for chunk in _data(response.text)[:-1]:
        (choice,) = chunk["choices"]
        deltas[choice["index"]].append(choice["delta"])
    assert deltas[0] == [{"role": "assistant", "content": ""}, {"content": "one two"},
                         {"content": " three"}, {}]
    assert deltas[1] == [{"role": "assistant", "content": ""}, {"content": "one two"},
                         {"content": " four"}, {}]


async def test_chat_echo_after_a_user_message_echoes_nothing(harness: Harness,
                                                             client: httpx.AsyncClient) -> None:
    worker = asyncio.create_task(_serve(harness, [["hi"]]))
    response = await client.post("/v1/chat/completions", json={
        "messages": CHAT, "echo": True, "max_tokens": 1})
    await worker
    assert response.json()["choices"][0]["message"]["content"] == "hi"


async def test_chat_echo_must_be_a_bool(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/chat/completions", json={
        "messages": CHAT, "echo": "yes", "max_tokens": 1})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "echo"
