"""Bad input against the real API process (uvicorn, a private redis-server, a real worker on the
tiny model): hand-written abuse, then a schema-driven fuzzer (schemathesis) over every route.

No 5xx, no hung request, every 4xx says what to fix in its route family's shape (422 on the jobs
routes, 400 in OpenAI's error shape on the OpenAI routes, 400 in Anthropic's on its Messages
routes, 422 in TGI's on the Text Generation Inference routes, 413 past the body limit), and the
worker that consumed whatever the API accepted is alive, failed none of it, and still serves a
job.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from redis import Redis
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from api.fields import MAX_STOP_STRING_CHARS, SEED_MAX, SEED_MIN
from protocol import JobReader, JobStatus
from tests.integration.conftest import WorkerProcess, wait_until
from tests.reliability.api_support import (
    ApiProcess,
    report,
    sse_events,
    start_redis,
    start_worker,
    stop_redis,
)

pytestmark = pytest.mark.reliability

API_KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# A 64-token context: a fuzzed completion that generates to the end of it takes well under a second.
MODEL_LEN = 64
WORKER_ARGS = ["--max-model-len", str(MODEL_LEN), "--max-num-seqs", "8", "--num-threads", "1",
               "--idle-block-seconds", "0.2"]
BODY_LIMIT = 2 * 1024 * 1024  # ApiSettings.max_body_bytes' default, which this API runs with
CALL_TIMEOUT_S = 20.0  # a request slower than this counts as hung
# Examples per generation mode: negative cases are all rejected in milliseconds, positive ones
# may generate up to MODEL_LEN tokens each.
POSITIVE_EXAMPLES = 150
NEGATIVE_EXAMPLES = 500

JSON = {"Content-Type": "application/json"}
OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize",
                "/detokenize", "/v1/files", "/v1/batches", "/v1/responses", "/v1/conversations",
                "/invocations")
TGI_PATHS = ("/generate", "/generate_stream", "/info")
ANTHROPIC_PATHS = ("/v1/messages",)


def is_tgi(path: str, response: httpx.Response | requests.Response | None = None) -> bool:
    """A TGI route, or /tokenize sent TGI's body (`inputs`), which it answers as TGI does."""
    if path == "/" or path.startswith(TGI_PATHS):  # POST / is TGI's (GET / answers HTML)
        return True
    return path == "/tokenize" and response is not None and "inputs" in _sent_json_object(response)


def _sent_json_object(response: httpx.Response | requests.Response) -> dict[str, Any]:
    sent = response.request.content if isinstance(response, httpx.Response) else response.request.body
    try:
        payload = json.loads(sent or b"")
    except (ValueError, TypeError):
        return {}
    return payload if isinstance(payload, dict) else {}


@dataclass(slots=True)
class FuzzStack:
    api: ApiProcess
    worker: WorkerProcess
    redis: Redis
    model: str
    finished_job: str  # a job that ran to its end, for the stream cases
    accepted: list[str] = field(default_factory=list)  # every job the API took, by any route
    num_requests: int = 0

    def client(self, **headers: str) -> httpx.Client:
        return httpx.Client(base_url=self.api.url, headers={**AUTH, **headers},
                            timeout=httpx.Timeout(CALL_TIMEOUT_S))

    def note_accepted(self, status: int, headers: Mapping[str, Any], body: Callable[[], Any]
                      ) -> None:
        """Record the job a response says was accepted (202 from /v1/jobs, or any answer of an
        OpenAI completion, which names its job in X-Carpool-Job-Id)."""
        job_id = headers.get("x-carpool-job-id")
        if isinstance(job_id, list):  # schemathesis' responses list every header's values
            job_id = job_id[0]
        if job_id is None and status == 202 and "json" in str(headers.get("content-type")):
            job_id = body().get("job_id")
        if job_id is not None and job_id not in self.accepted:
            self.accepted.append(job_id)


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FuzzStack]:
    directory = tmp_path_factory.mktemp("api-fuzz")
    server = start_redis(directory / "redis")
    worker: WorkerProcess | None = None
    api: ApiProcess | None = None
    try:
        worker = start_worker("fuzz-worker", server.url, tiny_llama_dir, directory, WORKER_ARGS)
        api = ApiProcess.start(server.url, directory / "api.log", api_keys=API_KEY,
                               stream_block_ms="200", sse_keepalive_s="1")
        api.wait_healthy(min_workers=1)
        with httpx.Client(base_url=api.url, headers=AUTH, timeout=CALL_TIMEOUT_S) as client:
            job_id = client.post("/v1/jobs", json={"prompt": "Hello", "max_tokens": 4,
                                                   "ignore_eos": True}).json()["job_id"]
            wait_until(lambda: client.get(f"/v1/jobs/{job_id}").json()["status"] == "finished",
                       60, "the first job to finish", lambda: api.log() + worker.log())
        yield FuzzStack(api=api, worker=worker, redis=Redis.from_url(server.url),
                        model=tiny_llama_dir.name, finished_job=job_id, accepted=[job_id])
    finally:
        if api is not None:
            api.stop()
        if worker is not None:
            worker.stop()
        stop_redis(server)


