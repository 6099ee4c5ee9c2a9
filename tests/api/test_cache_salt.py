"""vLLM's cache_salt on /v1/completions, /v1/chat/completions and /v1/jobs: it reaches every job
the request makes, is left out of unsalted ones, and a bad one is a 400 (OpenAI routes) or a 422
(jobs API) naming the field."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import anyio
import httpx
import pytest
from api_support import Harness
from rq.job import Job
from rq.serializers import JSONSerializer

pytestmark = pytest.mark.anyio

CHAT = [{"role": "user", "content": "hello"}]
SALT = "k3Yq0r9mWb7cZ2xN4pL8sT1vH6jD5gF0aE3uR7iO2yQ"  # 43 base64 characters: 256 bits


def _spec(harness: Harness, job_id: str) -> dict[str, Any]:
    spec: dict[str, Any] = Job.fetch(job_id, connection=harness.context.sync,
                                     serializer=JSONSerializer).args[0]
    return spec


async def _served_specs(harness: Harness, client: httpx.AsyncClient, route: str,
                        body: dict[str, Any], num_jobs: int = 1) -> list[dict[str, Any]]:
    """POST an OpenAI route while a stand-in worker answers its jobs; the jobs' specs."""
    async def serve() -> list[str]:
        return [await harness.serve_next_job(["ok"]) for _ in range(num_jobs)]

    worker = asyncio.create_task(serve())
    response = await client.post(route, json=body)
    job_ids = await worker
    assert response.status_code == 200, response.text
    return [_spec(harness, job_id) for job_id in job_ids]


@pytest.mark.parametrize(("route", "body"), [
    ("/v1/completions", {"prompt": "hello"}),
    ("/v1/chat/completions", {"messages": CHAT}),
])
async def test_an_openai_route_puts_the_salt_on_every_job(
        harness: Harness, client: httpx.AsyncClient, route: str, body: dict[str, Any]) -> None:
    specs = await _served_specs(harness, client, route, {**body, "n": 2, "cache_salt": SALT}, 2)
    assert [spec["cache_salt"] for spec in specs] == [SALT, SALT]
    assert all("cache_salt" not in spec["sampling"] for spec in specs)  # not a sampling field


@pytest.mark.parametrize(("route", "body"), [
    ("/v1/completions", {"prompt": "hello"}),
    ("/v1/chat/completions", {"messages": CHAT}),
])
async def test_an_unsalted_request_makes_an_unsalted_job(
        harness: Harness, client: httpx.AsyncClient, route: str, body: dict[str, Any]) -> None:
    (spec,) = await _served_specs(harness, client, route, body)
    assert "cache_salt" not in spec  # as before the field: older workers read it


async def test_the_jobs_api_puts_the_salt_on_every_job(harness: Harness,
                                                       client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/jobs", json={"prompt": "hello", "n": 2, "cache_salt": SALT})
    assert response.status_code == 202, response.text
    job_ids = response.json()["job_ids"]
    assert [_spec(harness, job_id).get("cache_salt") for job_id in job_ids] == [SALT, SALT]
    response = await client.post("/v1/jobs", json={"prompt": "hello"})
    assert "cache_salt" not in _spec(harness, response.json()["job_id"])


BAD_SALTS = [
    ("", "at least 1 character"),  # vLLM refuses it too: it would read as no salt
    (5, "valid string"),
    (["a"], "valid string"),
    ("s" * 129, "at most 128 characters"),
    ("\ud800", "unable to parse raw data as a unicode string"),  # a lone surrogate
]


async def _post_ascii(client: httpx.AsyncClient, route: str, body: dict[str, Any]) -> httpx.Response:
    # JSON escapes (ensure_ascii), so a lone surrogate travels as "\\ud800", as a client sends it.
    return await client.post(route, content=json.dumps(body),
                              headers={"content-type": "application/json"})


@pytest.mark.parametrize(("route", "body"), [
    ("/v1/completions", {"prompt": "hello"}),
    ("/v1/chat/completions", {"messages": CHAT}),
])
@pytest.mark.parametrize(("salt", "words"), BAD_SALTS)
async def test_a_bad_salt_is_a_400_naming_it(client: httpx.AsyncClient, route: str,
                                             body: dict[str, Any], salt: Any, words: str) -> None:
    with anyio.fail_after(10):  # a salt wrongly accepted would wait for a worker: fail instead
        response = await _post_ascii(client, route, {**body, "cache_salt": salt})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "cache_salt")
    assert words in error["message"]


@pytest.mark.parametrize(("salt", "words"), BAD_SALTS)
async def test_a_bad_salt_is_a_422_naming_it_on_the_jobs_api(client: httpx.AsyncClient, salt: Any,
                                                             words: str) -> None:
    response = await _post_ascii(client, "/v1/jobs", {"prompt": "hello", "cache_salt": salt})
    assert response.status_code == 422, response.text
    (detail,) = response.json()["detail"]
    assert detail["loc"] == ["body", "cache_salt"]
    assert words in detail["msg"]
