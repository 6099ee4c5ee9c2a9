"""API keys: 401 without a valid key, and jobs visible only to the key that made them."""

from __future__ import annotations

import importlib.metadata
import logging

import pytest
from api_support import KEY_A, KEY_B, Harness
from rq.job import Job
from rq.serializers import JSONSerializer

from api.app import create_app
from api.auth import owner_id
from api.settings import ApiSettings

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/v1/jobs"), ("GET", "/v1/jobs/x"), ("GET", "/v1/jobs/x/stream"),
    ("DELETE", "/v1/jobs/x"), ("GET", "/v1/models"), ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"), ("GET", "/metrics"), ("GET", "/v1/stats"),
])
async def test_every_route_but_healthz_needs_a_key(keyed_harness: Harness, method: str,
                                                   path: str) -> None:
    async with keyed_harness.client() as client:
        missing = await client.request(method, path, json={"prompt": "hello"})
    async with keyed_harness.client("wrong-key") as client:
        wrong = await client.request(method, path, json={"prompt": "hello"})
    for response in (missing, wrong):
        assert response.status_code == 401
        assert response.headers["www-authenticate"] == "Bearer"
    detail = missing.json()
    message = detail["error"]["message"] if "error" in detail else detail["detail"]
    assert message == "Missing API key: send it as 'Authorization: Bearer <key>' (or 'x-api-key: <key>')"
    wrong_body = wrong.json()
    wrong_message = wrong_body["error"]["message"] if "error" in wrong_body else wrong_body["detail"]
    assert wrong_message == "Invalid API key: it is not one of the keys this server accepts"


async def test_openai_routes_answer_401_in_openai_shape(keyed_harness: Harness) -> None:
    async with keyed_harness.client("wrong-key") as client:
        response = await client.post("/v1/chat/completions", json={})
    assert response.json() == {"error": {
        "message": "Invalid API key: it is not one of the keys this server accepts",
        "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}


async def test_malformed_authorization_header(keyed_harness: Harness) -> None:
    async with keyed_harness.client() as client:
        response = await client.get("/v1/models", headers={"Authorization": "Basic abc"})
    assert response.status_code == 401
    assert response.json()["error"]["message"] == (
        "Malformed Authorization header: expected 'Bearer <key>'")


@pytest.mark.parametrize("header", ["Bearer ", "Bearer", "Basic Zm9vOmJhcg==", "Bearer EMPTY"])
async def test_an_open_api_ignores_the_authorization_header(harness: Harness, header: str) -> None:
    # lm-eval's API models send "Bearer " with no key configured; vLLM without --api-key and
    # Carpool without keys read no header at all.
    async with harness.client() as client:
        response = await client.post("/v1/jobs", json={"prompt": "hello"},
                                     headers={"Authorization": header})
    assert response.status_code == 202
    assert harness.state(response.json()["job_id"]).owner == ""


async def test_healthz_and_docs_stay_open(keyed_harness: Harness) -> None:
    async with keyed_harness.client() as client:
        assert (await client.get("/healthz")).status_code == 200
        assert (await client.get("/health")).status_code == 200  # vLLM's paths, for its probes
        assert (await client.get("/version")).json() == {"version": importlib.metadata.version("carpool")}
        assert (await client.get("/openapi.json")).status_code == 200


async def test_another_keys_job_is_404_everywhere(keyed_harness: Harness) -> None:
    async with keyed_harness.client(KEY_A) as a, keyed_harness.client(KEY_B) as b:
        response = await a.post("/v1/jobs", json={"prompt": "hello"})
        assert response.status_code == 202
        job_id = response.json()["job_id"]
        keyed_harness.finish_job(job_id, ["x"])
        for method, path in (("GET", f"/v1/jobs/{job_id}"), ("GET", f"/v1/jobs/{job_id}/stream"),
                             ("DELETE", f"/v1/jobs/{job_id}")):
            other = await b.request(method, path)
            assert other.status_code == 404, (method, path)
            assert other.json() == {"detail": f"No job with id '{job_id}'"}
        assert (await a.get(f"/v1/jobs/{job_id}")).status_code == 200
        assert (await a.get(f"/v1/jobs/{job_id}/stream")).status_code == 200
        assert (await a.delete(f"/v1/jobs/{job_id}")).status_code == 200


async def test_job_records_a_non_secret_owner_id(keyed_harness: Harness) -> None:
    async with keyed_harness.client(KEY_A) as client:
        job_id = (await client.post("/v1/jobs", json={"prompt": "hello"})).json()["job_id"]
    spec = Job.fetch(job_id, connection=keyed_harness.context.sync,
                     serializer=JSONSerializer).args[0]
    assert spec["owner"] == owner_id(KEY_A)
    assert spec["owner"].startswith("key-") and KEY_A not in spec["owner"]
    assert keyed_harness.state(job_id).owner == owner_id(KEY_A)
    assert owner_id(KEY_A) != owner_id(KEY_B)


def test_open_mode_says_so_at_start(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="api.app"):
        create_app(ApiSettings())
    assert any("the API is OPEN" in record.message for record in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="api.app"):
        create_app(ApiSettings(api_keys=[KEY_A]))
    assert not any("OPEN" in record.message for record in caplog.records)
