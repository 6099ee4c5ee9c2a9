"""/healthz, Redis down (503 + Retry-After), and the catch-all that keeps bugs to a clean 500."""

from __future__ import annotations

import socket
import time

import httpx
import pytest
import redis
import redis.asyncio as aioredis
from api_support import CHAT_TEMPLATE, CONTEXT, MODEL, Harness, word_tokenizer

from api.app import create_app
from api.context import REDIS_RETRIES, AppContext
from api.settings import ApiSettings
from protocol import Keys, ModelCard
from protocol.rq_keys import RQKeys
from tests.conftest import UnsavingRedis

pytestmark = pytest.mark.anyio


async def test_healthz_counts_live_workers(harness: Harness, client: httpx.AsyncClient) -> None:
    assert (await client.get("/healthz")).json() == {
        "status": "no_workers", "redis": True, "workers": 0, "models": [],
        "models_without_workers": ["tiny"]}
    harness.register_model("second")
    harness.add_worker("w1")
    harness.add_worker("w2")
    response = await client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "redis": True, "workers": 2, "models": ["tiny"],
                               "models_without_workers": ["second"]}
    assert (await client.get("/health")).json() == response.json()  # vLLM's path, the same answer


async def test_healthz_skips_registered_workers_without_stats(harness: Harness,
                                                             client: httpx.AsyncClient) -> None:
    harness.add_worker("w1")
    # A worker killed without unregistering, and a plain `rq worker`: no Carpool stats hash.
    harness.sync.sadd(RQKeys.workers_set(), RQKeys.worker("killed"), RQKeys.worker("plain-rq"))
    assert (await client.get("/healthz")).json()["workers"] == 1


async def test_healthz_cost_does_not_grow_with_the_jobs_kept(harness: Harness,
                                                             client: httpx.AsyncClient) -> None:
    harness.add_worker("w1")
    harness.sync.mset({f"carpool:job:{i}": "x" for i in range(5000)})
    commands: list[str] = []
    original = harness.context.aio.execute_command

    async def counting(*args: object, **options: object) -> object:
        commands.append(str(args[0]))
        return await original(*args, **options)

    harness.context.aio.execute_command = counting  # type: ignore[method-assign]
    assert (await client.get("/healthz")).json()["workers"] == 1  # loads the script
    commands.clear()
    assert (await client.get("/healthz")).json()["workers"] == 1
    # One round trip; a SCAN of the keyspace took 25 here, and more with every job kept.
    assert commands == ["EVALSHA"]


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def redis_down_app() -> httpx.AsyncClient:
    url = f"redis://127.0.0.1:{_closed_port()}/0"
    settings = ApiSettings(redis_url=url, redis_timeout_s=0.5, retry_after_s=3)
    app = create_app(settings, AppContext.build(settings))
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://carpool.test")


