"""End to end with a stream interval: a real worker (tiny model) publishing every 150 ms, so most
stream entries are runs of several tokens (protocol/token_runs.py), behind the real API. Clients
see one event per token, exactly the reference engine's, streamed or not, resumed mid-run."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from redis import Redis

from protocol import Keys
from tests.integration.conftest import Fleet, stream_then_resume
from tests.integration.test_api_e2e import KEY_A, ApiServer, serve_api

pytestmark = pytest.mark.slow

INTERVAL_MS = "150"


@pytest.fixture(scope="module")
def api(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    fleet.start(("interval-worker", ["--max-num-seqs", "4", "--num-threads", "1",
                                     "--idle-block-seconds", "0.2",
                                     "--stream-interval-ms", INTERVAL_MS]))
    yield from serve_api(fleet, tmp_path_factory.mktemp("api-log"), {"CARPOOL_API_KEYS": KEY_A})


def _greedy(reference_engine: Any, prompt: str, max_tokens: int) -> list[int]:
    from protocol import SamplingParams

    (completion,) = reference_engine.generate(
        [prompt], [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)])
    return list(completion.token_ids)


def test_events_are_per_token_and_exact_and_resume_inside_a_run(
        api: ApiServer, fleet: Fleet, reference_engine: Any) -> None:
    prompt = "Once upon a time"
    expected = _greedy(reference_engine, prompt, 40)
    with api.client() as client:
        job_id = client.post("/v1/jobs", json={"prompt": prompt, "max_tokens": 40,
                                               "temperature": 0.0, "ignore_eos": True}
                             ).json()["job_id"]
        first, rest = stream_then_resume(client, job_id, cut_after=7)
        status = client.get(f"/v1/jobs/{job_id}").json()
    events = first + rest
    assert [e["id"] for e in events] == [f"0-{i}" for i in range(1, 42)]
    assert [json.loads(e["data"])["token_id"] for e in events[:-1]] == expected
    assert status["text"] == "".join(json.loads(e["data"])["text"] for e in events[:-1])
    # The worker did coalesce: fewer entries than tokens, runs among them.
    raw = Redis.from_url(fleet.redis_url).xrange(Keys().stream(job_id))
    assert len(raw) < 41
    assert b"tokens" in {fields[b"kind"] for _, fields in raw}


def test_the_openai_client_streams_exactly_what_the_engine_generates(
        api: ApiServer, reference_engine: Any) -> None:
    prompt = "The capital of France is"
    expected = _greedy(reference_engine, prompt, 32)
    client = api.openai()
    plain = client.completions.create(model=api.model, prompt=prompt, max_tokens=32,
                                      temperature=0.0, extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model=api.model, prompt=prompt, max_tokens=32,
                                            temperature=0.0, stream=True, logprobs=1,
                                            extra_body={"ignore_eos": True}))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == plain.choices[0].text == reference_engine.tokenizer.decode(expected)
    assert plain.usage.completion_tokens == 32
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs
              for t in c.choices[0].logprobs.tokens]
    assert len(tokens) == 32  # one logprob per token, runs or not
