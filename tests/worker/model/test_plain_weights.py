"""Plain weights released where their packed copies stand in for them (worker/model/plain_weights.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels import cpu_amx_linear
from kernels.cpu_packed_linear import runs_fast_here
from protocol.generation import SamplingParams
from tests.worker.conftest import make_engine
from worker.engine import model_runner
from worker.model.loader import load_model
from worker.model.plain_weights import release_plain_weights, restore_plain_weights
from worker.model.routing import route_cpu_kernels

# oneDNN's bf16 copies are the ones released: AVX512-BF16 without AMX tiles (AMX packs its own).
needs_onednn_bf16 = pytest.mark.skipif(not runs_fast_here() or cpu_amx_linear.is_available(),
                                       reason="bf16 runs on oneDNN only with AVX512-BF16 and no AMX")


@pytest.fixture(params=["llama", "qwen2"])
def model(request: pytest.FixtureRequest, tiny_llama_dir: Path, tiny_qwen2_dir: Path) -> torch.nn.Module:
    # A private copy in bf16, routed as a bf16 engine routes it.
    directory = tiny_llama_dir if request.param == "llama" else tiny_qwen2_dir
    routed = load_model(str(directory), dtype=torch.bfloat16).model
    assert route_cpu_kernels(routed, True, torch.device("cpu"), torch.bfloat16)
    return routed


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=ids, use_cache=False).logits


def _linear_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: parameter.detach().clone() for name, parameter in model.named_parameters()
            if name.endswith("proj.weight") or name == "lm_head.weight"}


@needs_onednn_bf16
def test_every_linear_weight_is_released_and_comes_back_to_the_bit(model: torch.nn.Module) -> None:
    before = _linear_weights(model)
    ids = torch.tensor([[5, 9, 14, 3]])
    logits = _logits(model, ids)
    released = release_plain_weights(model)
    assert released == sum(weight.numel() * 2 for weight in before.values())  # bf16: two bytes each
    assert all(model.get_parameter(name).is_meta for name in before)
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attention.carpool_qkv_weight.is_meta and mlp.carpool_gate_up_weight.is_meta
    assert not model.model.embed_tokens.weight.is_meta and not model.model.norm.weight.is_meta
    # The forward multiplies by the packed copies only: the same logits, bit for bit.
    assert torch.equal(_logits(model, ids), logits)
    assert release_plain_weights(model) == 0  # nothing left to release
    assert restore_plain_weights(model) == 2 * 4 + 1  # per layer qkv, o, gate_up, down; the lm_head
    after = _linear_weights(model)
    assert after.keys() == before.keys() and all(torch.equal(after[name], before[name]) for name in before)
    # The projections are views of their fused weight again, as routing made them.
    assert attention.q_proj.weight.data_ptr() == attention.carpool_qkv_weight.data_ptr()
    assert mlp.gate_proj.weight.data_ptr() == mlp.carpool_gate_up_weight.data_ptr()
    assert restore_plain_weights(model) == 0


@needs_onednn_bf16
def test_a_tied_output_embedding_keeps_its_table(model: torch.nn.Module) -> None:
    model.lm_head.weight = model.model.embed_tokens.weight
    assert route_cpu_kernels(model, True, torch.device("cpu"), torch.bfloat16)
    release_plain_weights(model)
    assert model.lm_head.carpool_packed_weight is not None
    assert not model.lm_head.weight.is_meta and model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.layers[0].mlp.down_proj.weight.is_meta


def test_fp32_copies_stay_beside_their_weights(tiny_llama_dir: Path) -> None:
    # fp32's few rows go to the skinny kernel, which reads the plain weight.
    fp32 = load_model(str(tiny_llama_dir)).model
    route_cpu_kernels(fp32, True, torch.device("cpu"), torch.float32)
    assert release_plain_weights(fp32) == 0
    assert not any(parameter.is_meta for parameter in fp32.parameters())


@needs_onednn_bf16
def test_a_bf16_engine_generates_the_same_tokens_with_its_weights_released(
        tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = load_model(str(tiny_llama_dir))  # a private copy: this engine releases its weights
    prompts = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42]]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine = make_engine(loaded, dtype="bfloat16")
    assert loaded.model.model.layers[1].mlp.down_proj.weight.is_meta
    released = [result.token_ids for result in engine.generate(prompts, greedy)]
    monkeypatch.setattr(model_runner, "release_plain_weights", lambda model: 0)
    kept_engine = make_engine(loaded, dtype="bfloat16")  # restores them first, then keeps them
    assert not any(parameter.is_meta for parameter in loaded.model.parameters())
    assert [result.token_ids for result in kept_engine.generate(prompts, greedy)] == released
    # An fp32 engine after a releasing one converts the plain weights back, every one of them: it
    # generates what an fp32 engine on a copy that was never released does (rounded to bf16 alike).
    monkeypatch.undo()
    make_engine(loaded, dtype="bfloat16")
    assert loaded.model.lm_head.weight.is_meta
    fp32 = [result.token_ids for result in make_engine(loaded, dtype="float32").generate(prompts, greedy)]
    never_released = load_model(str(tiny_llama_dir))
    never_released.model.to(torch.bfloat16)
    assert [result.token_ids for result in make_engine(never_released, dtype="float32").generate(
        prompts, greedy)] == fp32
