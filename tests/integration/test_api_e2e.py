"""End to end: the API (`python -m api`, uvicorn) in front of a real worker on the tiny model and a
real Redis, driven by the official `openai` client and plain HTTP."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from tests.integration.conftest import REPO, Fleet, stream_then_resume, wait_until

pytestmark = pytest.mark.slow

KEY_A = "e2e-key-a"
KEY_B = "e2e-key-b"
WORKER_ARGS = ["--max-num-seqs", "4", "--num-threads", "1", "--idle-block-seconds", "0.2"]
CHAT = [{"role": "user", "content": "What is 2+2?"}]


@dataclass(slots=True)
class ApiServer:
    url: str
    model: str
    process: subprocess.Popen
    log_path: Path

    def client(self, key: str = KEY_A) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {key}"},
                            timeout=60)

    def openai(self, key: str = KEY_A) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=120)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_api(fleet: Fleet, log_dir: Path, env: dict[str, str],
              num_workers: int = 1) -> Iterator[ApiServer]:
    """An API process (`python -m api`) on the fleet's Redis, once it sees `num_workers` workers;
    stopped when the generator closes."""
    port = _free_port()
    log_path = log_dir / "api.log"
    env = {**os.environ, "CARPOOL_STREAM_BLOCK_MS": "200", "PYTHONUNBUFFERED": "1", **env}
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "api", "--host", "127.0.0.1", "--port", str(port),
             "--redis-url", fleet.redis_url], cwd=REPO, env=env, stdout=log,
            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return httpx.get(f"{url}/healthz", timeout=1).json().get("workers", 0) >= num_workers
        except (httpx.HTTPError, ValueError):
            return False

    server = ApiServer(url=url, model=fleet.model_dir.name, process=process, log_path=log_path)
    try:
        wait_until(ready, 120, "the API to see the workers", lambda: server.log() + fleet.logs())
        yield server
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def api(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    fleet.start(("e2e-worker", WORKER_ARGS))
    yield from serve_api(fleet, tmp_path_factory.mktemp("api-log"),
                         {"CARPOOL_API_KEYS": f"{KEY_A},{KEY_B}", "CARPOOL_SSE_KEEPALIVE_S": "1"})


def test_openai_completions_plain_and_streamed_agree(api: ApiServer) -> None:
    client = api.openai()
    plain = client.completions.create(model=api.model, prompt="The quick brown fox",
                                      max_tokens=12, temperature=0.0,
                                      extra_body={"ignore_eos": True})
    assert plain.object == "text_completion"
    assert plain.choices[0].finish_reason == "length"
    assert plain.usage is not None and plain.usage.completion_tokens == 12
    assert plain.usage.prompt_tokens > 0
    stream = client.completions.create(model=api.model, prompt="The quick brown fox",
                                       max_tokens=12, temperature=0.0, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_openai_chat_plain_and_streamed_agree(api: ApiServer) -> None:
    client = api.openai()
    plain = client.chat.completions.create(model=api.model, messages=CHAT, max_tokens=10,  # type: ignore[arg-type]
                                           temperature=0.0)
    assert plain.object == "chat.completion"
    assert plain.choices[0].message.role == "assistant"
    assert plain.choices[0].finish_reason in ("stop", "length")
    assert plain.usage is not None and plain.usage.prompt_tokens > 5
    stream = client.chat.completions.create(model=api.model, messages=CHAT, max_tokens=10,  # type: ignore[arg-type]
                                            temperature=0.0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content


def test_openai_client_gets_a_400_for_an_impossible_request(api: ApiServer) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        api.openai().chat.completions.create(model=api.model, messages=CHAT, max_tokens=5000)  # type: ignore[arg-type]
    assert caught.value.param == "max_tokens"


def test_sse_resume_with_last_event_id(api: ApiServer) -> None:
    with api.client() as client:
        job = client.post("/v1/jobs", json={"prompt": "Once upon a time", "max_tokens": 30,
                                            "temperature": 0.0, "ignore_eos": True}).json()
        first, rest = stream_then_resume(client, job["job_id"], cut_after=5)
        status = client.get(f"/v1/jobs/{job['job_id']}").json()
    events = first + rest
    assert [e["id"] for e in events] == [f"0-{i}" for i in range(1, 32)]
    assert [e["event"] for e in events] == ["token"] * 30 + ["done"]
    text = "".join(json.loads(e["data"])["text"] for e in events[:-1])
    assert status["status"] == "finished" and status["text"] == text
    assert json.loads(events[-1]["data"])["finish_reason"] == "length"
    # The whole stream replays after the end, too.
    with api.client() as client:
        replay = client.get(f"/v1/jobs/{job['job_id']}/stream").text
    assert replay.count("event: token") == 30


def test_keys_isolate_jobs(api: ApiServer) -> None:
    with api.client(KEY_A) as a, api.client(KEY_B) as b:
        job_id = a.post("/v1/jobs", json={"prompt": "Hello", "max_tokens": 2}).json()["job_id"]
        assert b.get(f"/v1/jobs/{job_id}").status_code == 404
        assert b.get(f"/v1/jobs/{job_id}/stream").status_code == 404
        assert b.delete(f"/v1/jobs/{job_id}").status_code == 404
        assert a.get(f"/v1/jobs/{job_id}").status_code == 200
    assert httpx.get(f"{api.url}/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        api.openai("not-a-key").models.list()


def test_client_leaving_a_streamed_completion_cancels_its_job(api: ApiServer) -> None:
    body = {"model": api.model, "messages": CHAT, "max_tokens": 900, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    with api.client() as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            job_id = response.headers["x-carpool-job-id"]
            lines = response.iter_lines()
            chunks = 0
            for line in lines:
                chunks += line.startswith("data:")
                if chunks == 3:
                    break  # hang up after a few tokens
        state = wait_until(
            lambda: (s := client.get(f"/v1/jobs/{job_id}").json())["status"] == "canceled" and s,
            60, "the abandoned job to be canceled", api.log)
    assert state["finish_reason"] == "canceled"
    assert 0 < state["num_tokens"] < 900


def test_metrics_show_the_work(api: ApiServer) -> None:
    with api.client() as client:
        text = client.get("/metrics").text
        health = httpx.get(f"{api.url}/healthz").json()
    assert health["status"] == "ok" and health["workers"] == 1
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert float(samples["carpool_generated_tokens_total"]) > 0
    assert float(samples["carpool_workers"]) == 1
    assert float(samples['carpool_time_to_first_token_seconds_bucket{le="+Inf"}']) > 0
    assert samples['carpool_time_to_first_token_seconds_bucket{le="+Inf"}'] == \
        samples["carpool_time_to_first_token_seconds_count"]


def _chromium() -> str:
    import shutil

    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        pytest.skip("chromium is not installed (apt-get install chromium); .ci/run installs it")
    return binary


def _headless(binary: str, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # The flags keep Chromium off the network this machine does not have (see env notes).
    return subprocess.run(
        [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={profile}", *args],
        capture_output=True, text=True, timeout=120)


def test_playground_streams_a_job_in_a_real_browser(api: ApiServer, tmp_path: Path) -> None:
    import html
    import re
    import urllib.parse

    chromium = _chromium()
    query = urllib.parse.urlencode({"prompt": "What is 2+2?", "key": KEY_A, "max_tokens": 12,
                                    "autorun": "1"})
    page = f"{api.url}/?{query}"
    dom = _headless(chromium, tmp_path / "profile-dom", "--virtual-time-budget=60000",
                    "--dump-dom", page).stdout
    status = re.search(r'id="status"[^>]*data-job-id="([0-9a-f]+)"[^>]*data-finished="(\w+)"', dom)
    assert status, dom[-3000:]
    job_id, finish_reason = status.groups()
    job = api.client().get(f"/v1/jobs/{job_id}").json()
    assert finish_reason == job["finish_reason"] == "length"
    assert job["usage"]["completion_tokens"] == 12
    # The page shows exactly the job's text, token by token as the stream delivered it.
    output = re.search(r'<div id="output">(.*?)</div>', dom, re.S)
    assert output and html.unescape(output.group(1)) == job["text"]
    assert re.search(r'<td class="num" id="workers">1</td>', dom)

    shot = tmp_path / "playground.png"
    _headless(chromium, tmp_path / "profile-shot", "--window-size=1200,800",
              "--virtual-time-budget=60000", f"--screenshot={shot}", page)
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1200, 800)
    assert len(data) > 20_000  # a rendered page, not a blank canvas (a blank one is ~5 kB)


# -- the sampling fields and logprobs (issue 16), through the official client -------------------

SAMPLING_CASES: dict[str, dict[str, Any]] = {
    "penalties": {"temperature": 0.0, "presence_penalty": 0.5, "frequency_penalty": 0.7,
                  "extra_body": {"repetition_penalty": 1.3}},
    "logit_bias": {"temperature": 0.0, "logit_bias": {"30": 4.0, "198": -100}},
    "seeded-top-k-min-p": {"temperature": 0.9, "seed": 5, "extra_body": {"top_k": 8, "min_p": 0.05}},
    "min-tokens-stop-token-ids": {"temperature": 0.0,
                                  "extra_body": {"min_tokens": 4, "stop_token_ids": [30]}},
}


def _sampling_params(case: dict[str, Any], max_tokens: int) -> Any:
    from protocol import SamplingParams

    fields = {k: v for k, v in case.items() if k != "extra_body"} | case.get("extra_body", {})
    return SamplingParams.from_fields({**fields, "max_tokens": max_tokens})


@pytest.mark.parametrize("name", list(SAMPLING_CASES))
def test_openai_sampling_fields_match_the_engine_streamed_or_not(
        api: ApiServer, reference_engine: Any, name: str) -> None:
    case = SAMPLING_CASES[name]
    client = api.openai()
    prompt = "Once upon a time"
    (expected,) = reference_engine.generate([prompt], _sampling_params(case, 12))
    plain = client.completions.create(model=api.model, prompt=prompt, max_tokens=12, **case)
    assert plain.choices[0].text == expected.text
    assert plain.usage is not None and plain.usage.completion_tokens == len(expected.token_ids)
    stream = client.completions.create(model=api.model, prompt=prompt, max_tokens=12, stream=True,
                                       **case)
    assert "".join(c.choices[0].text for c in stream if c.choices) == expected.text
    if name == "min-tokens-stop-token-ids" and 30 in expected.token_ids:
        assert expected.token_ids.index(30) >= 4 and expected.token_ids[-1] == 30


def test_openai_chat_sampling_fields_streamed_or_not(api: ApiServer) -> None:
    client = api.openai()
    case = SAMPLING_CASES["penalties"]
    plain = client.chat.completions.create(model=api.model, messages=CHAT, max_tokens=10, **case)  # type: ignore[arg-type]
    stream = client.chat.completions.create(model=api.model, messages=CHAT, max_tokens=10,  # type: ignore[arg-type]
                                            stream=True, **case)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == plain.choices[0].message.content
    unpenalised = client.chat.completions.create(model=api.model, messages=CHAT, max_tokens=10,  # type: ignore[arg-type]
                                                 temperature=0.0)
    assert unpenalised.choices[0].message.content != plain.choices[0].message.content


def _reference_logprobs(engine: Any, prompt_ids: list[int], params: Any) -> tuple[list[int], list[Any]]:
    engine.add_request("e2e-logprobs", prompt_ids, params)
    tokens, logprobs = [], []
    while engine.has_unfinished():
        for request in engine.step().outputs:
            for entry in request.tokens:
                tokens.append(entry.token_id)
                logprobs.append(entry.logprobs)
    return tokens, logprobs


def test_openai_completion_logprobs_match_the_engine(api: ApiServer, reference_engine: Any) -> None:
    from protocol import SamplingParams

    prompt = "The capital of France is"
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, ignore_eos=True)
    tokens, expected = _reference_logprobs(reference_engine, reference_engine.tokenizer.encode(prompt),
                                           params)
    client = api.openai()
    plain = client.completions.create(model=api.model, prompt=prompt, max_tokens=8, temperature=0.0,
                                      logprobs=3, extra_body={"ignore_eos": True})
    logprobs = plain.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    assert logprobs.token_logprobs == pytest.approx([e.logprob for e in expected], abs=1e-3)
    assert logprobs.tokens == [reference_engine.tokenizer.decode([t]) for t in tokens]
    assert logprobs.top_logprobs is not None
    for top, entry in zip(logprobs.top_logprobs, expected):
        assert sorted(top.values(), reverse=True) == pytest.approx([v for _, v in entry.top], abs=1e-3)
    stream = client.completions.create(model=api.model, prompt=prompt, max_tokens=8, temperature=0.0,
                                       logprobs=3, stream=True, extra_body={"ignore_eos": True})
    streamed: list[float] = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.token_logprobs or []
    assert streamed == logprobs.token_logprobs


def test_openai_completion_echo_with_logprobs_gives_the_prompt_tokens_theirs(
        api: ApiServer, reference_engine: Any, tiny_llama_dir: Path) -> None:
    """echo + logprobs (#16): prompt then completion tokens, the first prompt token's logprob and
    top_logprobs null, the others log_softmax of transformers' logits (fp32), streamed or not."""
    import torch
    from transformers import AutoModelForCausalLM

    prompt = "The capital of France is"
    prompt_ids = reference_engine.tokenizer.encode(prompt)
    client = api.openai()
    plain = client.completions.create(model=api.model, prompt=prompt, max_tokens=4, temperature=0.0,
                                      logprobs=2, echo=True, extra_body={"ignore_eos": True})
    choice = plain.choices[0]
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.tokens is not None and logprobs.top_logprobs is not None
    assert logprobs.token_logprobs is not None and logprobs.text_offset is not None
    n = len(prompt_ids)
    assert len(logprobs.tokens) == n + 4
    assert logprobs.tokens[:n] == [reference_engine.tokenizer.decode([t]) for t in prompt_ids]
    assert choice.text.startswith(prompt)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    offsets = [0]
    for token in logprobs.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs.text_offset == offsets
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = torch.log_softmax(model(torch.tensor([prompt_ids])).logits[0].float(), dim=-1)
    for position in range(1, n):
        row = expected[position - 1]
        assert logprobs.token_logprobs[position] == pytest.approx(row[prompt_ids[position]].item(), abs=1e-3)
        top = logprobs.top_logprobs[position]
        assert top is not None and 2 <= len(top) <= 3
        best = sorted(top.values(), reverse=True)[:2]
        assert best == pytest.approx(row.topk(2).values.tolist(), abs=1e-3)
    stream = client.completions.create(model=api.model, prompt=prompt, max_tokens=4, temperature=0.0,
                                       logprobs=2, echo=True, stream=True, extra_body={"ignore_eos": True})
    chunks = [c for c in stream if c.choices]
    assert chunks[0].choices[0].text == prompt  # the echo chunk carries the prompt's logprobs
    first = chunks[0].choices[0].logprobs
    assert first is not None and first.token_logprobs is not None and len(first.token_logprobs) == n
    streamed_tokens: list[str] = []
    streamed: list[float | None] = []
    for chunk in chunks:
        if chunk.choices[0].logprobs is not None:
            streamed_tokens += chunk.choices[0].logprobs.tokens or []
            streamed += chunk.choices[0].logprobs.token_logprobs or []
    assert (streamed_tokens, streamed) == (logprobs.tokens, logprobs.token_logprobs)
    # max_tokens 0 scores the prompt: the same prompt part, nothing generated shown.
    scored = client.completions.create(model=api.model, prompt=prompt, max_tokens=0,
                                       temperature=0.0, logprobs=2, echo=True)
    scored_logprobs = scored.choices[0].logprobs
    assert scored.choices[0].text == prompt and scored.choices[0].finish_reason == "length"
    assert scored_logprobs is not None
    assert (scored_logprobs.tokens, scored_logprobs.token_logprobs, scored_logprobs.text_offset) == (
        logprobs.tokens[:n], logprobs.token_logprobs[:n], logprobs.text_offset[:n])
    scored_chunks = [c for c in client.completions.create(
        model=api.model, prompt=prompt, max_tokens=0, temperature=0.0, logprobs=2, echo=True,
        stream=True) if c.choices]
    assert [c.choices[0].text for c in scored_chunks] == [prompt, ""]
    assert scored_chunks[0].choices[0].logprobs is not None
    assert scored_chunks[0].choices[0].logprobs.token_logprobs == logprobs.token_logprobs[:n]


def test_sampled_tokens_logprobs_are_the_models_own_as_vllms(api: ApiServer,
                                                             reference_engine: Any) -> None:
    """vLLM's default raw_logprobs, end to end: tokens drawn at temperature 0.8 with a penalty
    carry the logprobs that scoring the same tokens as a prompt (echo) gives them, the model's
    own distribution (as vLLM and OpenAI give them), not the sampler's processed one."""
    prompt_ids = reference_engine.tokenizer.encode("The quick brown fox")
    client = api.openai()
    sampled = client.completions.create(
        model=api.model, prompt=prompt_ids, max_tokens=6, temperature=0.8, seed=11, logprobs=1,
        presence_penalty=1.5, extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = sampled.choices[0]
    token_ids = choice.model_extra["token_ids"]  # type: ignore[index]
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    assert len(token_ids) == len(choice.logprobs.token_logprobs) == 6
    scored = client.completions.create(model=api.model, prompt=prompt_ids + token_ids,
                                       max_tokens=0, logprobs=1, echo=True)
    scored_logprobs = scored.choices[0].logprobs
    assert scored_logprobs is not None and scored_logprobs.token_logprobs is not None
    assert choice.logprobs.token_logprobs == pytest.approx(
        scored_logprobs.token_logprobs[len(prompt_ids):], abs=1e-3)


def test_vllm_prompt_logprobs_field_on_completions_and_chat(api: ApiServer, reference_engine: Any) -> None:
    """vLLM's `prompt_logprobs` (#16): null first, then {token id: {logprob, rank, decoded_token}}
    for the prompt token and the k most likely; on the choice (completions) or the response (chat)."""
    prompt = "The capital of France is"
    prompt_ids = reference_engine.tokenizer.encode(prompt)
    client = api.openai()
    plain = client.completions.create(model=api.model, prompt=prompt, max_tokens=2, temperature=0.0,
                                      extra_body={"prompt_logprobs": 2})
    got = plain.choices[0].model_extra["prompt_logprobs"]  # type: ignore[index]
    assert len(got) == len(prompt_ids) and got[0] is None
    for position, token_id in enumerate(prompt_ids[1:], start=1):
        entries = got[position]
        assert str(token_id) in entries and 2 <= len(entries) <= 3
        assert {e["rank"] for e in entries.values()} >= {1, 2}  # the two most likely
        assert entries[str(token_id)]["decoded_token"] == reference_engine.tokenizer.decode([token_id])
        best = max(entries.values(), key=lambda e: e["logprob"])
        assert best["rank"] == 1
    chat = client.chat.completions.create(model=api.model, messages=CHAT, max_tokens=2,  # type: ignore[arg-type]
                                          extra_body={"prompt_logprobs": 1})
    chat_prompt = chat.model_extra["prompt_logprobs"]  # type: ignore[index]
    assert chat.usage is not None and len(chat_prompt) == chat.usage.prompt_tokens
    assert chat_prompt[0] is None and all(1 <= len(entry) <= 2 for entry in chat_prompt[1:])


def test_prompt_logprobs_over_the_cap_or_streamed_are_400_naming_it(api: ApiServer) -> None:
    client = api.openai()
    for extra in ({"prompt_logprobs": 21}, {"prompt_logprobs": -1}, {"prompt_logprobs": "2"}):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=api.model, prompt="Hi", max_tokens=1, extra_body=extra)
        assert caught.value.body["param"] == "prompt_logprobs", caught.value.body  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=api.model, messages=CHAT, max_tokens=1, stream=True,  # type: ignore[arg-type]
                                       extra_body={"prompt_logprobs": 1})
    assert caught.value.body["param"] == "prompt_logprobs", caught.value.body  # type: ignore[index]


