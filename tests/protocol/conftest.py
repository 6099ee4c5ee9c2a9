"""Builders for protocol tests: an in-memory Redis (fakeredis with Lua) and job specs."""

from __future__ import annotations

from collections.abc import Iterator

import fakeredis
import pytest

from protocol import JobSpec, Priority
from tests.step_notes import listen


@pytest.fixture()
def fake_redis() -> Iterator[fakeredis.FakeRedis]:
    server = fakeredis.FakeServer()
    client = listen(fakeredis.FakeRedis(server=server))  # its step notifications caught
    yield client
    client.close()


def make_spec(job_id: str = "job-1", priority: Priority = Priority.NORMAL, **overrides) -> JobSpec:
    fields = dict(job_id=job_id, model="tiny", prompt="Hello", max_tokens=8, temperature=0.0,
                  priority=priority, owner="key-1", created_at=1000.0)
    fields.update(overrides)
    return JobSpec.from_dict(fields)
