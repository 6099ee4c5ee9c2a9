"""route_fused_layers on the tiny Llama and Qwen2: which modules change, what they share, what
they compute."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from worker.fused_layers import route_fused_layers
from worker.linear_layers import DispatchedLinear, route_linear_layers
from worker.model_loader import load_model

NUM_LAYERS = 2  # worker/tiny_models.py


@pytest.fixture(params=["llama", "qwen2"])
def model(request: pytest.FixtureRequest, tiny_llama_dir: Path, tiny_qwen2_dir: Path) -> torch.nn.Module:
    # A private copy: the session's tiny models are shared with the engine tests.
    directory = tiny_llama_dir if request.param == "llama" else tiny_qwen2_dir
    return load_model(str(directory)).model


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=ids, use_cache=False).logits


def test_routes_every_norm_and_mlp_and_back(model: torch.nn.Module) -> None:
    names = {type(m).__name__ for m in model.modules()}
    arch = "Llama" if "LlamaMLP" in names else "Qwen2"
    # Two norms per layer and the final one, one MLP per layer.
    assert route_fused_layers(model) == 3 * NUM_LAYERS + 1
    routed = {type(m).__name__ for m in model.modules()}
    assert {f"Fused{arch}RMSNorm", f"Fused{arch}MLP"} <= routed
    assert f"{arch}MLP" not in routed and f"{arch}RMSNorm" not in routed
    assert route_fused_layers(model) == 0  # already routed
    assert route_fused_layers(model, fused=False) == 3 * NUM_LAYERS + 1
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


def test_routed_model_computes_what_transformers_does_in_fp32(model: torch.nn.Module) -> None:
    ids = torch.randint(3, 1000, (1, 9), generator=torch.Generator().manual_seed(3))
    expected = _logits(model, ids)
    route_linear_layers(model)
    route_fused_layers(model)
    # The C++ kernels: only fp32 summation order differs.
    torch.testing.assert_close(_logits(model, ids), expected, rtol=1e-5, atol=1e-5)


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


def test_routed_bf16_model_stays_within_bf16_rounding_of_transformers(model: torch.nn.Module) -> None:
    model.to(torch.bfloat16)
    ids = torch.randint(3, 1000, (1, 9), generator=torch.Generator().manual_seed(3))
    expected = _logits(model, ids).float()
    route_linear_layers(model, packed=True)
    route_fused_layers(model, packed=True)
    assert all(m.carpool_packed_gate_up_weight is not None for m in model.modules() if hasattr(m, "carpool_gate_up_weight"))
    actual = _logits(model, ids).float()
    # RMSNorm's fp32 sum in another order may tip a bf16 rounding by one step; nothing more.
    torch.testing.assert_close(actual, expected, rtol=0.02, atol=0.02 * expected.abs().max().item())
    assert (actual.argmax(-1) == expected.argmax(-1)).float().mean().item() >= 8 / 9