async def test_redis_down_answers_503_with_retry_after(redis_down_app: httpx.AsyncClient) -> None:
    async with redis_down_app as client:
        health = await client.get("/healthz")
        assert health.status_code == 503
        assert health.headers["retry-after"] == "3"
        assert health.json()["status"] == "redis_unreachable"
        submit = await client.post("/v1/jobs", json={"prompt": "hello"})
        assert submit.status_code == 503
        assert submit.headers["retry-after"] == "3"
        assert "Redis is unreachable" in submit.json()["detail"]
        chat = await client.post("/v1/chat/completions",
                                 json={"messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 503
        assert chat.json()["error"]["type"] == "server_error"
        assert (await client.get("/v1/jobs/abc")).status_code == 503
        assert (await client.get("/metrics")).status_code == 503


def _register_model(client: redis.Redis) -> None:
    """The model card and tokenizer a worker of MODEL writes at its start."""
    card = ModelCard(name=MODEL, max_model_len=CONTEXT, eos_token="<|im_end|>", created_at=1.0,
                     chat_template=CHAT_TEMPLATE)
    client.hset(Keys().models(), MODEL, card.to_json())
    client.set(Keys().model_tokenizer(MODEL), word_tokenizer().to_str())


FULL = "Redis is out of memory (its maxmemory is reached) and takes no new jobs; try again shortly"
UNSAVED = ("Redis cannot save to disk (its last save failed: see its log) and takes no new jobs; "
           "try again shortly")


@pytest.mark.parametrize("refusal", ["maxmemory", "cannot save"])
async def test_a_redis_that_refuses_writes_answers_503_not_500(
        unsaving_redis: UnsavingRedis, redis_url: str, refusal: str) -> None:
    # The session's real Redis refuses every write and still serves reads: at its maxmemory,
    # evicting nothing (as a queue's should run: OOM), or because its last save to disk failed
    # (a full disk: MISCONF).
    own = unsaving_redis.client
    _register_model(own)
    policy = own.config_get("maxmemory-policy")["maxmemory-policy"]
    if refusal == "maxmemory":
        own.config_set("maxmemory-policy", "noeviction")
        own.config_set("maxmemory", 1)  # 1 byte: under what any Redis holds
        message = FULL
    else:
        unsaving_redis.fail_saves()
        message = UNSAVED
    settings = ApiSettings(redis_url=redis_url, retry_after_s=3, batch_runner=False)
    app = create_app(settings, AppContext.build(settings))
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    try:
        async with httpx.AsyncClient(transport=transport,
                                     base_url="http://carpool.test") as client:
            submit = await client.post("/v1/jobs", json={"prompt": "hello"})
            assert (submit.status_code, submit.headers["retry-after"], submit.json()) == (
                503, "3", {"detail": message})
            for stream in (False, True):
                chat = await client.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hello"}], "stream": stream})
                assert (chat.status_code, chat.json()) == (503, {"error": {
                    "message": message, "type": "server_error", "param": None,
                    "code": "service_unavailable"}})
            assert (await client.get("/v1/jobs/none-such")).status_code == 404  # reads work
            own.config_set("maxmemory", 0)
            unsaving_redis.allow_writes()
            assert (await client.post("/v1/jobs", json={"prompt": "hello"})).status_code == 202
    finally:
        own.config_set("maxmemory", 0)
        own.config_set("maxmemory-policy", policy)


async def test_a_bug_answers_a_clean_500(harness: Harness, client: httpx.AsyncClient,
                                         caplog: pytest.LogCaptureFixture) -> None:
    harness.sync.hset(harness.keys.models(), "broken", "{not json")  # a corrupt ModelCard
    response = await client.post("/v1/jobs", json={"prompt": "hello"})
    assert response.status_code == 500
    assert response.json() == {"detail": "Internal server error (logged on the server)"}
    chat = await client.post("/v1/chat/completions",
                             json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 500
    assert chat.json() == {"error": {"message": "Internal server error (logged on the server)",
                                     "type": "server_error", "param": None,
                                     "code": "internal_error"}}
    assert any("unhandled error on POST /v1/jobs" in r.message for r in caplog.records)


async def test_unknown_route_and_method(client: httpx.AsyncClient) -> None:
    # The router's bare "Not Found" / "Method Not Allowed" say what to do instead.
    response = await client.get("/v2/nothing")
    assert response.status_code == 404
    assert response.json() == {"detail": "No route GET /v2/nothing: the routes are listed at /docs "
                                         "(job ids go in /v1/jobs/{job_id}, so they cannot "
                                         "contain '/')"}
    # Under /v1 the same words also come as OpenAI's error object, which OpenAI's clients show.
    response = await client.post("/v1/embeddings", json={"input": "hi"})
    message = ("No route POST /v1/embeddings: the routes are listed at /docs (job ids go in "
               "/v1/jobs/{job_id}, so they cannot contain '/')")
    assert (response.status_code, response.json()) == (404, {
        "detail": message, "error": {"message": message, "type": "invalid_request_error",
                                     "param": None, "code": None}})
    # Allow names every method of the resource, not only its first route's (Starlette's).
    response = await client.put("/v1/jobs")
    assert response.status_code == 405
    assert response.json() == {"detail": "PUT is not allowed on /v1/jobs; use GET, POST"}
    assert response.headers["allow"] == "GET, POST"
    response = await client.options("/v1/chat/completions/chatcmpl-1")
    assert (response.status_code, response.headers["allow"]) == (405, "DELETE, GET, POST")
    assert response.json()["error"]["message"] == (
        "OPTIONS is not allowed on /v1/chat/completions/chatcmpl-1; use DELETE, GET, POST")
    response = await client.post("/healthz")
    assert (response.status_code, response.headers["allow"]) == (405, "GET")


async def test_redis_down_answers_at_once(redis_down_app: httpx.AsyncClient) -> None:
    async with redis_down_app as client:
        started = time.monotonic()
        for _ in range(5):
            assert (await client.get("/v1/models")).status_code == 503
        assert time.monotonic() - started < 1.0


def test_redis_commands_are_not_retried() -> None:
    # Pinned rather than left to redis-py, whose constructor default is 10 retries with backoff.
    ctx = AppContext.build(ApiSettings())
    assert ctx.aio.get_retry().get_retries() == REDIS_RETRIES == 0
    assert ctx.sync.get_retry().get_retries() == REDIS_RETRIES


def test_redis_clients_time_out_past_the_stream_block() -> None:
    settings = ApiSettings(stream_block_ms=2000, redis_timeout_s=1.0)
    ctx = AppContext.build(settings)
    assert isinstance(ctx.aio, aioredis.Redis) and isinstance(ctx.sync, redis.Redis)
    assert ctx.aio.connection_pool.connection_kwargs["socket_timeout"] == 3.0


async def test_healthz_answers_503_when_redis_answers_with_an_error(
        harness: Harness, client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    from api import fleet

    async def refused(*args: object) -> list[object]:
        raise redis.exceptions.ResponseError("DENIED Redis is running in protected mode")

    monkeypatch.setattr(fleet, "live_workers_and_models", refused)
    health = await client.get("/healthz")
    assert health.status_code == 503
    assert health.json() == {"status": "redis_unreachable", "redis": False, "workers": 0,
                             "models": [], "models_without_workers": []}
