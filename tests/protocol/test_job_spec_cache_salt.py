"""A job's cache_salt travels in its spec, stays out of specs without one (workers that predate
it read those as before), and a malformed one is refused by name."""

from __future__ import annotations

import pytest

from protocol import JobSpec
from protocol.messages import MAX_CACHE_SALT_CHARS


def test_a_salted_spec_round_trips() -> None:
    spec = JobSpec(job_id="j", model="m", prompt="Hi", cache_salt="s" * MAX_CACHE_SALT_CHARS)
    assert spec.to_dict()["cache_salt"] == "s" * MAX_CACHE_SALT_CHARS
    assert JobSpec.from_json(spec.to_json()) == spec


def test_an_unsalted_spec_leaves_the_field_out() -> None:
    spec = JobSpec(job_id="j", model="m", prompt="Hi")
    assert "cache_salt" not in spec.to_dict()
    assert JobSpec.from_dict(spec.to_dict()).cache_salt is None


@pytest.mark.parametrize("salt", ["", 5, ["a"], "s" * (MAX_CACHE_SALT_CHARS + 1)])
def test_a_malformed_salt_is_refused_by_name(salt: object) -> None:
    with pytest.raises(ValueError, match=f"'cache_salt' must be a string of 1 to "
                                         f"{MAX_CACHE_SALT_CHARS} characters"):
        JobSpec.from_dict({"job_id": "j", "model": "m", "prompt": "Hi", "cache_salt": salt})
