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
from worker.model.decoder_loop import DecoderLoop
from worker.model.fused_layers import route_fused_layers
from worker.model.loader import load_model

DTYPES = ["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(
    not runs_fast_here(), reason="bf16 runs through oneDNN's packed weights only with AVX512-BF16 or AMX"))]


def _requests() -> list[tuple[str, list[int], SamplingParams]]:
    prompts = random_prompts(6, seed=3)
    prompts += [prompts[-1] + prompts[0], [11] * 150]  # a cached prefix; one 150-token prompt
    return [(f"r{i}", prompt, SamplingParams(max_tokens=5 + i, temperature=0.0)) for i, prompt in enumerate(prompts)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_loop_gives_the_module_trees_logits_bit_for_bit(tiny: Any, dtype: str) -> None:
    # A private copy: in bf16 the session's shared model would keep bf16-rounded weights.
    engine = make_engine(load_model(str(tiny.loaded.path)), dtype=dtype, max_num_batched_tokens=96)
    runner: ModelRunner = engine.runner
    loop = runner.decoder_loop
    assert loop is not None
    compared: list[int] = []

    def both(inputs: ModelInputs) -> torch.Tensor:
        # The second forward rewrites the same K/V rows with the same values.
        runner.decoder_loop = None
        tree = ModelRunner.forward(runner, inputs)
        runner.decoder_loop = loop
        logits = ModelRunner.forward(runner, inputs)
        assert logits.dtype == torch.float32 and torch.equal(logits, tree), f"step {len(compared)}"
        compared.append(inputs.input_ids.shape[1])
        return logits

    runner.forward = both  # type: ignore[method-assign]
    run = run_engine(engine, _requests())
    assert len(run.token_ids) == 8 and all(len(ids) == 5 + int(r[1:]) for r, ids in run.token_ids.items())
    assert max(compared) == 96 and min(compared) < 8  # full prefill chunks and decode-only steps


def test_no_loop_where_the_model_is_not_fully_routed(tiny: Any) -> None:
    engine = make_engine(tiny.loaded, enable_cpu_kernels=False)
    assert engine.runner.decoder_loop is None  # the torch twins: nothing routed
    model = tiny.loaded.model
    route_fused_layers(model)
    assert DecoderLoop.of(model) is not None
    model.model.layers[1].mlp.__class__ = type(model.model.layers[1].mlp).carpool_original_class
    try:
        assert DecoderLoop.of(model) is None  # one MLP its own again
    finally:
        route_fused_layers(model, fused=False)


def test_a_loop_whose_model_was_routed_back_steps_aside(tiny: Any) -> None:
    first = make_engine(tiny.loaded)
    loop = first.runner.decoder_loop
    assert loop is not None and loop.is_current()
    make_engine(tiny.loaded, enable_cpu_kernels=False)  # shares the model, routes it back
    assert not loop.is_current()
    run = run_engine(first, _requests()[:2])  # the module tree again: still right
    assert [len(ids) for ids in run.token_ids.values()] == [5, 6]
