"""The logits-processing fields and logprobs survive preemption and a takeover after SIGKILL:
a resumed job continues with the same penalties, bias, min_tokens mask and seeded draws (its
tokens equal an undisturbed run's), and its stream holds one logprobs entry per token, no gap,
no duplicate, equal to the undisturbed run's values; its prompt logprobs are stored once, with
its first token, and are the undisturbed run's (not those of a resumed prefill)."""

from __future__ import annotations

import signal
from typing import Any

import pytest

from protocol import (
    FinishReason,
    JobReader,
    JobSpec,
    JobStatus,
    TokenLogprobs,
    cancel_job,
    submit_jobs,
)
from tests.integration.conftest import (
    Fleet,
    assert_stream_exact,
    make_specs,
    wait_final,
    wait_until,
)

pytestmark = pytest.mark.slow

COMMON = ["--lease-seconds", "3", "--idle-block-seconds", "0.5", "--num-threads", "1"]

# Every job carries every field family, so whichever job is preempted or taken over covers them
# all: penalties (repetition over prompt+output, frequency and presence over output), a bias that
# bans one token and favours another, min_tokens over the whole run (EOS masked throughout, with
# ignore_eos off), logprobs and prompt logprobs.
FIELDS: dict[str, Any] = {
    "repetition_penalty": 1.3, "frequency_penalty": 0.4, "presence_penalty": 0.3,
    "logit_bias": {"198": -100, "30": 1.5}, "logprobs": 3, "prompt_logprobs": 2,
}
Reference = tuple[list[int], list[TokenLogprobs], list[int], list[TokenLogprobs | None]]


def _specs(model: str, count: int, max_tokens: int) -> list[JobSpec]:
    return make_specs(model, count, max_tokens=max_tokens, min_tokens=max_tokens, **FIELDS)


def _reference(engine: Any, specs: list[JobSpec]) -> dict[str, Reference]:
    """An undisturbed in-process run: each job's tokens, logprobs, prompt and prompt logprobs."""
    out: dict[str, Reference] = {
        s.job_id: ([], [], engine.tokenizer.encode(s.prompt), []) for s in specs}
    for spec in specs:
        engine.add_request(spec.job_id, engine.tokenizer.encode(spec.prompt), spec.sampling)
    while engine.has_unfinished():
        for request in engine.step().outputs:
            if request.prompt_logprobs is not None:
                out[request.request_id][3].extend(request.prompt_logprobs)
            for entry in request.tokens:
                out[request.request_id][0].append(entry.token_id)
                out[request.request_id][1].append(entry.logprobs)
    return out


def _assert_like_reference(fleet: Fleet, spec: JobSpec, expected: Reference) -> None:
    tokens, logprobs, prompt, prompt_logprobs = expected
    stored = JobReader(fleet.redis).prompt_logprobs(spec.job_id)
    assert stored is not None and list(stored.token_ids) == prompt
    assert len(stored.entries) == len(prompt_logprobs) == len(prompt) and stored.entries[0] is None
    for got, want in zip(stored.entries[1:], prompt_logprobs[1:]):
        assert got is not None and want is not None
        assert got.logprob == pytest.approx(want.logprob, abs=1e-3)
        assert [v for _, v in got.top] == pytest.approx([v for _, v in want.top], abs=1e-3)
    assert len(tokens) == spec.sampling.max_tokens  # min_tokens held EOS off all the way
    assert 198 not in tokens  # banned by logit_bias
    entries = assert_stream_exact(fleet.redis, spec.job_id, tokens, FinishReason.LENGTH)
    for entry, reference in zip(entries[:-1], logprobs):
        assert entry.logprobs is not None, (spec.job_id, entry.index)
        # Batch shapes differ between the runs: fp32 matmuls may differ in the last bits.
        assert entry.logprobs.logprob == pytest.approx(reference.logprob, abs=1e-3)
        assert [i for i, _ in entry.logprobs.top] == [i for i, _ in reference.top]
        assert [v for _, v in entry.logprobs.top] == pytest.approx([v for _, v in reference.top],
                                                                    abs=1e-3)


