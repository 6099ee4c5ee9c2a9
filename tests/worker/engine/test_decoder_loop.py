"""The decoder loop (worker/model/decoder_loop.py) against the module tree it replaces: the same
logits, bit for bit, on every step of a run that mixes prefill chunks (over the C++ attention's 16
rows and over oneDNN's 64-row padding), decodes and prompts sharing a cached prefix."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kernels.cpu_packed_linear import runs_fast_here
from tests.worker.conftest import make_engine, random_prompts, run_engine
from worker.engine.engine import SamplingParams
from worker.engine.model_runner import ModelInputs, ModelRunner
from worker.model.loader import load_model

DTYPES = ["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(
    not runs_fast_here(), reason="bf16 runs through oneDNN's packed weights only with AVX512-BF16 or AMX"))]


def _requests() -> list[tuple[str, list[int], SamplingParams]]:
    prompts = random_prompts(6, seed=3)
    prompts += [prompts[-1] + prompts[0], [11] * 150]  # a cached prefix; one 150-token prompt
    return [(f"r{i}", prompt, SamplingParams(max_tokens=5 + i, temperature=0.0)) for i, prompt in enumerate(prompts)]


def _compare_every_step(engine: Any) -> list[tuple[int, int]]:
    """Make each of the engine's forwards run both ways and assert equal logits; returns each
    step's (rows, kept rows) as the steps come."""
    runner: ModelRunner = engine.runner
    loop = runner.decoder_loop
    assert loop is not None
    compared: list[tuple[int, int]] = []

    def both(inputs: ModelInputs) -> torch.Tensor:
        # The second forward rewrites the same K/V rows with the same values.
        runner.decoder_loop = None
        tree = ModelRunner.forward(runner, inputs)
        runner.decoder_loop = loop
        logits = ModelRunner.forward(runner, inputs)
        assert logits.dtype == torch.float32 and torch.equal(logits, tree), f"step {len(compared)}"
        compared.append((inputs.input_ids.shape[1], logits.shape[0]))
        return logits

    runner.forward = both  # type: ignore[method-assign]
    return compared


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_loop_gives_the_module_trees_logits_bit_for_bit(tiny: Any, dtype: str) -> None:
    # A private copy: in bf16 the session's shared model would keep bf16-rounded weights.
    engine = make_engine(load_model(str(tiny.loaded.path)), dtype=dtype, max_num_batched_tokens=96)
    compared = _compare_every_step(engine)
    run = run_engine(engine, _requests())
    assert len(run.token_ids) == 8 and all(len(ids) == 5 + int(r[1:]) for r, ids in run.token_ids.items())
    rows = [rows for rows, _ in compared]
    assert max(rows) == 96 and min(rows) < 8  # full prefill chunks and decode-only steps


@pytest.mark.parametrize("prompt_logprobs", [None, 2])
def test_steps_that_keep_no_rows_or_prompt_logprob_rows_agree_too(tiny: Any, prompt_logprobs: int | None) -> None:
    engine = make_engine(tiny.loaded, max_num_batched_tokens=32)
    compared = _compare_every_step(engine)
    params = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=prompt_logprobs)
    run = run_engine(engine, [("long", [7 + i % 50 for i in range(100)], params)])
    assert len(run.token_ids["long"]) == 3
    # The first chunk of an unfinished prompt samples nothing: it keeps no rows, or its 32
    # prompt-logprob rows.
    assert compared[0] == (32, 0 if prompt_logprobs is None else 32) and compared[-1] == (1, 1)
