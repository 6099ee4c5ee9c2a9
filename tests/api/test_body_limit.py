"""BodyLimitMiddleware: a body past CARPOOL_MAX_BODY_BYTES answers 413, in its route's shape."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from api_support import make_harness

pytestmark = pytest.mark.anyio

LIMIT = 4096
MESSAGE = (f"; the limit is {LIMIT} bytes (CARPOOL_MAX_BODY_BYTES): send a shorter prompt or "
           "fewer messages")


@pytest.fixture
async def small_limit() -> AsyncIterator[httpx.AsyncClient]:
    harness = make_harness(max_body_bytes=LIMIT)
    harness.register_model()
    async with harness.client() as client:
        yield client


def _body_of(size: int) -> bytes:
    """A JSON body of exactly `size` bytes: a prompt of one-letter words (one token each)."""
    prefix, suffix = b'{"prompt": "', b'"}'
    words = b"a " * size
    return prefix + words[:size - len(prefix) - len(suffix)] + suffix


async def test_declared_length_over_the_limit_is_413_unread(small_limit: httpx.AsyncClient) -> None:
    response = await small_limit.post("/v1/jobs", content=_body_of(LIMIT + 1),
                                      headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    assert response.json() == {"detail": f"The request body is {LIMIT + 1} bytes{MESSAGE}"}
    assert response.headers["connection"] == "close"


async def test_openai_routes_answer_413_in_openai_shape(small_limit: httpx.AsyncClient) -> None:
    response = await small_limit.post("/v1/chat/completions", content=_body_of(LIMIT * 3),
                                      headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    assert response.json() == {"error": {
        "message": f"The request body is {LIMIT * 3} bytes{MESSAGE}",
        "type": "invalid_request_error", "param": None, "code": "request_too_large"}}


async def test_chunked_body_is_counted_as_it_arrives(small_limit: httpx.AsyncClient) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(10):
            yield b"x" * 1000

    response = await small_limit.post("/v1/jobs", content=chunks(),
                                      headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    assert response.json() == {"detail": f"The request body is over {LIMIT} bytes{MESSAGE}"}


async def test_a_body_at_the_limit_reaches_the_route(small_limit: httpx.AsyncClient) -> None:
    response = await small_limit.post("/v1/jobs", content=_body_of(LIMIT),
                                      headers={"Content-Type": "application/json"})
    # Through to validation: the test model's context (32 tokens) is what refuses it.
    assert response.status_code == 422
    assert response.json()["detail"][0]["type"] == "context_length_exceeded"


async def test_chunked_body_under_the_limit_is_replayed_whole(
        small_limit: httpx.AsyncClient) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for piece in (b'{"prompt": ', b'"hello", "max_tokens"', b": 2}"):
            yield piece

    response = await small_limit.post("/v1/jobs", content=chunks(),
                                      headers={"Content-Type": "application/json"})
    assert response.status_code == 202
    assert response.json()["max_tokens"] == 2


async def test_requests_without_a_body_pass_untouched(small_limit: httpx.AsyncClient) -> None:
    assert (await small_limit.get("/healthz")).status_code == 200
    assert (await small_limit.get("/v1/jobs/nope")).status_code == 404
