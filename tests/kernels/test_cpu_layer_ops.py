"""The C++ layer ops (RMSNorm, SiLU-and-multiply, rotary embedding, KV-cache write) against their torch twins."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kernels import cpu_extension, cpu_layer_ops, dispatch
from tests.kernels.test_torch_kv_cache_write import make_inputs, reference_write

_skip_without_kernel = pytest.mark.skipif(cpu_extension.load() is None, reason="no AVX2 or no compiler here")
_on_each_isa = pytest.mark.usefixtures("each_isa")  # on the AVX2 and (where it runs) the AVX-512 path


def needs_kernel(test: Callable[..., None]) -> Callable[..., None]:
    """A test of the C++ kernels: skipped without them, else run once per CPU path."""
    return _skip_without_kernel(_on_each_isa(test))


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 576), (5, 64), (3, 7, 13), (40, 1536)])
def test_rms_norm_equals_its_twin(shape: tuple[int, ...]) -> None:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=generator) * 3
    weight = torch.randn(shape[-1], generator=generator)
    expected = cpu_layer_ops.rms_norm_torch(x, weight, 1e-5)
    torch.testing.assert_close(cpu_layer_ops.rms_norm_cpu(x, weight, 1e-5), expected, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(dispatch.rms_norm(x, weight, 1e-5), expected, rtol=2e-6, atol=2e-6)


def test_rms_norm_twin_is_llamas() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(24, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(-2, 2, 24))
    x = torch.randn(4, 24, dtype=torch.bfloat16)
    assert torch.equal(cpu_layer_ops.rms_norm_torch(x, norm.weight.to(torch.bfloat16), 1e-6),
                       norm.to(torch.bfloat16)(x))


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 2 * 1536), (7, 2 * 13), (2, 3, 2 * 64)])
def test_silu_and_mul_equals_its_twin(shape: tuple[int, ...]) -> None:
    gate_up = torch.randn(shape, generator=torch.Generator().manual_seed(2)) * 8  # both signs, large |x|
    gate_up[..., 0] = -200.0  # exp(200) would overflow a naive sigmoid
    expected = cpu_layer_ops.silu_and_mul_torch(gate_up)
    torch.testing.assert_close(cpu_layer_ops.silu_and_mul_cpu(gate_up), expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dispatch.silu_and_mul(gate_up), expected, rtol=1e-6, atol=1e-6)


def assert_bf16_matches_twin(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """bf16 kernel against its bf16 twin: both round at the same points, so they may differ only
    where fp32 summation order (or exp's last bit) tips a rounding: by one bf16 step, rarely."""
    assert actual.dtype == expected.dtype == torch.bfloat16
    differs = actual != expected
    assert differs.float().mean().item() <= 0.01, f"{differs.sum().item()} of {actual.numel()} values differ"
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-7, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 576), (5, 64), (3, 7, 13), (40, 1536)])
def test_rms_norm_in_bf16_rounds_where_llama_does(shape: tuple[int, ...]) -> None:
    generator = torch.Generator().manual_seed(3)
    x = (torch.randn(shape, generator=generator) * 3).bfloat16()
    weight = torch.randn(shape[-1], generator=generator).bfloat16()
    expected = cpu_layer_ops.rms_norm_torch(x, weight, 1e-5)
    assert_bf16_matches_twin(cpu_layer_ops.rms_norm_cpu(x, weight, 1e-5), expected)
    assert_bf16_matches_twin(dispatch.rms_norm(x, weight, 1e-5), expected)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 576), (5, 64), (3, 7, 13), (40, 1536)])
def test_fused_add_rms_norm_equals_its_twin(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(5)
    x = (torch.randn(shape, generator=generator) * 3).to(dtype)
    residual = (torch.randn(shape, generator=generator) * 3).to(dtype)
    weight = torch.randn(shape[-1], generator=generator).to(dtype)
    expected_residual = residual.clone()
    expected = cpu_layer_ops.fused_add_rms_norm_torch(x, expected_residual, weight, 1e-5)
    for fused in (cpu_layer_ops.fused_add_rms_norm_cpu, dispatch.fused_add_rms_norm):
        updated = residual.clone()
        out = fused(x, updated, weight, 1e-5)
        assert torch.equal(updated, expected_residual)  # one add, rounded once: equal to the bit
        if dtype == torch.bfloat16:
            assert_bf16_matches_twin(out, expected)
        else:
            torch.testing.assert_close(out, expected, rtol=2e-6, atol=2e-6)


def test_fused_add_rms_norm_twin_is_the_decoder_layers_add_then_norm() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(24, eps=1e-6).to(torch.bfloat16)
    hidden, residual = torch.randn(2, 4, 24, dtype=torch.bfloat16), torch.randn(2, 4, 24, dtype=torch.bfloat16)
    expected_residual = residual + hidden  # LlamaDecoderLayer: residual + hidden_states, then the norm
    out = cpu_layer_ops.fused_add_rms_norm_torch(hidden, residual, norm.weight, 1e-6)
    assert torch.equal(residual, expected_residual)
    assert torch.equal(out, norm(expected_residual))


@needs_kernel
def test_fused_add_rms_norm_refuses_a_residual_of_another_shape() -> None:
    with pytest.raises(ValueError, match="residual shape"):
        cpu_layer_ops.fused_add_rms_norm_cpu(torch.zeros(2, 8), torch.zeros(3, 8), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="one dtype"):
        cpu_layer_ops.fused_add_rms_norm_cpu(torch.zeros(2, 8), torch.zeros(2, 8).bfloat16(), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        cpu_layer_ops.fused_add_rms_norm_cpu(torch.zeros(2, 8), torch.zeros(8, 2).t(), torch.ones(8), 1e-6)


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 2 * 1536), (7, 2 * 13), (2, 3, 2 * 64)])
def test_silu_and_mul_in_bf16_rounds_where_torch_does(shape: tuple[int, ...]) -> None:
    gate_up = (torch.randn(shape, generator=torch.Generator().manual_seed(4)) * 8).bfloat16()
    gate_up[..., 0] = float("nan")
    expected = cpu_layer_ops.silu_and_mul_torch(gate_up)
    actual = cpu_layer_ops.silu_and_mul_cpu(gate_up)
    assert actual[..., 0].isnan().all()  # NaN stays NaN through the bf16 narrowing
    assert_bf16_matches_twin(actual[..., 1:], expected[..., 1:])
    assert_bf16_matches_twin(dispatch.silu_and_mul(gate_up)[..., 1:], expected[..., 1:])