# -- hand-written abuse ----------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Abuse:
    """One bad request and the exact answer it must get (`{job}` in a path: a finished job)."""

    name: str
    method: str
    path: str
    status: int
    words: str  # what the error message must say (for 2xx: what the body must contain)
    body: Any = None  # JSON-encoded unless bytes or a callable making chunks
    headers: dict[str, str | bytes] = field(default_factory=dict)
    params: dict[str, str] = field(default_factory=dict)


def _chunks(total: int, size: int = 100_000) -> Callable[[], Iterator[bytes]]:
    def chunks() -> Iterator[bytes]:
        for _ in range(total // size):
            yield b"x" * size
    return chunks


def _nested(depth: int) -> bytes:
    return b'{"prompt": "x", "stop": ' + b"[" * depth + b"]" * depth + b"}"


CHAT = [{"role": "user", "content": "What is 2+2?"}]
TOO_LARGE = f"the limit is {BODY_LIMIT} bytes (CARPOOL_MAX_BODY_BYTES)"
ABUSES = [
    # Huge bodies: refused unread past the limit, declared or chunked, in each route's shape.
    Abuse("10MB-json", "POST", "/v1/jobs", 413, TOO_LARGE, {"prompt": "x" * 10_000_000}),
    Abuse("10MB-chunked", "POST", "/v1/jobs", 413, f"is over {BODY_LIMIT} bytes",
          _chunks(10_000_000), headers=JSON),
    Abuse("10MB-chat", "POST", "/v1/chat/completions", 413, TOO_LARGE,
          {"messages": [{"role": "user", "content": "x" * 10_000_000}]}),
    Abuse("10MB-garbage", "POST", "/v1/completions", 413, TOO_LARGE, b"[" * 10_000_000, JSON),
    # A 1M-character prompt fits the body limit and is measured against the model's context.
    Abuse("1M-char-prompt", "POST", "/v1/jobs", 422,
          f"context length of {MODEL_LEN} tokens", {"prompt": "hello " * 166_667}),
    Abuse("1M-char-completion", "POST", "/v1/completions", 400,
          f"context length of {MODEL_LEN} tokens", {"prompt": "hello " * 166_667}),
    # Wrong types (numbers and flags are strict: no "16", no true-for-1).
    Abuse("prompt-int", "POST", "/v1/jobs", 422, "valid string", {"prompt": 123}),
    Abuse("max-tokens-str", "POST", "/v1/jobs", 422, "valid integer",
          {"prompt": "x", "max_tokens": "16"}),
    Abuse("messages-str", "POST", "/v1/jobs", 422, "valid list", {"messages": "hi"}),
    Abuse("temperature-bool", "POST", "/v1/jobs", 422, "valid number",
          {"prompt": "x", "temperature": True}),
    Abuse("stream-str", "POST", "/v1/chat/completions", 400, "'stream': Input should be a valid "
          "boolean", {"messages": CHAT, "stream": "yes"}),
    Abuse("store-float", "POST", "/v1/chat/completions", 400, "valid boolean",
          {"messages": CHAT, "store": 0.0}),
    # Invalid UTF-8 in the body.
    Abuse("utf8-jobs", "POST", "/v1/jobs", 422, "byte 0xff at position 12 is not UTF-8",
          b'{"prompt": "\xff\xfe"}', JSON),
    Abuse("utf8-chat", "POST", "/v1/chat/completions", 400, "is not UTF-8",
          b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}', JSON),
    # Negative, enormous and non-finite numbers.
    Abuse("max-tokens-1e30", "POST", "/v1/jobs", 422, f"must be at most {MODEL_LEN}",
          {"prompt": "x", "max_tokens": 10**30}),
    Abuse("max-tokens-1e30-openai", "POST", "/v1/completions", 400,
          f"'max_tokens' must be at most {MODEL_LEN}", {"prompt": "x", "max_tokens": 10**30}),
    Abuse("max-tokens-0", "POST", "/v1/jobs", 422, "greater than or equal to 1",
          {"prompt": "x", "max_tokens": 0}),
    Abuse("temperature-neg", "POST", "/v1/jobs", 422, "greater than or equal to 0",
          {"prompt": "x", "temperature": -1}),
    Abuse("top-p-2", "POST", "/v1/jobs", 422, "less than or equal to 1",
          {"prompt": "x", "top_p": 2}),
    Abuse("top-k-neg", "POST", "/v1/chat/completions", 400, "greater than or equal to 0",
          {"messages": CHAT, "top_k": -5}),
    Abuse("temperature-nan", "POST", "/v1/jobs", 422, "less than or equal to 2",
          b'{"prompt": "x", "temperature": NaN}', JSON),
    Abuse("max-tokens-inf", "POST", "/v1/jobs", 422, "valid integer",
          b'{"prompt": "x", "max_tokens": Infinity}', JSON),
    Abuse("top-p-neg-inf", "POST", "/v1/completions", 400, "greater than 0",
          b'{"prompt": "x", "top_p": -Infinity}', JSON),
    Abuse("temperature-1e400", "POST", "/v1/jobs", 422, "less than or equal to 2",
          b'{"prompt": "x", "temperature": 1e400}', JSON),
    Abuse("seed-neg", "POST", "/v1/jobs", 422, f"greater than or equal to {SEED_MIN}",
          {"prompt": "x", "seed": -1}),
    Abuse("seed-2**64", "POST", "/v1/completions", 400, f"less than or equal to {SEED_MAX}",
          {"prompt": "x", "seed": 2**64}),
    Abuse("5000-digits", "POST", "/v1/jobs", 422, "a number has more than 4300 digits",
          b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", JSON),
    Abuse("stop-too-long", "POST", "/v1/jobs", 422,
          f"at most {MAX_STOP_STRING_CHARS} characters",
          {"prompt": "x", "stop": ["s" * (MAX_STOP_STRING_CHARS + 1)]}),
    # Structure: nesting, unknown fields, broken JSON, wrong or no content type, no body.
    Abuse("nested-100k", "POST", "/v1/jobs", 422, "nested too deeply", _nested(100_000), JSON),
    Abuse("nested-900", "POST", "/v1/jobs", 422, "valid string", _nested(900), JSON),
    Abuse("unknown-field", "POST", "/v1/jobs", 422, "Extra inputs are not permitted",
          {"prompt": "x", "bogus": 1}),
    Abuse("unknown-field-openai", "POST", "/v1/chat/completions", 400,
          "Unrecognized request argument supplied: bogus", {"messages": CHAT, "bogus": 1}),
    Abuse("malformed", "POST", "/v1/jobs", 422, "not valid JSON (Expecting value at character 11)",
          b'{"prompt": ', JSON),
    Abuse("malformed-openai", "POST", "/v1/completions", 400, "not valid JSON",
          b'{"prompt": "x",}', JSON),
    Abuse("text-plain", "POST", "/v1/jobs", 422, "'Content-Type: application/json' (got "
          "Content-Type 'text/plain')", b'{"prompt": "x"}', {"Content-Type": "text/plain"}),
    Abuse("form-openai", "POST", "/v1/chat/completions", 400, "'Content-Type: application/json'",
          b"messages=hi", {"Content-Type": "application/x-www-form-urlencoded"}),
    Abuse("no-body", "POST", "/v1/jobs", 422, "The request body is missing"),
    Abuse("array-body", "POST", "/v1/jobs", 422, "valid dictionary", [1, 2]),
    Abuse("n-17", "POST", "/v1/chat/completions", 400, "at most 16 choices per prompt",
          {"messages": CHAT, "n": 17}),
    Abuse("prompt-id-oov", "POST", "/v1/completions", 400, "outside the vocabulary",
          {"prompt": [1, 10**9]}),
    # Last-Event-ID and `after`: what Redis would refuse mid-stream is a 422 up front.
    Abuse("lei-word", "GET", "/v1/jobs/{job}/stream", 422, "'Last-Event-ID' must be an event id",
          headers={"Last-Event-ID": "abc"}),
    Abuse("lei-2**64", "GET", "/v1/jobs/{job}/stream", 422, "must be an event id",
          headers={"Last-Event-ID": "0-18446744073709551616"}),
    Abuse("lei-fullwidth", "GET", "/v1/jobs/{job}/stream", 422, "must be an event id",
          headers={"Last-Event-ID": "\uff11-\uff12".encode()}),
    Abuse("lei-negative", "GET", "/v1/jobs/{job}/stream", 422, "must be an event id",
          headers={"Last-Event-ID": "-1-0"}),
    Abuse("after-three-parts", "GET", "/v1/jobs/{job}/stream", 422,
          "'after' must be an event id", params={"after": "0-1-2"}),
    Abuse("lei-past-the-end", "GET", "/v1/jobs/{job}/stream", 204, "",
          headers={"Last-Event-ID": "0-999"}),
    Abuse("lei-empty", "GET", "/v1/jobs/{job}/stream", 200, "event: done",
          headers={"Last-Event-ID": ""}),
    # Job ids in paths.
    Abuse("id-129-chars", "GET", "/v1/jobs/" + "a" * 129, 422, "at most 128 characters"),
    Abuse("id-traversal", "GET", "/v1/jobs/..%2F..%2Fetc%2Fpasswd", 404,
          "No route GET /v1/jobs/../../etc/passwd: the routes are listed at /docs"),
    Abuse("id-nul", "DELETE", "/v1/jobs/%00", 404, "No job with id"),
    Abuse("id-glob", "GET", "/v1/jobs/*/stream", 404, "No job with id '*'"),
    Abuse("id-unicode", "DELETE", "/v1/jobs/%F0%9F%92%A5", 404, "No job with id"),
    Abuse("id-invalid-percent", "GET", "/v1/jobs/%FF%FE", 404, "No job with id"),
    Abuse("model-unknown", "GET", "/v1/models/gpt-9", 404, "The model 'gpt-9' does not exist"),
    # Keys.
    Abuse("auth-malformed", "GET", "/v1/jobs/{job}", 401, "Malformed Authorization header",
          headers={"Authorization": "Basic Zm9vOmJhcg=="}),
    Abuse("auth-wrong", "POST", "/v1/chat/completions", 401, "Invalid API key",
          {"messages": CHAT}, headers={"Authorization": "Bearer nope"}),
    Abuse("method", "PUT", "/v1/jobs", 405, "PUT is not allowed on /v1/jobs; use GET, POST",
          {"prompt": "x"}),
    # Odd but valid: accepted, and the worker must run them (checked after the fuzz).
    Abuse("top-k-1e30", "POST", "/v1/jobs", 202, '"status":"queued"',
          {"prompt": "x", "top_k": 10**30, "max_tokens": 2, "temperature": 0.5}),
    Abuse("seed-max-stop-max", "POST", "/v1/jobs", 202, '"status":"queued"',
          {"prompt": "x", "seed": SEED_MAX, "temperature": 0.7, "max_tokens": 3,
           "stop": ["s" * MAX_STOP_STRING_CHARS] * 4}),
    Abuse("control-chars", "POST", "/v1/jobs", 202, '"status":"queued"',
          {"prompt": "\x00\x01\u202e\ufeff\U0001f4a5", "max_tokens": 2}),
]


def _send(stack: FuzzStack, abuse: Abuse) -> httpx.Response:
    path = abuse.path.replace("{job}", stack.finished_job)
    kwargs: dict[str, Any] = {"params": abuse.params}
    if callable(abuse.body):
        kwargs["content"] = abuse.body()
    elif isinstance(abuse.body, bytes):
        kwargs["content"] = abuse.body
    elif abuse.body is not None:
        kwargs["json"] = abuse.body
    with stack.client() as client:
        request = client.build_request(abuse.method, path, headers=abuse.headers, **kwargs)
        return client.send(request)


def explanation_problems(path: str, response: httpx.Response | requests.Response) -> list[str]:
    """What is wrong with an answer for a robust API: a 5xx, or an error that does not say what
    to fix in its route family's shape. Empty when the answer is fine."""
    status = response.status_code
    if status >= 500:
        return [f"server error {status}"]
    if status < 400:
        return []
    problems = []
    if status in (429, 503) and "retry-after" not in response.headers:
        problems.append(f"{status} without Retry-After")
    try:
        body = response.json()
    except ValueError:
        return problems + [f"{status} with a body that is not JSON: {response.text[:100]!r}"]
    if path.startswith(ANTHROPIC_PATHS):
        error = body.get("error") if isinstance(body, dict) else None
        if not (body.get("type") == "error" and isinstance(error, dict) and error.get("message")
                and error.get("type")):
            problems.append(f"{status} not in Anthropic's error shape: {body!r:.200}")
        if status == 422:
            problems.append("422 on an Anthropic route (Anthropic answers invalid input with 400)")
        return problems
    if is_tgi(path, response):
        if not (isinstance(body, dict) and isinstance(body.get("error"), str) and body["error"]
                and isinstance(body.get("error_type"), str)):
            problems.append(f"{status} not in TGI's error shape: {body!r:.200}")
        if status == 400:
            problems.append("400 on a TGI route (TGI answers invalid input with 422)")
        return problems
    is_openai = path.startswith(OPENAI_PATHS)
    if is_openai:
        error = body.get("error") if isinstance(body, dict) else None
        if not (isinstance(error, dict) and error.get("message") and error.get("type")):
            problems.append(f"{status} not in OpenAI's error shape: {body!r:.200}")
        if status == 422:
            problems.append("422 on an OpenAI route (OpenAI answers invalid input with 400)")
    else:
        detail = body.get("detail") if isinstance(body, dict) else None
        explained = (isinstance(detail, str) and detail) or (
            isinstance(detail, list) and detail
            and all(isinstance(d, dict) and d.get("msg") and d.get("loc") for d in detail))
        if not explained:
            problems.append(f"{status} without a detail saying what to fix: {body!r:.200}")
        if status == 400:
            problems.append("400 on a jobs route (invalid input is 422 there)")
    return problems


def _message(path: str, response: httpx.Response) -> str:
    body = response.json()
    if is_tgi(path, response):
        return str(body["error"])
    if path.startswith(ANTHROPIC_PATHS):
        return str(body["error"]["message"])
    if path.startswith(OPENAI_PATHS):
        return body["error"]["message"]
    detail = body["detail"]
    return detail if isinstance(detail, str) else detail[0]["msg"]


@pytest.mark.parametrize("abuse", ABUSES, ids=[abuse.name for abuse in ABUSES])
def test_hand_written_bad_input_gets_an_answer_that_says_what_to_fix(
        stack: FuzzStack, abuse: Abuse) -> None:
    started = time.monotonic()
    response = _send(stack, abuse)
    elapsed = time.monotonic() - started
    stack.num_requests += 1
    stack.note_accepted(response.status_code, response.headers, response.json)
    assert response.status_code == abuse.status, response.text[:500]
    assert explanation_problems(abuse.path, response) == []
    if response.status_code >= 400:
        assert abuse.words in _message(abuse.path, response)
    else:
        assert abuse.words in response.text
    assert elapsed < 10.0  # the 1M-character prompt is tokenized in a thread: about a second
    assert stack.api.is_alive, stack.api.log()


# -- schema-driven fuzzing, then the worker --------------------------------------------------------

@dataclass(slots=True)
class FuzzFigures:
    requests: int = 0
    hung: int = 0
    status: Counter[int] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)  # one line each, with a curl to reproduce


def _fuzz(stack: FuzzStack, mode: GenerationMode, max_examples: int,
          figures: FuzzFigures) -> None:
    schema = schemathesis.openapi.from_url(f"{stack.api.url}/openapi.json")
    session = requests.Session()

    # No shrinking and no example database: problems are collected rather than raised, so the
    # run is bounded, and derandomize makes CI see the same cases every run.
    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=schema.as_strategy(generation_mode=mode, headers=AUTH))
    def run(case: Any) -> None:
        figures.requests += 1
        try:
            response = case.call(session=session, timeout=CALL_TIMEOUT_S)
        except requests.Timeout:
            figures.hung += 1
            figures.problems.append(f"hung: {case.as_curl_command()[:300]}")
            return
        figures.status[response.status_code] += 1
        stack.note_accepted(response.status_code, response.headers, response.json)
        found = explanation_problems(case.path, response)
        try:
            # Schemathesis' own checks: status codes, content types, headers and bodies as
            # documented, invalid input refused, keys enforced. Not positive_data_acceptance:
            # the schema cannot express the limits that depend on the model (its context
            # length, its name), so a schema-valid request may rightly get a 4xx.
            case.validate_response(response, excluded_checks=[positive_data_acceptance])
        except BaseExceptionGroup as failures:
            found += [getattr(failure, "title", repr(failure)) for failure in failures.exceptions]
        except AssertionError as failure:  # a single failed check
            found.append(getattr(failure, "title", repr(failure)))
        figures.problems += [f"{problem}: {case.as_curl_command()[:300]} -> "
                             f"{response.status_code} {response.text[:200]}"
                             for problem in found]

    run()


