"""vLLM's allowed_token_ids and bad_words on SamplingParams: their checks, and their trip through
the job spec (left out at their defaults, so a worker that predates them reads old jobs alike)."""

from __future__ import annotations

import json

import pytest

from protocol import JobSpec, SamplingParams
from protocol.generation import MAX_ALLOWED_TOKEN_IDS, MAX_BAD_WORD_CHARS, MAX_BAD_WORDS
from tests.protocol.conftest import make_spec


def test_extras_round_trip_through_json_and_the_job_spec() -> None:
    sampling = SamplingParams(max_tokens=4, allowed_token_ids=(7, 3, 7), bad_words=("foo", " bar baz"))
    data = sampling.to_dict()
    assert data["allowed_token_ids"] == [7, 3, 7]  # as given: duplicates are harmless, as in vLLM
    assert data["bad_words"] == ["foo", " bar baz"]
    assert SamplingParams.from_dict(json.loads(json.dumps(data))) == sampling
    spec = JobSpec.from_dict({**make_spec().to_dict(), "sampling": data})
    assert spec.sampling == sampling
    assert spec.sampling.allowed_token_ids == (7, 3, 7)
    assert spec.sampling.bad_words == ("foo", " bar baz")


def test_extras_are_left_out_at_their_defaults() -> None:
    data = SamplingParams().to_dict()
    assert "allowed_token_ids" not in data and "bad_words" not in data
    assert SamplingParams.from_dict(data).allowed_token_ids is None
    assert SamplingParams.from_dict(data).bad_words == ()


@pytest.mark.parametrize("fields", [{"allowed_token_ids": [4]}, {"bad_words": ["x"]}])
def test_each_extra_alone_is_processing(fields: dict[str, object]) -> None:
    sampling = SamplingParams.from_dict(fields)
    assert sampling.is_processed and sampling.has_extras
    assert not SamplingParams().is_processed


def test_the_limits_themselves_are_accepted() -> None:
    most = SamplingParams(allowed_token_ids=tuple(range(MAX_ALLOWED_TOKEN_IDS)),
                          bad_words=("w" * MAX_BAD_WORD_CHARS,) * MAX_BAD_WORDS)
    assert len(most.allowed_token_ids or ()) == MAX_ALLOWED_TOKEN_IDS
    assert SamplingParams(allowed_token_ids=(0,)).allowed_token_ids == (0,)


@pytest.mark.parametrize("fields, message", [
    ({"allowed_token_ids": []}, "allowed_token_ids must hold at least one token id"),
    ({"allowed_token_ids": [3, -1]}, "allowed_token_ids must hold non-negative ints, got -1"),
    ({"allowed_token_ids": [3, "4"]}, "allowed_token_ids must hold non-negative ints, got '4'"),
    ({"allowed_token_ids": [True]}, "allowed_token_ids must hold non-negative ints, got True"),
    ({"allowed_token_ids": 5}, "allowed_token_ids must be None or a tuple of ints, got 5"),
    ({"allowed_token_ids": "5"}, "allowed_token_ids must be None or a tuple of ints"),
    ({"allowed_token_ids": list(range(MAX_ALLOWED_TOKEN_IDS + 1))},
     f"allowed_token_ids may hold at most {MAX_ALLOWED_TOKEN_IDS} ids, got {MAX_ALLOWED_TOKEN_IDS + 1}"),
    ({"bad_words": [""]}, "bad_words must hold strings with some non-whitespace text, got ''"),
    ({"bad_words": ["ok", " \t"]}, r"bad_words must hold strings with some non-whitespace text, got ' \\t'"),
    ({"bad_words": [5]}, "bad_words must hold strings with some non-whitespace text, got 5"),
    ({"bad_words": "word"}, "bad_words must be a tuple of strings, got 'word'"),
    ({"bad_words": None}, "bad_words must be a tuple of strings, got None"),
    ({"bad_words": ["w"] * (MAX_BAD_WORDS + 1)},
     f"bad_words may hold at most {MAX_BAD_WORDS} strings, got {MAX_BAD_WORDS + 1}"),
    ({"bad_words": ["w" * (MAX_BAD_WORD_CHARS + 1)]},
     f"bad_words strings may be at most {MAX_BAD_WORD_CHARS} characters, got {MAX_BAD_WORD_CHARS + 1}"),
])
def test_bad_extras_are_refused_naming_the_field(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams.from_dict(fields)
