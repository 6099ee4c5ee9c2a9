"""route_fused_layers on the tiny Llama and Qwen2 (whose q/k/v projections have biases): which
modules change, what they share, what they compute."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels import cpu_amx_linear
from kernels.cpu_packed_linear import packs_fp32_here, runs_fast_here
from kernels.dispatch import MAX_SKINNY_ROWS
from worker.model.fused_layers import route_fused_layers
from worker.model.linear_layers import DispatchedLinear, route_linear_layers, warm_up_packed_layers
from worker.model.loader import load_model

NUM_LAYERS = 2  # worker/tiny_models.py
# Packed bf16 weights only where oneDNN multiplies bf16 natively, as the engine does.
needs_fast_bf16 = pytest.mark.skipif(not runs_fast_here(), reason="no AVX512-BF16 or AMX here")


@pytest.fixture(params=["llama", "qwen2"])
def model(request: pytest.FixtureRequest, tiny_llama_dir: Path, tiny_qwen2_dir: Path) -> torch.nn.Module:
    # A private copy: the session's tiny models are shared with the engine tests.
    directory = tiny_llama_dir if request.param == "llama" else tiny_qwen2_dir
    return load_model(str(directory)).model


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=ids, use_cache=False).logits


def test_routes_every_norm_mlp_and_attention_and_back(model: torch.nn.Module) -> None:
    names = {type(m).__name__ for m in model.modules()}
    arch = "Llama" if "LlamaMLP" in names else "Qwen2"
    # Two norms per layer and the final one, one MLP, one attention block and the layer itself.
    assert route_fused_layers(model) == 5 * NUM_LAYERS + 1
    routed = {type(m).__name__ for m in model.modules()}
    assert {f"Fused{arch}RMSNorm", f"Fused{arch}MLP", f"Fused{arch}Attention", f"Fused{arch}DecoderLayer"} <= routed
    assert not {f"{arch}MLP", f"{arch}RMSNorm", f"{arch}Attention", f"{arch}DecoderLayer"} & routed
    assert route_fused_layers(model) == 0  # already routed
    assert route_fused_layers(model, fused=False) == 5 * NUM_LAYERS + 1
    assert {type(m).__name__ for m in model.modules()} == names


def test_gate_and_up_become_views_of_one_weight(model: torch.nn.Module) -> None:
    keys_before = set(model.state_dict())
    mlp = model.model.layers[0].mlp
    gate, up = mlp.gate_proj.weight.detach().clone(), mlp.up_proj.weight.detach().clone()
    route_fused_layers(model)
    fused = mlp.carpool_gate_up_weight
    assert fused.shape == (gate.shape[0] + up.shape[0], gate.shape[1])
    assert torch.equal(fused, torch.cat([gate, up]))
    assert mlp.gate_proj.weight.data_ptr() == fused.data_ptr()
    assert mlp.up_proj.weight.data_ptr() == fused[gate.shape[0]:].data_ptr()
    assert set(model.state_dict()) == keys_before  # nothing new saved or loaded


def test_q_k_and_v_become_views_of_one_weight_and_bias(model: torch.nn.Module) -> None:
    keys_before = set(model.state_dict())
    attention = model.model.layers[1].self_attn
    projections = [attention.q_proj, attention.k_proj, attention.v_proj]
    weights = [p.weight.detach().clone() for p in projections]
    biases = [None if p.bias is None else p.bias.detach().clone() for p in projections]
    route_fused_layers(model)
    assert torch.equal(attention.carpool_qkv_weight, torch.cat(weights))
    rows = [0, weights[0].shape[0], weights[0].shape[0] + weights[1].shape[0]]
    for projection, row in zip(projections, rows):
        assert projection.weight.data_ptr() == attention.carpool_qkv_weight[row:].data_ptr()
    if biases[0] is None:  # Llama
        assert attention.carpool_qkv_bias is None
    else:  # Qwen2
        assert torch.equal(attention.carpool_qkv_bias, torch.cat(biases))
        assert attention.v_proj.bias.data_ptr() == attention.carpool_qkv_bias[rows[2]:].data_ptr()
    assert (attention.carpool_num_heads, attention.carpool_num_kv_heads) == (
        model.config.num_attention_heads, model.config.num_key_value_heads)
    assert set(model.state_dict()) == keys_before


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_attention_calls_the_models_attention_function(
    model: torch.nn.Module, implementation: str, dtype: torch.dtype,
) -> None:
    # Outside the engine the routed block hands its rotated q, k, v to transformers' own
    # attention: it must then compute what the unrouted model computes, to the bit in bf16.
    model.to(dtype)
    model.set_attn_implementation(implementation)
    ids = torch.randint(3, 1000, (1, 9), generator=torch.Generator().manual_seed(5))
    expected = _logits(model, ids)
    route_fused_layers(model, packed=dtype == torch.bfloat16 and runs_fast_here())
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 0, "atol": 0}
    torch.testing.assert_close(_logits(model, ids), expected, **tolerance)


def _unroute_decoder_layers(model: torch.nn.Module) -> None:
    for layer in model.model.layers:
        layer.__class__ = type(layer).carpool_original_class


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_decoder_layer_computes_the_original_layers_logits_to_the_bit(
    model: torch.nn.Module, dtype: torch.dtype,
) -> None:
    # Everything else routed alike: the fused add + norm must round where the original add, then
    # the norm, round (the kernel and the twin each equal the unfused pair bit for bit).
    model.to(dtype)
    ids = torch.randint(3, 1000, (1, 9), generator=torch.Generator().manual_seed(7))
    route_fused_layers(model)
    assert type(model.model.layers[0]).__name__.endswith("DecoderLayer")
    fused = _logits(model, ids)
    _unroute_decoder_layers(model)
    assert torch.equal(fused, _logits(model, ids))


def test_fused_decoder_layer_leaves_its_input_alone(model: torch.nn.Module) -> None:
    # The residual stream rides in the attention output: every layer's input, as
    # output_hidden_states hands them back, stays what it was.
    ids = torch.randint(3, 1000, (1, 9), generator=torch.Generator().manual_seed(8))
    route_fused_layers(model)
    with torch.inference_mode():
        fused = model(input_ids=ids, use_cache=False, output_hidden_states=True).hidden_states
        _unroute_decoder_layers(model)
        original = model(input_ids=ids, use_cache=False, output_hidden_states=True).hidden_states
    assert len(fused) == NUM_LAYERS + 1
    for actual, expected in zip(fused, original):
        assert torch.equal(actual, expected)


def test_fused_attention_keeps_transformers_kv_cache_path(model: torch.nn.Module) -> None:
    # With transformers' own cache (a plain generate), the original forward runs.
    prompt = torch.randint(3, 1000, (1, 6), generator=torch.Generator().manual_seed(6))
    settings = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    with torch.inference_mode():
        expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), **settings)
        route_fused_layers(model)
        assert torch.equal(model.generate(prompt, attention_mask=torch.ones_like(prompt), **settings), expected)


def test_routed_model_computes_what_transformers_does_in_fp32(model: torch.nn.Module) -> None:
    ids = torch.randint(3, 1000, (1, 9), generator=torch.Generator().manual_seed(3))
    expected = _logits(model, ids)
    route_linear_layers(model)
    route_fused_layers(model)
    # The C++ kernels: only fp32 summation order differs.
    torch.testing.assert_close(_logits(model, ids), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not packs_fp32_here(), reason="no oneDNN or no AVX2 here")
def test_packed_fp32_linears_compute_transformers_logits_in_a_step_past_the_skinny_rows(
        model: torch.nn.Module) -> None:
    # More rows than the skinny kernel takes: every projection and the lm_head multiply by their
    # oneDNN copies (kernels.dispatch), which sum in another order than MKL.
    ids = torch.randint(3, 1000, (1, MAX_SKINNY_ROWS + 24), generator=torch.Generator().manual_seed(4))
    expected = _logits(model, ids)
    route_linear_layers(model, packed=True)
    route_fused_layers(model, packed=True)
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    copies = [attention.carpool_packed_qkv_weight, attention.o_proj.carpool_packed_weight,
              mlp.carpool_packed_gate_up_weight, mlp.down_proj.carpool_packed_weight,
              model.get_output_embeddings().carpool_packed_weight]
    assert all(copy is not None and copy.dtype == torch.float32 for copy in copies)
    torch.testing.assert_close(_logits(model, ids), expected, rtol=1e-5, atol=1e-5)
    # Nothing of it is warmed up: fp32 copies build their primitives as steps come.
    assert warm_up_packed_layers(model, max_rows=200, max_output_rows=200) == 0


@needs_fast_bf16
def test_packed_bf16_linears_compute_transformers_logits_to_the_bit(model: torch.nn.Module) -> None:
    # oneDNN's GEMM on a weight reordered once is the GEMM F.linear runs after reordering per call.
    model.to(torch.bfloat16)
    ids = torch.randint(3, 1000, (1, 9), generator=torch.Generator().manual_seed(3))
    expected = _logits(model, ids)
    assert route_linear_layers(model, packed=True) == 7 * NUM_LAYERS + 1  # q k v o gate up down, lm_head
    assert all(m.carpool_packed_weight is not None for m in model.modules() if isinstance(m, DispatchedLinear))
    assert torch.equal(_logits(model, ids), expected)
    route_linear_layers(model, dispatched=False)
    assert not any(hasattr(m, "carpool_packed_weight") for m in model.modules())


@needs_fast_bf16
def test_routed_bf16_model_stays_within_bf16_rounding_of_transformers(model: torch.nn.Module) -> None:
    model.to(torch.bfloat16)
    ids = torch.randint(3, 1000, (1, 9), generator=torch.Generator().manual_seed(3))
    expected = _logits(model, ids).float()
    route_linear_layers(model, packed=True)
    route_fused_layers(model, packed=True)
    assert all(m.carpool_packed_gate_up_weight is not None
               for m in model.modules() if hasattr(m, "carpool_gate_up_weight"))
    actual = _logits(model, ids).float()
    # RMSNorm's fp32 sum in another order may tip a bf16 rounding by one step; nothing more.
    torch.testing.assert_close(actual, expected, rtol=0.02, atol=0.02 * expected.abs().max().item())
    assert (actual.argmax(-1) == expected.argmax(-1)).float().mean().item() >= 8 / 9


@needs_fast_bf16
def test_warm_up_visits_each_packed_shape_once(model: torch.nn.Module) -> None:
    model.to(torch.bfloat16)
    assert warm_up_packed_layers(model, max_rows=80, max_output_rows=8) == 0  # nothing packed yet
    route_linear_layers(model, packed=True)
    route_fused_layers(model, packed=True)
    # q/k/v, o, gate/up, down: one shape each for all layers; the lm_head with its own row limit.
    # Where the kernels run AMX the copies are in tile order, which needs no oneDNN primitive.
    on_amx = cpu_amx_linear.is_available()
    assert warm_up_packed_layers(model, max_rows=80, max_output_rows=8) == (0 if on_amx else 5)
    # The projections that fused blocks replaced keep no copy of their own.
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attention.q_proj.carpool_packed_weight is None and mlp.up_proj.carpool_packed_weight is None
    assert attention.o_proj.carpool_packed_weight is not None and mlp.down_proj.carpool_packed_weight is not None
    assert all(cpu_amx_linear.is_packed(packed) == on_amx for packed in (
        attention.o_proj.carpool_packed_weight, mlp.down_proj.carpool_packed_weight,
        attention.carpool_packed_qkv_weight, mlp.carpool_packed_gate_up_weight))


def test_routing_again_after_a_dtype_change_shares_the_new_weights(model: torch.nn.Module) -> None:
    # Engines share one loaded model; one in bf16 after one in fp32 must not multiply by stale fp32 copies.
    route_fused_layers(model)
    model.to(torch.bfloat16)
    route_fused_layers(model)
    mlp, attention = model.model.layers[0].mlp, model.model.layers[0].self_attn
    assert mlp.carpool_gate_up_weight.dtype == attention.carpool_qkv_weight.dtype == torch.bfloat16
    assert mlp.gate_proj.weight.data_ptr() == mlp.carpool_gate_up_weight.data_ptr()
    assert attention.q_proj.weight.data_ptr() == attention.carpool_qkv_weight.data_ptr()
    ids = torch.tensor([[5, 9, 14]])
    routed = _logits(model, ids)
    route_fused_layers(model, fused=False)
    assert torch.allclose(routed.float(), _logits(model, ids).float(), atol=0.05)
