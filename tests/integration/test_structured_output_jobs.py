"""Constrained jobs on real workers survive what only Carpool does to a job: preemption (resumed by
another worker from its stream) and a SIGKILL (taken over once the lease lapses). The resumed
worker replays the tokens into a fresh grammar matcher: the output stays inside the grammar and
is token for token the output of an undisturbed run, greedy and seeded alike."""

from __future__ import annotations

import json
import re
import signal

import pytest

from protocol import JobReader, JobStatus, StreamEntry, submit_jobs
from tests.integration.conftest import (
    Fleet,
    assert_stream_exact,
    make_specs,
    wait_final,
    wait_until,
)

pytestmark = pytest.mark.slow

COMMON = ["--lease-seconds", "3", "--idle-block-seconds", "0.5", "--num-threads", "1"]
# Lowercase words and single spaces: the tiny random model could never keep to it unmasked.
WORDS = r"[a-z]{1,8}( [a-z]{1,8}){0,200}"
CONSTRAINT = {"kind": "regex", "spec": WORDS}


def _expected(engine: object, specs: list) -> dict[str, tuple[list[int], object]]:  # type: ignore[type-arg]
    completions = engine.generate([s.prompt for s in specs], [s.sampling for s in specs])  # type: ignore[attr-defined]
    return {s.job_id: (list(c.token_ids), c.finish_reason) for s, c in zip(specs, completions)}


def _check(fleet: Fleet, specs: list, expected: dict, states: dict) -> None:  # type: ignore[type-arg]
    for spec in specs:
        tokens, reason = expected[spec.job_id]
        state = states[spec.job_id]
        assert state.status is JobStatus.FINISHED, (spec.job_id, state.error)
        assert list(state.token_ids) == tokens
        entries = assert_stream_exact(fleet.redis, spec.job_id, tokens, reason)
        text = "".join(e.text for e in entries if e.kind == StreamEntry.TOKEN)
        assert re.fullmatch(WORDS, text), text


def _running_with_tokens(fleet: Fleet, job_id: str, min_tokens: int) -> str | None:
    state = JobReader(fleet.redis).state(job_id)
    if state and state.status is JobStatus.RUNNING and JobReader(fleet.redis).num_tokens(job_id) >= min_tokens:
        return state.worker
    return None


def test_preempted_constrained_jobs_resume_token_for_token(fleet: Fleet, reference_engine: object) -> None:
    # 12 blocks of 16 tokens for four jobs of 125 tokens (8 blocks each): jobs are preempted, put
    # back on the queue and resumed from their streams.
    fleet.start(("tight", ["--max-num-seqs", "4", "--num-kv-blocks", "12", *COMMON]))
    specs = make_specs(fleet.model_dir.name, 4, max_tokens=120, structured_output=CONSTRAINT)
    expected = _expected(reference_engine, specs)
    assert {s.sampling.temperature for s in specs} == {0.0, 0.8}  # greedy and seeded
    submit_jobs(fleet.redis, specs)
    states = wait_final(fleet, [s.job_id for s in specs], timeout=240)
    _check(fleet, specs, expected, states)
    assert sum(states[s.job_id].num_preemptions for s in specs) >= 1
    fleet.stop_all()


def test_constrained_jobs_of_a_sigkilled_worker_resume_token_for_token(
        fleet: Fleet, reference_engine: object) -> None:
    workers = fleet.start(("alpha", ["--max-num-seqs", "4", *COMMON]),
                          ("beta", ["--max-num-seqs", "4", *COMMON]))
    specs = make_specs(fleet.model_dir.name, 4, max_tokens=300, structured_output=CONSTRAINT)
    expected = _expected(reference_engine, specs)
    submit_jobs(fleet.redis, specs)
    victim_name = wait_until(lambda: next(
        (name for s in specs if (name := _running_with_tokens(fleet, s.job_id, 10))), None),
        60, "a job to stream", fleet.logs)
    victim = next(w for w in workers if w.name == victim_name)
    victim.signal(signal.SIGKILL)
    victim.wait(10)
    states = wait_final(fleet, [s.job_id for s in specs], timeout=240)
    _check(fleet, specs, expected, states)
    assert sum(states[s.job_id].num_recoveries for s in specs) >= 1


def test_a_constraint_that_does_not_compile_fails_its_job_clearly(fleet: Fleet) -> None:
    # A job submitted past the API (it compiles every constraint): the worker fails it, and serves on.
    (bad,) = make_specs(fleet.model_dir.name, 1, structured_output={"kind": "regex", "spec": "a(b"})
    (good,) = make_specs(fleet.model_dir.name, 1, max_tokens=8,
                         structured_output={"kind": "choice", "spec": json.dumps(["yes", "no"])})
    submit_jobs(fleet.redis, [bad, good])
    states = wait_final(fleet, [bad.job_id, good.job_id])
    assert states[bad.job_id].status is JobStatus.FAILED
    assert "does not compile" in states[bad.job_id].error
    assert states[good.job_id].status is JobStatus.FINISHED
    assert states[good.job_id].text in ("yes", "no")
