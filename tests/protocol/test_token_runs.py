"""Runs (several tokens in one stream entry): readers take them apart into one entry per token,
with the ids those tokens would have had alone."""

from __future__ import annotations

import pytest

from protocol import StreamEntry
from protocol.job_reader import parse_entries
from protocol.token_runs import expand_runs, run_entry_id, run_fields


def _token(index: int, token_id: int, text: str) -> tuple[str, dict[str, str]]:
    return f"0-{index + 1}", StreamEntry(kind="token", index=index, token_id=token_id,
                                         text=text).to_fields()


def test_a_run_expands_into_the_entries_its_tokens_would_have_had() -> None:
    run = (run_entry_id(1, 3), run_fields(1, [11, 12, 13], ["b", " ç", "\"/\n"]))
    assert run[0] == "0-4"
    assert expand_runs([_token(0, 10, "a"), run]) == [
        _token(0, 10, "a"), _token(1, 11, "b"), _token(2, 12, " ç"), _token(3, 13, "\"/\n")]


def test_logprobs_ride_along_per_token() -> None:
    fields = run_fields(0, [5, 6], ["x", "y"], logprobs=["lp-of-5", "lp-of-6"])
    assert expand_runs([(b"0-2", {k.encode(): v.encode() for k, v in fields.items()})]) == [
        ("0-1", {"kind": "token", "index": "0", "token_id": "5", "text": "x", "lp": "lp-of-5"}),
        ("0-2", {"kind": "token", "index": "1", "token_id": "6", "text": "y", "lp": "lp-of-6"})]


def test_tokens_at_or_before_the_read_start_or_seen_already_are_dropped() -> None:
    run = ("0-4", run_fields(1, [11, 12, 13], ["b", "c", "d"]))
    assert [i for i, _ in expand_runs([run], after="0-2")] == ["0-3", "0-4"]
    # A run overlapping tokens already passed (only a damaged stream has one) adds none twice.
    overlapping = ("0-5", run_fields(2, [12, 13, 14], ["c", "d", "e"]))
    assert [i for i, _ in expand_runs([run, overlapping])] == ["0-2", "0-3", "0-4", "0-5"]


def test_parse_entries_reads_runs_as_tokens_and_resumes_after_the_last() -> None:
    done = ("0-4", StreamEntry(kind="done", completion_tokens=3).to_fields())
    read = parse_entries([("0-3", run_fields(0, [7, 8, 9], ["p", "q", "r"])), done], "0-1")
    assert [(e.kind, e.index, e.token_id, e.text) for e in read.entries] == [
        ("token", 1, 8, "q"), ("token", 2, 9, "r"), ("done", -1, -1, "")]
    assert read.last_id == "0-4"


def test_a_run_whose_lists_disagree_is_refused_by_name() -> None:
    fields = run_fields(0, [1, 2], ["only one text"])
    with pytest.raises(ValueError, match="a run entry at index 0 holds 2 token ids, 1 texts"):
        expand_runs([("0-2", fields)])
