"""GET /v1/jobs: the caller's own jobs, newest first, in pages, filtered by status."""

from __future__ import annotations

import httpx
import pytest
from api_support import KEY_A, KEY_B, MODEL, Harness

from protocol import FinishReason

pytestmark = pytest.mark.anyio


async def _submit(client: httpx.AsyncClient, count: int) -> list[str]:
    ids = []
    for _ in range(count):
        response = await client.post("/v1/jobs", json={"prompt": "hello"})
        assert response.status_code == 202
        ids.append(response.json()["job_id"])
    return ids


async def test_pages_go_newest_first_without_repeats(harness: Harness,
                                                     client: httpx.AsyncClient) -> None:
    ids = await _submit(client, 5)
    first = (await client.get("/v1/jobs", params={"limit": 2})).json()
    assert [job["job_id"] for job in first["data"]] == [ids[4], ids[3]]
    assert (first["object"], first["has_more"], first["next_after"]) == ("list", True, ids[3])
    assert first["data"][0] == {
        "job_id": ids[4], "object": "job", "status": "queued", "model": MODEL,
        "created_at": harness.state(ids[4]).created_at, "finished_at": None,
        "finish_reason": None, "completion_tokens": 0,
        "status_url": f"http://carpool.test/v1/jobs/{ids[4]}"}
    newer = await _submit(client, 1)  # arrives between two pages: shifts nothing
    second = (await client.get("/v1/jobs", params={"limit": 2, "after": ids[3]})).json()
    assert [job["job_id"] for job in second["data"]] == [ids[2], ids[1]]
    last = (await client.get("/v1/jobs", params={"limit": 2, "after": ids[1]})).json()
    assert [job["job_id"] for job in last["data"]] == [ids[0]]
    assert (last["has_more"], last["next_after"]) == (False, None)
    everything = (await client.get("/v1/jobs")).json()["data"]
    assert [job["job_id"] for job in everything] == newer + ids[::-1]


async def test_filter_by_status(harness: Harness, client: httpx.AsyncClient) -> None:
    ids = await _submit(client, 4)
    harness.finish_job(ids[1], ["a", "b"], FinishReason.LENGTH)
    harness.finish_job(ids[3], ["c"])
    finished = (await client.get("/v1/jobs", params={"status": "finished"})).json()
    assert [(j["job_id"], j["finish_reason"]) for j in finished["data"]] == [
        (ids[3], "stop"), (ids[1], "length")]
    page = (await client.get("/v1/jobs", params={"status": "queued", "limit": 1})).json()
    assert [j["job_id"] for j in page["data"]] == [ids[2]]
    assert page["has_more"] is True
    rest = (await client.get("/v1/jobs", params={"status": "queued", "after": page["next_after"]})
            ).json()
    assert [j["job_id"] for j in rest["data"]] == [ids[0]]


async def test_jobs_whose_retention_ended_leave_the_index(harness: Harness,
                                                          client: httpx.AsyncClient) -> None:
    ids = await _submit(client, 3)
    harness.sync.delete(harness.keys.state(ids[1]))  # expired
    listed = (await client.get("/v1/jobs")).json()["data"]
    assert [j["job_id"] for j in listed] == [ids[2], ids[0]]
    assert harness.sync.zrange(harness.keys.jobs_by_owner(""), 0, -1) == [ids[0], ids[2]]


async def test_each_key_sees_only_its_own_jobs(keyed_harness: Harness) -> None:
    async with keyed_harness.client(KEY_A) as a, keyed_harness.client(KEY_B) as b:
        (job_a,) = await _submit(a, 1)
        (job_b,) = await _submit(b, 1)
        assert [j["job_id"] for j in (await a.get("/v1/jobs")).json()["data"]] == [job_a]
        assert [j["job_id"] for j in (await b.get("/v1/jobs")).json()["data"]] == [job_b]
        response = await a.get("/v1/jobs", params={"after": job_b})  # not A's: unknown cursor
        assert response.status_code == 422


@pytest.mark.parametrize(("params", "loc", "message"), [
    ({"limit": 0}, ["query", "limit"], "Input should be greater than or equal to 1"),
    ({"limit": 101}, ["query", "limit"], "Input should be less than or equal to 100"),
    ({"status": "done"}, ["query", "status"],
     "Input should be 'queued', 'running', 'preempted', 'finished', 'failed' or 'canceled'"),
    ({"after": "nope"}, ["query", "after"],
     "'after' must be the id of one of your jobs still kept (got 'nope')"),
])
async def test_bad_parameters_are_422_naming_them(client: httpx.AsyncClient,
                                                  params: dict[str, object], loc: list[str],
                                                  message: str) -> None:
    response = await client.get("/v1/jobs", params=params)
    assert response.status_code == 422, response.text
    (detail,) = response.json()["detail"]
    assert (detail["loc"], detail["msg"]) == (loc, message)
