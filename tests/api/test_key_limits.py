"""Per-key limits (queued jobs, tokens per minute): 429 with Retry-After and a body naming the
limit, exact under bursts; and the fair-share weight each key's submissions write."""

from __future__ import annotations

import asyncio
import math
import re
import time

import pytest
from api_support import KEY_A, KEY_B, MODEL, Harness, make_harness

from api.auth import owner_id
from protocol.rq_keys import RQKeys

pytestmark = pytest.mark.anyio

OWNER_A, OWNER_B = owner_id(KEY_A), owner_id(KEY_B)


def _harness(**settings: object) -> Harness:
    harness = make_harness(api_keys=[KEY_A, KEY_B], **settings)
    harness.register_model()
    return harness


def _queued(harness: Harness) -> list[str]:
    return [job_id for name in harness.keys.queue_names(MODEL)
            for job_id in harness.sync.lrange(RQKeys.queue(name), 0, -1)]


async def test_queued_jobs_per_key_answers_429_naming_the_limit() -> None:
    harness = _harness(max_queued_jobs_per_key=2, retry_after_s=3)
    async with harness.client(KEY_A) as a, harness.client(KEY_B) as b:
        for priority in ("high", "low"):  # every priority of the model counts
            assert (await a.post("/v1/jobs", json={"prompt": "hello", "priority": priority})
                    ).status_code == 202
        refused = await a.post("/v1/jobs", json={"prompt": "hello"})
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "3"
        assert refused.json() == {"detail": (
            "This API key has 2 jobs waiting for model 'tiny', its limit is 2 "
            "(max_queued_jobs_per_key); retry once some have started")}
        openai = await a.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})
        assert openai.status_code == 429
        assert openai.headers["retry-after"] == "3"
        assert openai.json() == {"error": {
            "message": "This API key has 2 jobs waiting for model 'tiny', its limit is 2 "
                       "(max_queued_jobs_per_key); retry once some have started",
            "type": "rate_limit_error", "param": None, "code": "queued_jobs_per_key_exceeded"}}
        # The other key has a limit of its own.
        assert (await b.post("/v1/jobs", json={"prompt": "hello"})).status_code == 202
        # A job of the key leaving the queue (a worker took it) makes room again.
        await harness.take_job()
        assert (await a.post("/v1/jobs", json={"prompt": "hello"})).status_code == 202
    assert len(_queued(harness)) == 3


async def test_a_key_of_its_own_limit_and_n_choices_counted_whole() -> None:
    harness = _harness(key_max_queued_jobs={KEY_B: 3})
    async with harness.client(KEY_A) as a, harness.client(KEY_B) as b:
        for _ in range(2):
            assert (await b.post("/v1/jobs", json={"prompt": "hello"})).status_code == 202
        refused = await b.post("/v1/jobs", json={"prompt": "hello", "n": 2})
        assert refused.status_code == 429
        assert refused.json()["detail"] == (
            "This API key has 2 jobs waiting for model 'tiny', its limit is 3 "
            "(max_queued_jobs_per_key) for 2 more jobs; retry once some have started")
        for _ in range(5):  # A has no limit
            assert (await a.post("/v1/jobs", json={"prompt": "hello"})).status_code == 202


async def test_a_burst_of_one_key_cannot_overshoot_its_queued_limit() -> None:
    harness = _harness(max_queued_jobs_per_key=4)
    async with harness.client(KEY_A) as a:
        responses = await asyncio.gather(*(
            a.post("/v1/jobs", json={"prompt": "hello"}) for _ in range(30)))
    assert sorted(r.status_code for r in responses) == [202] * 4 + [429] * 26
    assert len(_queued(harness)) == 4


async def test_tokens_per_minute_answers_429_with_the_wait_in_retry_after() -> None:
    # "hello" is one token of the word tokenizer: a job with max_tokens 10 asks for 11.
    harness = _harness(tokens_per_minute_per_key=30)
    async with harness.client(KEY_A) as a, harness.client(KEY_B) as b:
        for _ in range(2):
            assert (await a.post("/v1/jobs", json={"prompt": "hello", "max_tokens": 10})
                    ).status_code == 202
        refused = await a.post("/v1/jobs", json={"prompt": "hello", "max_tokens": 10})
        assert refused.status_code == 429
        retry_after = int(refused.headers["retry-after"])
        assert 55 <= retry_after <= 60  # the first submission leaves the minute then
        assert refused.json() == {"detail": (
            f"This API key's limit is 30 tokens per minute (tokens_per_minute_per_key: prompt + "
            f"max_tokens of each job); it submitted 22 in the last minute and this request needs "
            f"11; retry after {retry_after} s")}
        openai = await a.post("/v1/completions", json={"prompt": "hello", "max_tokens": 10})
        assert openai.status_code == 429
        assert openai.json()["error"]["code"] == "tokens_per_minute_exceeded"
        assert openai.json()["error"]["type"] == "rate_limit_error"
        # A smaller request still fits what is left of the minute; B has its own minute.
        assert (await a.post("/v1/jobs", json={"prompt": "hello", "max_tokens": 7})
                ).status_code == 202
        assert (await b.post("/v1/jobs", json={"prompt": "hello", "max_tokens": 28})
                ).status_code == 202