def test_jobs_prompt_logprobs_in_the_status(api: ApiServer, reference_engine: Any) -> None:
    prompt = "Once upon a time"
    prompt_ids = reference_engine.tokenizer.encode(prompt)
    with api.client() as client:
        job = client.post("/v1/jobs", json={"prompt": prompt, "max_tokens": 2, "prompt_logprobs": 1}).json()
        status = wait_until(lambda: (s := client.get(f"/v1/jobs/{job['job_id']}").json())["status"]
                            == "finished" and s, 60, "the job to finish", api.log)
        got = status["prompt_logprobs"]
        assert len(got) == len(prompt_ids) and got[0] is None
        for position, token_id in enumerate(prompt_ids[1:], start=1):
            assert str(token_id) in got[position] and 1 <= len(got[position]) <= 2
            assert min(e["rank"] for e in got[position].values()) == 1
        plain = client.post("/v1/jobs", json={"prompt": prompt, "max_tokens": 1}).json()
        wait_until(lambda: client.get(f"/v1/jobs/{plain['job_id']}").json()["status"] == "finished",
                   60, "the job to finish", api.log)
        assert client.get(f"/v1/jobs/{plain['job_id']}").json()["prompt_logprobs"] is None
        for value in (21, -1, "1"):
            bad = client.post("/v1/jobs", json={"prompt": prompt, "prompt_logprobs": value})
            assert bad.status_code in (400, 422) and "prompt_logprobs" in bad.text, bad.text


