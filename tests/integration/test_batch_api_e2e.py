"""The Batch API end to end: the official `openai` client against the real API process (its
batch runner included) and real workers on the tiny model, on a Redis of its own with AOF, so a
test can crash it. Greedy outputs are compared with the reference engine's, line by line."""

from __future__ import annotations

import io
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from redis import Redis

from protocol import JobReader, JobState, JobStatus, SamplingParams
from protocol.rq_keys import RQKeys
from tests.conftest import RedisServer, _free_port
from tests.integration.conftest import KEYS, PROMPTS, Fleet, WorkerProcess, wait_until
from tests.integration.test_api_e2e import ApiServer, serve_api

pytestmark = pytest.mark.slow

KEY = "batch-key"
# Short leases: a killed worker's jobs come back within seconds.
WORKER_ARGS = ["--max-num-seqs", "4", "--num-threads", "1", "--idle-block-seconds", "0.2",
               "--lease-seconds", "3"]
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def aof_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(port=_free_port(), directory=tmp_path_factory.mktemp("batch-redis"))
    server.start(appendonly=True, extra_args=("--appendfsync", "always"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def batch_fleet(aof_redis: RedisServer, tiny_llama_dir: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    fleet = Fleet(aof_redis.url, tiny_llama_dir, tmp_path_factory.mktemp("batch-worker-logs"))
    fleet.start(("batch-w1", WORKER_ARGS), ("batch-w2", WORKER_ARGS))
    yield fleet
    fleet.stop_all()


@pytest.fixture(scope="module")
def api(batch_fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    yield from serve_api(batch_fleet, tmp_path_factory.mktemp("batch-api-log"),
                         {"CARPOOL_API_KEYS": KEY, "CARPOOL_BATCH_TICK_S": "0.2"}, num_workers=2)


def _jsonl(url: str, bodies: dict[str, dict[str, Any]]) -> io.BytesIO:
    lines = [json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})
             for custom_id, body in bodies.items()]
    return io.BytesIO(("\n".join(lines) + "\n").encode())


def _run_batch(client: openai.OpenAI, url: str, bodies: dict[str, dict[str, Any]]) -> Any:
    file = client.files.create(file=("input.jsonl", _jsonl(url, bodies)), purpose="batch")
    return client.batches.create(input_file_id=file.id, endpoint=url,  # type: ignore[arg-type]
                                 completion_window="24h", metadata={"test": "yes"})


def _wait_status(client: openai.OpenAI, batch_id: str, statuses: set[str], api: ApiServer,
                 fleet: Fleet, timeout: float = 240.0) -> Any:
    def reached() -> Any:
        try:
            batch = client.batches.retrieve(batch_id)
        except (openai.APIStatusError, openai.APIConnectionError):
            return None  # Redis restarting: the API answers 503 meanwhile
        return batch.status in statuses and batch

    return wait_until(reached, timeout, f"batch {batch_id} to reach {statuses}",
                      lambda: api.log() + fleet.logs())


def _lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def _line_job_ids(redis: Redis, batch_id: str) -> dict[str, list[str]]:
    raw = redis.hgetall(KEYS.batch_lines(batch_id))
    return {json.loads(v)["custom_id"]: json.loads(v)["job_ids"] for v in raw.values()}


def _completion_bodies(model: str, max_tokens: int) -> dict[str, dict[str, Any]]:
    return {f"req-{i}": {"model": model, "prompt": prompt, "max_tokens": max_tokens, **GREEDY}
            for i, prompt in enumerate(PROMPTS)}


def _expected_texts(reference_engine: Any, bodies: dict[str, dict[str, Any]],
                    max_tokens: int) -> dict[str, str]:
    completions = reference_engine.generate(
        [body["prompt"] for body in bodies.values()],
        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return {custom_id: c.text for custom_id, c in zip(bodies, completions)}


def _check_exactly_once(batch: Any, outputs: list[dict[str, Any]], errors: list[dict[str, Any]],
                        custom_ids: set[str]) -> None:
    answered = [line["custom_id"] for line in outputs + errors]
    assert sorted(answered) == sorted(custom_ids)  # every line, once
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (len(custom_ids), len(outputs), len(errors))


def test_a_completions_batch_answers_every_line_as_the_reference_engine(
        api: ApiServer, batch_fleet: Fleet, reference_engine: Any) -> None:
    client = api.openai(KEY)
    bodies = _completion_bodies(api.model, max_tokens=8)
    batch = _run_batch(client, "/v1/completions", bodies)
    assert batch.status == "validating" and batch.metadata == {"test": "yes"}
    done = _wait_status(client, batch.id, {"completed", "failed"}, api, batch_fleet)
    assert done.status == "completed", done
    assert done.error_file_id is None
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    outputs = _lines(client, done.output_file_id)
    _check_exactly_once(done, outputs, [], set(bodies))
    expected = _expected_texts(reference_engine, bodies, 8)
    for line in outputs:
        response = line["response"]
        assert response["status_code"] == 200 and line["error"] is None
        body = response["body"]
        assert body["object"] == "text_completion" and body["id"] == f"cmpl-{response['request_id']}"
        assert body["choices"][0]["text"] == expected[line["custom_id"]]
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 8
    # The lines ran on the batch tier.
    jobs = _line_job_ids(batch_fleet.redis, batch.id)
    assert all(batch_fleet.redis.hget(RQKeys.job(ids[0]), "origin").decode().endswith("-batch")
               for ids in jobs.values())
    listed = client.batches.list(limit=5)
    assert batch.id in [b.id for b in listed.data]


def test_a_chat_batch_answers_as_the_chat_route_does(api: ApiServer, batch_fleet: Fleet) -> None:
    client = api.openai(KEY)
    bodies = {f"chat-{i}": {"model": api.model, "max_tokens": 6, **GREEDY,
                            "messages": [{"role": "user", "content": prompt}]}
              for i, prompt in enumerate(PROMPTS[:3])}
    batch = _run_batch(client, "/v1/chat/completions", bodies)
    done = _wait_status(client, batch.id, {"completed", "failed"}, api, batch_fleet)
    assert done.status == "completed", done
    outputs = {line["custom_id"]: line["response"]["body"] for line in _lines(client, done.output_file_id)}
    for custom_id, body in bodies.items():
        direct = client.chat.completions.create(
            model=body["model"], messages=body["messages"], max_tokens=6, temperature=0.0,
            extra_body={"ignore_eos": True})
        assert outputs[custom_id]["object"] == "chat.completion"
        assert outputs[custom_id]["choices"][0]["message"]["content"] == direct.choices[0].message.content
        assert outputs[custom_id]["usage"]["prompt_tokens"] == direct.usage.prompt_tokens  # type: ignore[union-attr]


def test_a_responses_batch_answers_as_the_responses_route_does(api: ApiServer,
                                                              batch_fleet: Fleet) -> None:
    client = api.openai(KEY)
    bodies = {f"resp-{i}": {"model": api.model, "input": prompt, "max_output_tokens": 6,
                            "temperature": 0.0} for i, prompt in enumerate(PROMPTS[:3])}
    batch = _run_batch(client, "/v1/responses", bodies)
    done = _wait_status(client, batch.id, {"completed", "failed"}, api, batch_fleet)
    assert done.status == "completed", done
    outputs = {line["custom_id"]: line["response"]["body"] for line in _lines(client, done.output_file_id)}
    for custom_id, body in bodies.items():
        direct = client.responses.create(model=body["model"], input=body["input"],
                                         max_output_tokens=6, temperature=0.0)
        answer = outputs[custom_id]
        assert answer["object"] == "response"
        assert answer["output"][0]["content"][0]["text"] == direct.output_text
        assert answer["usage"]["input_tokens"] == direct.usage.input_tokens  # type: ignore[union-attr]
        # Stored: the client reads it back as it was answered, and can continue it.
        assert client.responses.retrieve(answer["id"]).output_text == direct.output_text
    follow = client.responses.create(model=api.model, input="and then?", max_output_tokens=4,
                                     previous_response_id=outputs["resp-0"]["id"])
    assert follow.previous_response_id == outputs["resp-0"]["id"]  # found: stored by the batch


def _pause(fleet: Fleet) -> None:
    for worker in fleet.workers:
        if worker.is_alive:
            worker.signal(signal.SIGSTOP)


def _resume(fleet: Fleet) -> None:
    for worker in fleet.workers:
        if worker.is_alive:
            worker.signal(signal.SIGCONT)


def _wait_queued(client: openai.OpenAI, fleet: Fleet, batch_id: str, num_lines: int,
                 api: ApiServer) -> dict[str, list[str]]:
    _wait_status(client, batch_id, {"in_progress"}, api, fleet)
    return wait_until(lambda: len(jobs := _line_job_ids(fleet.redis, batch_id)) == num_lines and jobs,
                      60, "every line to be queued", api.log)


def test_a_cancelled_batch_cancels_its_jobs_and_answers_every_line(
        api: ApiServer, batch_fleet: Fleet) -> None:
    client = api.openai(KEY)
    bodies = _completion_bodies(api.model, max_tokens=32)
    _pause(batch_fleet)  # the lines wait on the queue: the cancel finds them unstarted
    try:
        batch = _run_batch(client, "/v1/completions", bodies)
        jobs = _wait_queued(client, batch_fleet, batch.id, len(bodies), api)
        cancelling = client.batches.cancel(batch.id)
        assert cancelling.status in ("cancelling", "cancelled")
        # Still paused: the runner cancels the queued jobs at its next tick. (Resumed before
        # that, the workers, whose wake-ups Redis already served, would run them first.)
        done = _wait_status(client, batch.id, {"cancelled"}, api, batch_fleet)
    finally:
        _resume(batch_fleet)
    assert done.cancelling_at and done.cancelled_at and done.output_file_id is None
    errors = _lines(client, done.error_file_id)
    _check_exactly_once(done, [], errors, set(bodies))
    assert {(line["error"]["code"], line["response"]) for line in errors} == {("batch_cancelled", None)}
    for ids in jobs.values():
        state = JobState.from_fields(batch_fleet.redis.hgetall(KEYS.state(ids[0])))
        assert state.status is JobStatus.CANCELED
    # A completed batch cannot be cancelled.
    short = _run_batch(client, "/v1/completions", _completion_bodies(api.model, max_tokens=2))
    _wait_status(client, short.id, {"completed"}, api, batch_fleet)
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(short.id)


def test_a_line_whose_job_fails_is_answered_in_the_error_file(
        api: ApiServer, batch_fleet: Fleet, reference_engine: Any) -> None:
    client = api.openai(KEY)
    bodies = _completion_bodies(api.model, max_tokens=4)
    bodies["bad-body"] = {"model": api.model, "prompt": "x", "max_tokens": -1}
    _pause(batch_fleet)
    try:
        batch = _run_batch(client, "/v1/completions", bodies)
        jobs = _wait_queued(client, batch_fleet, batch.id, len(bodies) - 1, api)
        # A payload no API writes (a corrupted job): the worker fails that job, and serves on.
        doomed = jobs["req-1"][0]
        batch_fleet.redis.hset(RQKeys.job(doomed), "data", json.dumps([[42], {}]))
    finally:
        _resume(batch_fleet)
    done = _wait_status(client, batch.id, {"completed", "failed"}, api, batch_fleet)
    assert done.status == "completed"
    outputs, errors = _lines(client, done.output_file_id), _lines(client, done.error_file_id)
    _check_exactly_once(done, outputs, errors, set(bodies))
    by_id = {line["custom_id"]: line for line in errors}
    assert set(by_id) == {"req-1", "bad-body"}
    assert by_id["req-1"]["response"]["status_code"] == 500
    assert by_id["req-1"]["response"]["request_id"] == doomed
    assert "malformed job" in by_id["req-1"]["response"]["body"]["error"]["message"]
    assert by_id["bad-body"]["response"]["status_code"] == 400
    assert by_id["bad-body"]["response"]["body"]["error"]["param"] == "max_tokens"
    expected = _expected_texts(reference_engine, {k: v for k, v in bodies.items()
                                                  if k.startswith("req")}, 4)
    assert {line["custom_id"]: line["response"]["body"]["choices"][0]["text"] for line in outputs} \
        == {k: v for k, v in expected.items() if k != "req-1"}


def _wait_running(fleet: Fleet, jobs: dict[str, list[str]], api: ApiServer) -> str:
    """A worker that holds a batch job with tokens out: the one to kill. (Its first token is in
    its stream at once; the next ones may reach the stream only once due, live tokens.)"""
    def holder() -> str | None:
        for ids in jobs.values():
            state = fleet.redis.hgetall(KEYS.state(ids[0]))
            if state.get(b"status") == b"running" and JobReader(fleet.redis).num_tokens(ids[0]) >= 1:
                return state[b"worker"].decode()
        return None

    return wait_until(holder, 120, "a batch job to be running", api.log)


def test_a_worker_killed_mid_batch_still_answers_every_line_exactly_once(
        api: ApiServer, batch_fleet: Fleet, reference_engine: Any) -> None:
    client = api.openai(KEY)
    bodies = _completion_bodies(api.model, max_tokens=48)
    batch = _run_batch(client, "/v1/completions", bodies)
    jobs = _wait_queued(client, batch_fleet, batch.id, len(bodies), api)
    victim_name = _wait_running(batch_fleet, jobs, api)
    victim = next(w for w in batch_fleet.workers if w.name == victim_name)
    victim.signal(signal.SIGKILL)
    victim.wait(10)
    done = _wait_status(client, batch.id, {"completed", "failed"}, api, batch_fleet)
    assert done.status == "completed"
    outputs = _lines(client, done.output_file_id)
    _check_exactly_once(done, outputs, _lines(client, done.error_file_id), set(bodies))
    expected = _expected_texts(reference_engine, bodies, 48)
    assert {line["custom_id"]: line["response"]["body"]["choices"][0]["text"] for line in outputs} \
        == expected
    recoveries = sum(int(batch_fleet.redis.hget(KEYS.state(ids[0]), "num_recoveries") or 0)
                     for ids in jobs.values())
    assert recoveries >= 1
    _restart(batch_fleet, victim)


def _restart(fleet: Fleet, worker: WorkerProcess) -> None:
    since = time.time()
    worker.start()
    worker.wait_ready(fleet.redis, time.monotonic() + 240, since=since)


def test_a_redis_crash_mid_batch_loses_no_line(api: ApiServer, batch_fleet: Fleet,
                                               aof_redis: RedisServer, reference_engine: Any) -> None:
    client = api.openai(KEY)
    bodies = _completion_bodies(api.model, max_tokens=48)
    batch = _run_batch(client, "/v1/completions", bodies)
    jobs = _wait_queued(client, batch_fleet, batch.id, len(bodies), api)
    _wait_running(batch_fleet, jobs, api)
    aof_redis.kill()  # appendfsync always: everything acknowledged is on disk
    time.sleep(1.0)
    aof_redis.start(appendonly=True, extra_args=("--appendfsync", "always"))
    done = _wait_status(client, batch.id, {"completed", "failed"}, api, batch_fleet)
    assert done.status == "completed"
    outputs = _lines(client, done.output_file_id)
    _check_exactly_once(done, outputs, _lines(client, done.error_file_id), set(bodies))
    assert {line["custom_id"]: line["response"]["body"]["choices"][0]["text"] for line in outputs} \
        == _expected_texts(reference_engine, bodies, 48)