async def test_retry_after_counts_until_enough_of_the_minute_has_passed() -> None:
    harness = _harness(key_tokens_per_minute={KEY_A: 100})
    now_ms = int(time.time() * 1000)
    log = harness.keys.owner_token_log(OWNER_A)
    # Submitted 61 s ago (gone from the window), 52 s ago and 30 s ago. "y" leaves the window
    # 8 s after this, a margin a loaded CI does not eat (half a second once did).
    y_leaves_ms = now_ms - 52_000 + 60_000
    harness.sync.zadd(log, {"x:90": now_ms - 61_000, "y:60": y_leaves_ms - 60_000,
                            "z:30": now_ms - 30_000})
    async with harness.client(KEY_A) as a:
        asked_ms = time.time() * 1000
        refused = await a.post("/v1/jobs", json={"prompt": "hello", "max_tokens": 19})
        answered_ms = time.time() * 1000
        assert refused.status_code == 429
        # 90 used + 20 asked > 100; once "y" leaves 30 + 20 fit: Retry-After is the whole
        # seconds until then, as of the moment the check ran (between asking and the answer).
        assert math.ceil((y_leaves_ms - answered_ms) / 1000) \
            <= int(refused.headers["retry-after"]) \
            <= math.ceil((y_leaves_ms - asked_ms) / 1000)
        assert "it submitted 90 in the last minute and this request needs 20" in \
            refused.json()["detail"]


async def test_a_request_larger_than_the_minute_is_a_clear_4xx() -> None:
    harness = _harness(tokens_per_minute_per_key=20)
    async with harness.client(KEY_A) as a:
        response = await a.post("/v1/completions", json={"prompt": "hello", "max_tokens": 25})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_tokens"
    assert response.json()["error"]["message"] == (
        "This request needs 26 tokens (prompt + max_tokens over its 1 job(s)), more than this API "
        "key may submit in a minute (20, tokens_per_minute_per_key); lower max_tokens or the prompt")
    assert _queued(harness) == []


async def test_each_submission_writes_its_key_fair_share_weight() -> None:
    harness = _harness(key_weights={KEY_A: 2.5}, default_key_weight=1.5)
    async with harness.client(KEY_A) as a, harness.client(KEY_B) as b:
        assert (await a.post("/v1/jobs", json={"prompt": "hello"})).status_code == 202
        assert (await b.post("/v1/jobs", json={"prompt": "hello"})).status_code == 202
    assert harness.sync.hgetall(harness.keys.fair_weights()) == {OWNER_A: "2.5", OWNER_B: "1.5"}


def test_per_key_settings_come_as_key_value_pairs(monkeypatch: pytest.MonkeyPatch) -> None:
    from api.settings import ApiSettings

    monkeypatch.setenv("CARPOOL_API_KEYS", "k1,k2=")
    monkeypatch.setenv("CARPOOL_KEY_WEIGHTS", "k1=2, k2==0.5")  # a key may end in '='
    monkeypatch.setenv("CARPOOL_KEY_TOKENS_PER_MINUTE", "k2==1000")
    settings = ApiSettings()
    assert settings.key_weights == {"k1": 2.0, "k2=": 0.5}
    assert settings.key_tokens_per_minute == {"k2=": 1000}


@pytest.mark.parametrize(("value", "message"), [
    ("k3=1", "key_weights names 1 key(s) that are not in api_keys"),
    ("k1=0", "key_weights must be > 0 for every key"),
    ("k1", "expected key=value pairs separated by commas, got 'k1'"),
])
def test_bad_per_key_settings_name_what_to_fix(monkeypatch: pytest.MonkeyPatch, value: str,
                                               message: str) -> None:
    from pydantic import ValidationError

    from api.settings import ApiSettings

    monkeypatch.setenv("CARPOOL_API_KEYS", "k1,k2")
    monkeypatch.setenv("CARPOOL_KEY_WEIGHTS", value)
    with pytest.raises(ValidationError, match=re.escape(message)):
        ApiSettings()