def test_openai_chat_logprobs_streamed_or_not(api: ApiServer) -> None:
    client = api.openai()
    plain = client.chat.completions.create(model=api.model, messages=CHAT, max_tokens=8,  # type: ignore[arg-type]
                                           temperature=0.0, logprobs=True, top_logprobs=2)
    assert plain.choices[0].logprobs is not None and plain.choices[0].logprobs.content is not None
    content = plain.choices[0].logprobs.content
    assert plain.usage is not None and len(content) == plain.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token  # greedy: the most likely is the one taken
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.bytes == list(entry.token.encode())
    stream = client.chat.completions.create(model=api.model, messages=CHAT, max_tokens=8,  # type: ignore[arg-type]
                                            temperature=0.0, logprobs=True, top_logprobs=2,
                                            stream=True)
    streamed = [entry for c in stream if c.choices and c.choices[0].logprobs
                for entry in c.choices[0].logprobs.content or []]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


def test_openai_bad_sampling_values_are_400_naming_the_field(api: ApiServer) -> None:
    client = api.openai()
    for kwargs, param in (({"logit_bias": {"999999": 1}}, "logit_bias"),
                          ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                          ({"presence_penalty": 3}, "presence_penalty"),
                          ({"extra_body": {"stop_token_ids": [10**6]}}, "stop_token_ids")):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=api.model, messages=CHAT, max_tokens=4, **kwargs)  # type: ignore[arg-type]
        assert caught.value.param == param, kwargs