def _occupy(fleet: Fleet, name: str) -> str:
    """Submit long jobs until worker `name` runs one (canceling any another worker took)."""
    reader = JobReader(fleet.redis)
    for _ in range(20):
        (spec,) = make_specs(fleet.model_dir.name, 1, max_tokens=1000, ignore_eos=True)
        submit_jobs(fleet.redis, [spec])
        state = wait_until(lambda: (s := reader.state(spec.job_id)) and  # noqa: B023
                           s.status is JobStatus.RUNNING and s, 60, "a worker to take the blocker",
                           fleet.logs)
        if state.worker == name:
            return spec.job_id
        cancel_job(fleet.redis, spec.job_id)
        wait_final(fleet, [spec.job_id])
    raise AssertionError(f"{name} never took a job")


def test_preempted_jobs_keep_penalties_bias_seed_and_logprobs(fleet: Fleet,
                                                              reference_engine: Any) -> None:
    # 16 blocks of 16 tokens: one job of 125 tokens needs 8; four cannot all stay.
    workers = fleet.start(("roomy", ["--max-num-seqs", "1", *COMMON]),
                          ("tight", ["--max-num-seqs", "4", "--num-kv-blocks", "16", *COMMON]))
    reader = JobReader(fleet.redis)
    specs = _specs(fleet.model_dir.name, 4, max_tokens=120)
    expected = _reference(reference_engine, specs)
    blocker = _occupy(fleet, "roomy")  # so the tight worker takes every job
    submit_jobs(fleet.redis, specs)
    wait_until(lambda: any(reader.state(s.job_id).num_preemptions for s in specs), 180,
               "a preemption", fleet.logs)
    assert cancel_job(fleet.redis, blocker) is JobStatus.RUNNING
    states = wait_final(fleet, [s.job_id for s in specs], timeout=300)
    assert any(states[s.job_id].num_preemptions for s in specs)
    assert {s.sampling.temperature for s in specs} == {0.0, 0.8}  # greedy and seeded both covered
    for spec in specs:
        assert states[spec.job_id].status is JobStatus.FINISHED, fleet.logs()
        _assert_like_reference(fleet, spec, expected[spec.job_id])
    for worker in workers:
        worker.stop()


def test_a_job_taken_over_after_sigkill_keeps_its_fields(fleet: Fleet, reference_engine: Any) -> None:
    args = ["--max-num-seqs", "4", *COMMON]
    pair = fleet.start(("alpha", args), ("beta", args))
    specs = _specs(fleet.model_dir.name, 4, max_tokens=200)
    expected = _reference(reference_engine, specs)
    submit_jobs(fleet.redis, specs)
    reader = JobReader(fleet.redis)

    def owner_with_tokens(job_id: str) -> str | None:
        state = reader.state(job_id)
        if state and state.status is JobStatus.RUNNING and reader.num_tokens(job_id) >= 10:
            return state.worker
        return None

    victim_name = wait_until(lambda: next(
        (name for s in specs if (name := owner_with_tokens(s.job_id))), None), 60,
        "a job to stream", fleet.logs)
    victim = next(w for w in pair if w.name == victim_name)
    victims_jobs = [s.job_id for s in specs if reader.state(s.job_id).worker == victim_name]
    victim.signal(signal.SIGKILL)
    victim.wait(10)
    states = wait_final(fleet, [s.job_id for s in specs], timeout=300)
    for job_id in victims_jobs:
        assert states[job_id].num_recoveries == 1
        # Taken over mid-stream: some tokens came from each worker.
        assert states[job_id].worker != victim_name
    for spec in specs:
        assert states[spec.job_id].status is JobStatus.FINISHED, fleet.logs()
        _assert_like_reference(fleet, spec, expected[spec.job_id])