def _rotary_inputs(dtype: torch.dtype, num_tokens: int = 5, head_dim: int = 64) -> tuple[torch.Tensor, ...]:
    # A fused projection's rows: 3 query heads, 1 key head, 1 value head, with a strided row view.
    generator = torch.Generator().manual_seed(7)
    qkv = (torch.randn(num_tokens, 6 * head_dim, generator=generator) * 2).to(dtype)[:, : 5 * head_dim]
    angles = torch.rand(num_tokens, head_dim // 2, generator=generator) * 50
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    return qkv, cos, sin


def test_rotary_twin_is_llamas() -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    qkv, cos, sin = _rotary_inputs(torch.bfloat16)
    q = qkv[:, : 3 * 64].unflatten(-1, (3, 64)).transpose(0, 1).unsqueeze(0)  # [1, heads, T, D]
    k = qkv[:, 3 * 64: 4 * 64].unflatten(-1, (1, 64)).transpose(0, 1).unsqueeze(0)
    q_embed, k_embed = apply_rotary_pos_emb(q, k, cos.unsqueeze(0), sin.unsqueeze(0))
    value_before = qkv[:, 4 * 64:].clone()
    cpu_layer_ops.rotary_embedding_torch(qkv, cos, sin, num_heads=4)
    assert torch.equal(qkv[:, : 3 * 64], q_embed[0].transpose(0, 1).flatten(1))
    assert torch.equal(qkv[:, 3 * 64: 4 * 64], k_embed[0].transpose(0, 1).flatten(1))
    assert torch.equal(qkv[:, 4 * 64:], value_before)  # the value head is not rotated


@needs_kernel
@pytest.mark.parametrize("head_dim", [64, 24, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_kernel_equals_its_twin(dtype: torch.dtype, head_dim: int) -> None:
    qkv, cos, sin = _rotary_inputs(dtype, num_tokens=37, head_dim=head_dim)
    expected = qkv.clone()
    cpu_layer_ops.rotary_embedding_torch(expected, cos, sin, num_heads=4)
    dispatch.rotary_embedding(qkv, cos, sin, num_heads=4)
    if dtype == torch.bfloat16:  # the same rounding points: equal to the bit
        assert torch.equal(qkv, expected)
    else:
        torch.testing.assert_close(qkv, expected, rtol=1e-6, atol=1e-6)


@needs_kernel
def test_rotary_kernel_refuses_heads_past_the_row() -> None:
    qkv, cos, sin = _rotary_inputs(torch.float32)
    with pytest.raises(ValueError, match="must fit"):
        cpu_layer_ops.rotary_embedding_cpu(qkv, cos, sin, num_heads=6)


def test_odd_gate_up_is_refused() -> None:
    with pytest.raises(ValueError, match="even"):
        cpu_layer_ops.silu_and_mul_cpu(torch.zeros(2, 5))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_write_equals_the_reference(dtype: torch.dtype) -> None:
    key, value, key_cache, value_cache, slots = make_inputs(dtype)
    kv = torch.cat([key, value], dim=1)  # strided key and value, as a fused projection leaves them
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    reference_write(key, value, expected_k, expected_v, slots)
    cpu_layer_ops.write_kv_cache_cpu(kv[:, :3], kv[:, 3:], key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_k)
    assert torch.equal(value_cache, expected_v)


@needs_kernel
def test_kv_cache_write_refuses_a_slot_past_the_cache() -> None:
    key, value, key_cache, value_cache, slots = make_inputs(torch.float32)
    before = key_cache.clone()
    slots[4] = key_cache.shape[0] * key_cache.shape[1]
    with pytest.raises(ValueError, match=r"slot_mapping\[4\] = 24 is past the cache's 24 slots"):
        cpu_layer_ops.write_kv_cache_cpu(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, before)  # checked before anything is written
