"""vLLM's allowed_token_ids and bad_words on every route that generates: they reach the job's
sampling spec as given, and bad values are refused naming the field (400 on the OpenAI routes,
422 on the jobs API), out-of-vocabulary ids included."""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import httpx
import pytest
from api_support import MODEL, VOCAB, Harness, word_tokenizer
from rq.job import Job
from rq.serializers import JSONSerializer
from tokenizers.normalizers import Replace

from protocol.generation import MAX_ALLOWED_TOKEN_IDS, MAX_BAD_WORD_CHARS, MAX_BAD_WORDS
from protocol.rq_keys import RQKeys

pytestmark = pytest.mark.anyio

CHAT = [{"role": "user", "content": "hello"}]
ROUTES = [("/v1/completions", {"prompt": "hello"}), ("/v1/chat/completions", {"messages": CHAT}),
          ("/v1/jobs", {"prompt": "hello"})]


async def _submitted_sampling(harness: Harness, client: httpx.AsyncClient, route: str,
                              body: dict[str, Any]) -> dict[str, Any]:
    """The sampling spec of the job `body` makes (a stand-in worker ends it at once)."""

    async def serve() -> dict[str, Any]:
        job_id = await harness.take_job()
        harness.publish_done(job_id, 0)
        spec: dict[str, Any] = Job.fetch(job_id, connection=harness.context.sync,
                                         serializer=JSONSerializer).args[0]
        return spec

    worker = asyncio.create_task(serve())
    response = await client.post(route, json={**body, "max_tokens": 3})
    assert response.status_code in (200, 202), response.text
    sampling: dict[str, Any] = (await worker)["sampling"]
    return sampling


@pytest.mark.parametrize(("route", "body"), ROUTES)
async def test_the_extras_reach_the_job_spec(harness: Harness, client: httpx.AsyncClient,
                                             route: str, body: dict[str, Any]) -> None:
    extras = {"allowed_token_ids": [9, 4, 9, VOCAB - 1], "bad_words": ["foo", " bar baz"]}
    sampling = await _submitted_sampling(harness, client, route, {**body, **extras})
    assert {name: sampling[name] for name in extras} == extras
    # Left out (or null, empty) they stay out of the spec: an older worker reads the job alike.
    for unset in ({}, {"allowed_token_ids": None, "bad_words": []}):
        sampling = await _submitted_sampling(harness, client, route, {**body, **unset})
        assert "allowed_token_ids" not in sampling and "bad_words" not in sampling


BAD_VALUES = [
    ({"allowed_token_ids": []}, "allowed_token_ids", "List should have at least 1 item"),
    ({"allowed_token_ids": [3, -1]}, "allowed_token_ids.1", "greater than or equal to 0"),
    ({"allowed_token_ids": ["3"]}, "allowed_token_ids.0", "valid integer"),
    ({"allowed_token_ids": 3}, "allowed_token_ids", "valid list"),
    ({"allowed_token_ids": list(range(MAX_ALLOWED_TOKEN_IDS + 1))}, "allowed_token_ids",
     f"at most {MAX_ALLOWED_TOKEN_IDS} items"),
    ({"bad_words": [""]}, "bad_words.0", "at least 1 character"),
    ({"bad_words": ["ok", " \n "]}, "bad_words.1", "a bad word needs some text other than whitespace"),
    ({"bad_words": [5]}, "bad_words.0", "valid string"),
    ({"bad_words": "word"}, "bad_words", "valid list"),
    ({"bad_words": ["w"] * (MAX_BAD_WORDS + 1)}, "bad_words", f"at most {MAX_BAD_WORDS} items"),
    ({"bad_words": ["w" * (MAX_BAD_WORD_CHARS + 1)]}, "bad_words.0",
     f"at most {MAX_BAD_WORD_CHARS} characters"),
]
OUT_OF_VOCAB = ({"allowed_token_ids": [3, VOCAB]}, "allowed_token_ids",
                f"'allowed_token_ids' names token id {VOCAB}, outside the vocabulary of model 'tiny' "
                f"(ids 0 to {VOCAB - 1})")


@pytest.mark.parametrize(("route", "body"), ROUTES[:2])
@pytest.mark.parametrize(("fields", "param", "words"), [*BAD_VALUES, OUT_OF_VOCAB])
async def test_openai_routes_answer_400_naming_the_field(
        client: httpx.AsyncClient, route: str, body: dict[str, Any], fields: dict[str, Any],
        param: str, words: str) -> None:
    with anyio.fail_after(10):  # accepted, the request would wait for a worker that never comes
        response = await client.post(route, json={**body, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert words in error["message"]


@pytest.mark.parametrize(("fields", "param", "words"), BAD_VALUES)
async def test_the_jobs_api_answers_422_naming_the_field(
        client: httpx.AsyncClient, fields: dict[str, Any], param: str, words: str) -> None:
    response = await client.post("/v1/jobs", json={"prompt": "hello", **fields})
    assert response.status_code == 422, response.text
    detail = response.json()["detail"][0]
    assert detail["loc"] == ["body", *(int(p) if p.isdigit() else p for p in param.split("."))]
    assert words in detail["msg"]


async def test_the_jobs_api_refuses_an_allowed_id_outside_the_vocabulary(
        client: httpx.AsyncClient) -> None:
    fields, param, words = OUT_OF_VOCAB
    response = await client.post("/v1/jobs", json={"prompt": "hello", **fields})
    assert response.status_code == 422, response.text
    detail = response.json()["detail"][0]
    assert detail["loc"] == ["body", param]
    assert words in detail["msg"]


async def test_a_bad_word_the_tokenizer_turns_into_nothing_is_refused_before_it_queues(
        harness: Harness, client: httpx.AsyncClient) -> None:
    # A normalizer that drops zero-width spaces, which are not whitespace to str.strip(): a word
    # of them passes the field's own checks and is no tokens at all (the worker would fail it).
    tokenizer = word_tokenizer()
    tokenizer.normalizer = Replace("\u200b", "")
    harness.sync.set(harness.keys.model_tokenizer(MODEL), tokenizer.to_str())
    words = ["hello", "\u200b\u200b"]
    message = (f"'bad_words' entry 1 ({words[1]!r}) is no tokens at all in model 'tiny''s "
               "tokenizer, so it could ban nothing")
    for route, body in ROUTES:
        with anyio.fail_after(10):  # accepted, the request would wait for a worker
            response = await client.post(route, json={**body, "bad_words": words})
        if route == "/v1/jobs":
            assert response.status_code == 422, response.text
            detail = response.json()["detail"][0]
            assert (detail["loc"], detail["msg"]) == (["body", "bad_words", "1"], message)
        else:
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert (error["param"], error["message"]) == ("bad_words.1", message)
    queues = [RQKeys.queue(name) for name in harness.keys.queue_names(MODEL)]
    assert [harness.sync.llen(queue) for queue in queues] == [0] * len(queues)
    # The same words without the empty one are taken.
    sampling = await _submitted_sampling(harness, client, "/v1/completions",
                                         {"prompt": "hello", "bad_words": words[:1]})
    assert sampling["bad_words"] == words[:1]
