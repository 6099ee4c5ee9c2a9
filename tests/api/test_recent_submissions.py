"""RecentSubmissions: what the API process that submitted a job knows of it without a read."""

from __future__ import annotations

import time

import httpx
import pytest
from api_support import KEY_A, KEY_B, Harness, make_harness

from api.auth import owner_id
from api.recent_submissions import RecentSubmissions

pytestmark = pytest.mark.anyio


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_job_is_known_to_its_owner_until_its_retention_or_the_window_ends() -> None:
    clock = Clock()
    recent = RecentSubmissions(window_s=60.0, clock=clock)
    recent.add("short", "alice", fresh_since=99.5, retention_s=2)
    recent.add("long", "alice", fresh_since=99.5, retention_s=86_400)
    assert recent.fresh_since("short", "alice") == 99.5
    assert recent.fresh_since("short", "bob") is None  # another key's job: its state says so
    assert recent.fresh_since("unknown", "alice") is None
    clock.now = 101.49
    assert recent.fresh_since("short", "alice") == 99.5
    clock.now = 101.5  # its state may have expired (it could have ended at once)
    assert recent.fresh_since("short", "alice") is None
    assert recent.fresh_since("long", "alice") == 99.5
    clock.now = 159.5  # the window, however long its retention
    assert recent.fresh_since("long", "alice") is None


def test_old_and_surplus_entries_are_dropped_oldest_first() -> None:
    clock = Clock()
    recent = RecentSubmissions(window_s=10.0, max_entries=3, clock=clock)
    for i in range(4):
        recent.add(f"job{i}", "", fresh_since=clock.now, retention_s=600)
    assert len(recent) == 3
    assert recent.fresh_since("job0", "") is None
    assert recent.fresh_since("job1", "") == 100.0
    clock.now = 111.0
    recent.add("job4", "", fresh_since=110.5, retention_s=600)  # the others are past the window
    assert len(recent) == 1
    assert recent.fresh_since("job4", "") == 110.5


async def test_the_job_service_knows_what_it_submitted_for_the_shorter_retention(
        keyed_harness: Harness) -> None:
    jobs = keyed_harness.context.jobs
    clock = Clock()
    clock.now = time.monotonic()  # what the submissions' fresh_since is taken from
    jobs._recent._clock = clock  # a clock the test moves, from the submissions' own time
    async with keyed_harness.client(KEY_A) as client:
        short = await _submit(client, {"prompt": "hello", "retention_s": 3, "n": 2})
        default = await _submit(client, {"prompt": "hello"})
    owner = owner_id(KEY_A)
    submitted = jobs.submitted_here(short[0], owner)
    assert submitted is not None
    assert [jobs.submitted_here(job_id, owner) for job_id in short] == [submitted] * 2
    assert jobs.submitted_here(short[0], owner_id(KEY_B)) is None
    clock.now = submitted + 3
    assert jobs.submitted_here(short[0], owner) is None
    assert jobs.submitted_here(default[0], owner) is not None  # retention: a day


async def test_a_server_retention_shorter_than_the_window_bounds_it() -> None:
    """The server's result TTL is what a finished job keeps (its failure TTL is longer)."""
    harness = make_harness(result_ttl_s=5, failure_ttl_s=600)
    harness.register_model()
    jobs = harness.context.jobs
    clock = Clock()
    clock.now = time.monotonic()
    jobs._recent._clock = clock
    async with harness.client() as client:
        (job_id,) = await _submit(client, {"prompt": "hello"})
    submitted = jobs.submitted_here(job_id, "")
    assert submitted is not None
    clock.now = submitted + 4.9
    assert jobs.submitted_here(job_id, "") == submitted
    clock.now = submitted + 5
    assert jobs.submitted_here(job_id, "") is None


async def _submit(client: httpx.AsyncClient, body: dict[str, object]) -> list[str]:
    response = await client.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    accepted = response.json()
    return accepted["job_ids"] or [accepted["job_id"]]