class Verdict(BaseModel):
    answer: Literal["yes", "no"]
    confident: bool
    votes: list[Literal["a", "b"]] = Field(max_length=3)


def test_openai_parse_returns_the_pydantic_model_even_from_a_random_model(api: ApiServer) -> None:
    # The tiny model's weights are random: only the grammar makes its output a Verdict.
    for seed in range(3):
        completion = api.openai().chat.completions.parse(
            model=api.model, messages=CHAT, response_format=Verdict, max_tokens=400,  # type: ignore[arg-type]
            temperature=0.8, seed=seed)
        choice = completion.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Verdict)
        assert Verdict.model_validate_json(choice.message.content or "") == choice.message.parsed


def test_openai_client_gets_a_400_for_a_schema_that_does_not_compile(api: ApiServer) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        api.openai().chat.completions.create(
            model=api.model, messages=CHAT,  # type: ignore[arg-type]
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": {"type": "frob"}}})
    assert caught.value.param == "response_format.json_schema.schema"


def test_guided_choice_and_regex_through_extra_body(api: ApiServer) -> None:
    client = api.openai()
    chosen = client.chat.completions.create(model=api.model, messages=CHAT, max_tokens=20,  # type: ignore[arg-type]
                                            extra_body={"guided_choice": ["four", "five"]})
    assert chosen.choices[0].message.content in ("four", "five")
    assert chosen.choices[0].finish_reason == "stop"
    stream = client.completions.create(model=api.model, prompt="2+2=", max_tokens=20, stream=True,
                                       extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert re.fullmatch("[0-9]{3}", text), text


def test_langchain_with_structured_output_returns_the_pydantic_model(api: ApiServer) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(base_url=f"{api.url}/v1", api_key=KEY_A, model=api.model,
                                      max_tokens=400, temperature=0.8, seed=1, max_retries=0)
    verdict = llm.with_structured_output(Verdict, method="json_schema").invoke("Is 2+2 four?")
    assert isinstance(verdict, Verdict)