def _normal_job_streams_exactly(stack: FuzzStack, max_tokens: int) -> list[dict[str, str]]:
    with stack.client() as client:
        job = client.post("/v1/jobs", json={"prompt": "The quick brown fox", "temperature": 0.0,
                                            "max_tokens": max_tokens, "ignore_eos": True})
        assert job.status_code == 202, job.text
        with client.stream("GET", f"/v1/jobs/{job.json()['job_id']}/stream") as response:
            assert response.status_code == 200
            return list(sse_events(response.iter_lines()))


def test_fuzzed_api_never_fails_and_the_worker_survives_what_it_accepted(stack: FuzzStack) -> None:
    figures = FuzzFigures()
    num_accepted_before = len(stack.accepted)
    started = time.monotonic()
    _fuzz(stack, GenerationMode.NEGATIVE, NEGATIVE_EXAMPLES, figures)
    _fuzz(stack, GenerationMode.POSITIVE, POSITIVE_EXAMPLES, figures)
    fuzz_s = time.monotonic() - started
    num_accepted_by_fuzz = len(stack.accepted) - num_accepted_before

    # Everything accepted (here and by the hand-written cases) ran on the real worker: none of it
    # may have failed there (the API must refuse what the worker would) or crashed the worker.
    reader = JobReader(stack.redis)

    def all_ended() -> bool:
        states = [reader.state(job_id) for job_id in stack.accepted]
        return all(state is not None and state.status.is_final for state in states)

    def pending() -> str:
        states = {job_id: reader.state(job_id) for job_id in stack.accepted}
        return "\n".join(f"{job_id}: {state}" for job_id, state in states.items()
                         if state is None or not state.status.is_final) + stack.worker.log()

    wait_until(all_ended, 120, f"{len(stack.accepted)} accepted jobs to end", pending)
    states = {job_id: reader.state(job_id) for job_id in stack.accepted}
    failed = {job_id: state.error for job_id, state in states.items()
              if state is not None and state.status is JobStatus.FAILED}
    events = _normal_job_streams_exactly(stack, max_tokens=12)
    num_5xx = sum(count for status, count in figures.status.items() if status >= 500)
    report("api-fuzz", requests=figures.requests + stack.num_requests,
           schema_cases=figures.requests, hand_cases=stack.num_requests, status_5xx=num_5xx,
           hung=figures.hung, problems=len(figures.problems), accepted_jobs=len(stack.accepted),
           accepted_by_fuzz=num_accepted_by_fuzz,
           failed_jobs=len(failed), worker_alive=int(stack.worker.is_alive),
           fuzz_s=round(fuzz_s, 1))

    assert figures.problems == [], "\n".join(figures.problems[:20])
    assert num_5xx == 0 and figures.hung == 0
    assert num_accepted_by_fuzz > 0  # the fuzzer got jobs through to the worker, too
    assert failed == {}
    assert stack.worker.is_alive, stack.worker.log()
    assert stack.api.is_alive, stack.api.log()
    assert [event["id"] for event in events] == [f"0-{i}" for i in range(1, 14)]
    assert [event["event"] for event in events] == ["token"] * 12 + ["done"]
    assert [json.loads(event["data"])["index"] for event in events[:-1]] == list(range(12))
    assert json.loads(events[-1]["data"])["finish_reason"] == "length"


def test_the_api_refuses_what_the_worker_would() -> None:
    # api/fields.py mirrors these limits (api/ may not import worker/): a job the API accepts
    # past them could only fail on the worker, after its 202.
    from protocol.generation import MAX_SEED
    from protocol.generation import MAX_STOP_STRING_CHARS as WORKER_STOP_CHARS

    assert (SEED_MIN, SEED_MAX) == (0, MAX_SEED)
    assert MAX_STOP_STRING_CHARS == WORKER_STOP_CHARS
