"""Submitting, reading and canceling jobs through /v1/jobs, against what is in Redis."""

from __future__ import annotations

import asyncio
import json

import fakeredis
import httpx
import pytest
from api_support import CONTEXT, MODEL, Harness
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer

from protocol import FinishReason, JobStatus, Priority
from protocol.rq_keys import RQKeys

pytestmark = pytest.mark.anyio


async def _submit(client: httpx.AsyncClient, **body: object) -> dict[str, object]:
    response = await client.post("/v1/jobs", json={"prompt": "hello world", **body})
    assert response.status_code == 202, response.text
    return response.json()


async def test_submit_answers_202_with_id_status_and_urls(harness: Harness,
                                                          client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/jobs", json={"prompt": "hello world", "max_tokens": 5})
    assert response.status_code == 202
    job = response.json()
    job_id = job["job_id"]
    assert job == {
        "job_id": job_id, "object": "job", "status": "queued", "model": MODEL,
        "priority": "normal", "prompt_tokens": 2, "max_tokens": 5,
        "status_url": f"http://carpool.test/v1/jobs/{job_id}",
        "stream_url": f"http://carpool.test/v1/jobs/{job_id}/stream", "job_ids": None,
    }
    assert response.headers["location"] == job["status_url"]
    assert harness.state(job_id).status is JobStatus.QUEUED


async def test_n_jobs_are_queued_together_with_derived_seeds(harness: Harness,
                                                            client: httpx.AsyncClient) -> None:
    from rq.job import Job
    from rq.serializers import JSONSerializer

    response = await client.post("/v1/jobs", json={"prompt": "hello", "n": 3, "seed": 41})
    assert response.status_code == 202
    job = response.json()
    assert len(job["job_ids"]) == 3 and job["job_ids"][0] == job["job_id"]
    seeds = [Job.fetch(j, connection=harness.context.sync, serializer=JSONSerializer)
             .args[0]["sampling"]["seed"] for j in job["job_ids"]]
    assert seeds == [41, 42, 43]
    assert all(harness.state(j).status is JobStatus.QUEUED for j in job["job_ids"])


async def test_submit_enqueues_the_spec_on_its_priority_queue(harness: Harness,
                                                              client: httpx.AsyncClient) -> None:
    job = await _submit(client, priority="high", temperature=0.5, top_p=0.9, top_k=7, seed=3,
                        stop="world", max_tokens=4)
    queue_key = RQKeys.queue(harness.keys.queue_name(MODEL, Priority.HIGH))
    assert harness.sync.lrange(queue_key, 0, -1) == [job["job_id"]]
    rq_job = Job.fetch(str(job["job_id"]), connection=harness.context.sync, serializer=JSONSerializer)
    spec = rq_job.args[0]
    assert {k: spec[k] for k in ("model", "prompt", "messages", "priority", "owner")} == {
        "model": MODEL, "prompt": "hello world", "messages": None, "priority": "high", "owner": "",
    }
    assert spec["sampling"] == {"max_tokens": 4, "temperature": 0.5, "top_p": 0.9, "top_k": 7,
                                "seed": 3, "stop": ["world"], "ignore_eos": False}


async def test_a_job_may_keep_its_stop_string(harness: Harness, client: httpx.AsyncClient) -> None:
    job = await _submit(client, stop="world", include_stop_str_in_output=True)
    spec = Job.fetch(str(job["job_id"]), connection=harness.context.sync,
                     serializer=JSONSerializer).args[0]
    assert spec["sampling"]["stop"] == ["world"]
    assert spec["sampling"]["include_stop_str_in_output"] is True


async def test_a_job_may_write_special_tokens(harness: Harness, client: httpx.AsyncClient) -> None:
    plain = await _submit(client)
    written = await _submit(client, skip_special_tokens=False)
    specs = [Job.fetch(str(job["job_id"]), connection=harness.context.sync,
                       serializer=JSONSerializer).args[0] for job in (plain, written)]
    assert "skip_special_tokens" not in specs[0]["sampling"]  # the default stays out of the job
    assert specs[1]["sampling"]["skip_special_tokens"] is False


async def test_chat_job_keeps_its_messages(harness: Harness, client: httpx.AsyncClient) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    response = await client.post("/v1/jobs", json={"messages": messages})
    assert response.status_code == 202
    job_id = response.json()["job_id"]
    rq_job = Job.fetch(job_id, connection=harness.context.sync, serializer=JSONSerializer)
    assert rq_job.args[0]["messages"] == messages
    assert rq_job.args[0]["prompt"] is None


async def test_default_model_is_the_first_registered(harness: Harness,
                                                     client: httpx.AsyncClient) -> None:
    harness.register_model("later", created_at=50.0)
    assert (await _submit(client))["model"] == MODEL
    assert (await _submit(client, model="later"))["model"] == "later"


async def test_no_model_registered_answers_503(harness: Harness) -> None:
    harness.sync.delete(harness.keys.models())
    async with harness.client() as client:
        response = await client.post("/v1/jobs", json={"prompt": "hello"})
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    assert "No model is registered yet" in response.json()["detail"]


async def test_status_of_a_running_job_has_the_text_so_far(harness: Harness,
                                                           client: httpx.AsyncClient) -> None:
    job_id = (await _submit(client))["job_id"]
    harness.publish_tokens(str(job_id), ["Hel", "lo", ""])
    view = (await client.get(f"/v1/jobs/{job_id}")).json()
    assert view["status"] == "running"
    assert view["text"] == "Hello"
    assert view["num_tokens"] == 3
    assert view["finish_reason"] is None and view["usage"] is None
    assert view["timings"]["started_at"] is not None
    assert view["timings"]["finished_at"] is None and view["timings"]["e2e_s"] is None


async def test_status_of_a_finished_job_has_result_usage_and_timings(
        harness: Harness, client: httpx.AsyncClient) -> None:
    job_id = str((await _submit(client))["job_id"])
    harness.finish_job(job_id, ["a", " b"], FinishReason.LENGTH, prompt_tokens=2)
    harness.sync.hset(harness.keys.state(job_id), mapping={"num_preemptions": 2, "worker": "w7"})
    view = (await client.get(f"/v1/jobs/{job_id}")).json()
    assert {k: view[k] for k in ("status", "text", "num_tokens", "finish_reason", "error", "usage",
                                 "num_preemptions", "worker")} == {
        "status": "finished", "text": "a b", "num_tokens": 2, "finish_reason": "length",
        "error": None, "usage": {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4},
        "num_preemptions": 2, "worker": "w7",
    }
    timings = view["timings"]
    assert timings["e2e_s"] == pytest.approx(timings["finished_at"] - timings["created_at"], abs=1e-5)


async def test_status_of_a_failed_job_has_its_error(harness: Harness,
                                                    client: httpx.AsyncClient) -> None:
    job_id = str((await _submit(client))["job_id"])
    harness.publish_done(job_id, 0, FinishReason.ERROR, error="prompt too long for the KV cache")
    view = (await client.get(f"/v1/jobs/{job_id}")).json()
    assert view["status"] == "failed"
    assert view["error"] == "prompt too long for the KV cache"


async def test_wait_answers_once_the_job_has_ended(harness: Harness, client: httpx.AsyncClient) -> None:
    job_id = str((await _submit(client))["job_id"])
    harness.publish_tokens(job_id, ["a"])  # running: the wait reads on from its last entry

    async def finish_later() -> None:
        await asyncio.sleep(0.3)
        harness.publish_tokens(job_id, [" b"], start=1)
        harness.publish_done(job_id, 2, FinishReason.STOP, text="a b")

    finisher = asyncio.create_task(finish_later())
    started = asyncio.get_running_loop().time()
    view = (await client.get(f"/v1/jobs/{job_id}", params={"wait": 30})).json()
    waited = asyncio.get_running_loop().time() - started
    await finisher
    assert (view["status"], view["text"], view["finish_reason"]) == ("finished", "a b", "stop")
    assert 0.3 <= waited < 10  # it answered at the end, not at the wait's limit


async def test_wait_answers_the_job_as_it_is_when_the_time_is_up(harness: Harness,
                                                                  client: httpx.AsyncClient) -> None:
    job_id = str((await _submit(client))["job_id"])  # queued, and no worker takes it
    started = asyncio.get_running_loop().time()
    view = (await client.get(f"/v1/jobs/{job_id}", params={"wait": 0.4})).json()
    assert view["status"] == "queued"
    assert asyncio.get_running_loop().time() - started >= 0.4
    harness.finish_job(job_id, ["x"])
    started = asyncio.get_running_loop().time()
    view = (await client.get(f"/v1/jobs/{job_id}", params={"wait": 30})).json()
    assert view["status"] == "finished"
    assert asyncio.get_running_loop().time() - started < 5  # ended already: no wait
    refused = await client.get(f"/v1/jobs/{job_id}", params={"wait": 301})
    assert refused.status_code == 422 and refused.json()["detail"][0]["loc"] == ["query", "wait"]


async def test_unknown_job_is_404(client: httpx.AsyncClient) -> None:
    for method, path in (("GET", "/v1/jobs/nope"), ("GET", "/v1/jobs/nope/stream"),
                         ("DELETE", "/v1/jobs/nope")):
        response = await client.request(method, path)
        assert response.status_code == 404, (method, path)
        assert response.json() == {"detail": "No job with id 'nope'"}


async def test_cancel_a_queued_job(harness: Harness, client: httpx.AsyncClient) -> None:
    job_id = str((await _submit(client))["job_id"])
    response = await client.delete(f"/v1/jobs/{job_id}")
    assert response.status_code == 200
    assert response.json() == {"job_id": job_id, "object": "job", "status": "canceled",
                               "canceled": True}
    assert harness.state(job_id).status is JobStatus.CANCELED
    assert harness.sync.llen(RQKeys.queue(harness.keys.queue_name(MODEL, Priority.NORMAL))) == 0
    events = (await client.get(f"/v1/jobs/{job_id}/stream")).text
    assert '"finish_reason": "canceled"' in events


async def test_a_queued_job_rq_emptied_off_its_queue_reads_canceled(
        harness: Harness, client: httpx.AsyncClient) -> None:
    """`rq empty` took it (its RQ job deleted), so no worker will ever claim it: the status read
    ends it canceled instead of showing it queued for ever."""
    job_id = str((await _submit(client))["job_id"])
    rq_redis = fakeredis.FakeRedis(server=harness.server)  # rq reads bytes
    Queue(harness.keys.queue_name(MODEL, Priority.NORMAL), connection=rq_redis,
          serializer=JSONSerializer).empty()
    body = (await client.get(f"/v1/jobs/{job_id}")).json()
    assert (body["status"], body["finish_reason"]) == ("canceled", "canceled")
    assert harness.state(job_id).status is JobStatus.CANCELED
    assert harness.sync.exists(RQKeys.job(job_id)) == 0  # deleted by rq, it stays deleted
    events = (await client.get(f"/v1/jobs/{job_id}/stream")).text
    assert '"finish_reason": "canceled"' in events


async def test_cancel_a_running_job_asks_its_worker(harness: Harness,
                                                    client: httpx.AsyncClient) -> None:
    job_id = str((await _submit(client))["job_id"])
    harness.sync.lpop(RQKeys.queue(harness.keys.queue_name(MODEL, Priority.NORMAL)))  # a worker took it
    harness.publish_tokens(job_id, ["x"])
    response = await client.delete(f"/v1/jobs/{job_id}")
    assert response.status_code == 202
    assert response.json()["status"] == "running" and response.json()["canceled"] is True
    assert harness.sync.sismember(harness.keys.canceled(), job_id)


async def test_cancel_a_finished_job_changes_nothing(harness: Harness,
                                                     client: httpx.AsyncClient) -> None:
    job_id = str((await _submit(client))["job_id"])
    harness.finish_job(job_id, ["x"])
    response = await client.delete(f"/v1/jobs/{job_id}")
    assert response.status_code == 200
    assert response.json()["status"] == "finished" and response.json()["canceled"] is False
    assert harness.state(job_id).status is JobStatus.FINISHED


async def test_full_queue_answers_429_with_retry_after() -> None:
    from api_support import make_harness

    harness = make_harness(max_queue_depth=2, retry_after_s=7)
    harness.register_model()
    async with harness.client() as client:
        await _submit(client, priority="high")
        await _submit(client, priority="low")
        response = await client.post("/v1/jobs", json={"prompt": "hello"})
        assert response.status_code == 429
        assert response.headers["retry-after"] == "7"
        assert response.json() == {"detail": "The job queue of model 'tiny' is full (2 jobs waiting, the limit is "
                                             "2); retry later"}
        openai = await client.post("/v1/completions", json={"prompt": "hello"})
        assert openai.status_code == 429
        assert openai.json()["error"]["code"] == "queue_full"
        # A job leaving the queue makes room again.
        harness.sync.lpop(RQKeys.queue(harness.keys.queue_name(MODEL, Priority.HIGH)))
        assert (await client.post("/v1/jobs", json={"prompt": "hello"})).status_code == 202


async def test_a_concurrent_burst_cannot_overshoot_the_queue_limit() -> None:
    from api_support import make_harness

    harness = make_harness(max_queue_depth=5, retry_after_s=2)
    harness.register_model()
    async with harness.client() as client:
        # All 40 read the depth before any enqueue lands unless check and enqueue are one step.
        responses = await asyncio.gather(*(
            client.post("/v1/jobs", json={"prompt": "hello"}) for _ in range(40)))
    statuses = sorted(response.status_code for response in responses)
    assert statuses == [202] * 5 + [429] * 35
    assert all(r.headers["retry-after"] == "2" for r in responses if r.status_code == 429)
    assert sum(harness.sync.llen(RQKeys.queue(name)) for name in harness.keys.queue_names(MODEL)) == 5


async def test_context_sized_default_is_not_needed_for_jobs(client: httpx.AsyncClient) -> None:
    # The jobs API defaults to 16 tokens (JobSpec's default), like OpenAI's completions.
    assert (await _submit(client))["max_tokens"] == 16
    assert CONTEXT > 16


async def test_openapi_documents_every_route_and_field(client: httpx.AsyncClient) -> None:
    schema = (await client.get("/openapi.json")).json()
    assert set(schema["paths"]) >= {
        "/v1/jobs", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/stream", "/v1/completions",
        "/v1/chat/completions", "/v1/models", "/healthz", "/metrics", "/v1/responses",
        "/v1/responses/{response_id}", "/v1/responses/{response_id}/input_items"}
    undocumented = [
        f"{name}.{field}" for name, component in schema["components"]["schemas"].items()
        if name not in ("HTTPValidationError", "ValidationError")  # FastAPI's own
        for field, spec in component.get("properties", {}).items() if "description" not in spec]
    assert undocumented == []
    assert schema["components"]["schemas"]["JobCreate"]["examples"]
    assert all("summary" in op for ops in schema["paths"].values() for op in ops.values())
    assert json.dumps(schema).count("text/event-stream") >= 3
