"""CORS: a web page on another origin may call the API from a browser (vLLM's default), reading
the answer headers it needs; CARPOOL_CORS_ALLOWED_ORIGINS narrows or turns it off."""

from __future__ import annotations

import pytest
from api_support import KEY_A, make_harness

from api.settings import ApiSettings

pytestmark = pytest.mark.anyio
PAGE = "https://ui.example.com"
PREFLIGHT = {"Origin": PAGE, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


async def test_any_origin_by_default_with_the_job_headers_readable() -> None:
    harness = make_harness()
    harness.register_model()
    async with harness.client() as client:
        preflight = await client.options("/v1/jobs", headers=PREFLIGHT)
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "*"
        assert "POST" in preflight.headers["access-control-allow-methods"]
        assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
        submitted = await client.post("/v1/jobs", json={"prompt": "hello"}, headers={"Origin": PAGE})
        assert submitted.status_code == 202
        assert submitted.headers["access-control-allow-origin"] == "*"
        exposed = submitted.headers["access-control-expose-headers"].lower()
        assert "x-carpool-job-id" in exposed and "retry-after" in exposed
        # An error reaches the page too (it can read why), not only an opaque CORS failure.
        refused = await client.post("/v1/jobs", json={"prompt": "hello", "max_tokens": 0},
                                    headers={"Origin": PAGE})
        assert refused.status_code == 422
        assert refused.headers["access-control-allow-origin"] == "*"


async def test_keys_still_apply_to_a_page() -> None:
    harness = make_harness(api_keys=[KEY_A])
    harness.register_model()
    async with harness.client() as client:
        preflight = await client.options("/v1/jobs", headers=PREFLIGHT)
        assert preflight.status_code == 200  # the browser asks without the key
        denied = await client.post("/v1/jobs", json={"prompt": "hello"}, headers={"Origin": PAGE})
        assert denied.status_code == 401
        assert denied.headers["access-control-allow-origin"] == "*"


async def test_named_origins_only_and_none_at_all() -> None:
    harness = make_harness(cors_allowed_origins=[PAGE])
    async with harness.client() as client:
        allowed = await client.options("/v1/jobs", headers=PREFLIGHT)
        assert allowed.headers["access-control-allow-origin"] == PAGE
        other = await client.options("/v1/jobs", headers={**PREFLIGHT, "Origin": "https://evil.test"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    harness = make_harness(cors_allowed_origins=[])
    async with harness.client() as client:
        answer = await client.get("/healthz", headers={"Origin": PAGE})
        assert "access-control-allow-origin" not in answer.headers


def test_the_setting_is_a_comma_separated_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CARPOOL_CORS_ALLOWED_ORIGINS", f"{PAGE}, http://localhost:3000")
    assert ApiSettings().cors_allowed_origins == [PAGE, "http://localhost:3000"]
    monkeypatch.setenv("CARPOOL_CORS_ALLOWED_ORIGINS", "")
    assert ApiSettings().cors_allowed_origins == []
