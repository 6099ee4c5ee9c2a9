"""Prompt logprobs through the engine on a tiny model: each prompt token's log-probability given
the ones before it equals torch.log_softmax of transformers' logits there, with the prefix cache
warm, prefill split in chunks, and preemption; requests that do not ask get none."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from protocol.generation import SamplingParams, TokenLogprobs
from tests.worker.conftest import make_engine, random_prompts

PROMPTS = random_prompts(10, seed=23)


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def reference(model: Any, prompt: list[int]) -> torch.Tensor:
    """log_softmax of the logits at every prompt position: [len(prompt), vocab_size]."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def run_collecting(engine: Any, requests: list[tuple[str, list[int], SamplingParams]],
                   ) -> tuple[dict[str, list[list[TokenLogprobs | None] | None]], int]:
    """Every prompt_logprobs a request's outputs carried (a list per delivery), and the number
    of preemptions; preempted requests are resumed as the Redis worker does."""
    delivered: dict[str, list[list[TokenLogprobs | None] | None]] = {r: [] for r, _, _ in requests}
    outputs: dict[str, list[int]] = {r: [] for r, _, _ in requests}
    num_preemptions = 0
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    while engine.has_unfinished():
        out = engine.step()
        num_preemptions += out.stats.num_preemptions
        for request in out.outputs:
            outputs[request.request_id] += [entry.token_id for entry in request.tokens]
            if request.prompt_logprobs is not None:
                delivered[request.request_id].append(request.prompt_logprobs)
        for preempted in out.preempted:
            prompt, params = next((p, s) for r, p, s in requests if r == preempted.request_id)
            engine.add_request(preempted.request_id, prompt, params, preempted.output_token_ids)
    return delivered, num_preemptions


def check_against_reference(model: Any, prompt: list[int], got: list[TokenLogprobs | None], k: int) -> None:
    assert len(got) == len(prompt)
    assert got[0] is None  # nothing precedes the first prompt token
    expected = reference(model, prompt)
    for position in range(1, len(prompt)):
        entry, row = got[position], expected[position - 1]
        assert entry is not None
        assert entry.logprob == pytest.approx(row[prompt[position]].item(), abs=1e-4)
        # vLLM's rank: 1 + the tokens more likely (tokens within fp32 noise of it may go either way).
        target = row[prompt[position]]
        assert int((row > target + 1e-4).sum()) + 1 <= entry.rank <= int((row > target - 1e-4).sum()) + 1
        top = row.topk(k) if k else None
        assert [i for i, _ in entry.top] == (top.indices.tolist() if top is not None else [])
        if top is not None:
            assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)


@pytest.mark.parametrize("overrides", [
    {},
    {"max_num_batched_tokens": 16},  # prompts prefilled in chunks: the chunks accumulate
    {"num_kv_blocks": 24, "max_num_seqs": 8, "requeue_preempted": False},  # preempted, handed back
], ids=["whole", "chunked", "preempted"])
def test_prompt_logprobs_equal_transformers_log_softmax(tiny_llama: Any, hf_model: Any,
                                                        overrides: dict[str, Any]) -> None:
    asking = SamplingParams(max_tokens=8, temperature=0.0, prompt_logprobs=3)
    asking_zero = SamplingParams(max_tokens=8, temperature=0.7, seed=1, prompt_logprobs=0)
    plain = SamplingParams(max_tokens=8, temperature=0.0)
    requests = [(f"r{i}", prompt, (asking, asking_zero, plain)[i % 3]) for i, prompt in enumerate(PROMPTS)]
    delivered, num_preemptions = run_collecting(make_engine(tiny_llama, **overrides), requests)
    if "requeue_preempted" in overrides:
        assert num_preemptions > 0
    for request_id, prompt, params in requests:
        if params.prompt_logprobs is None:
            assert delivered[request_id] == []
            continue
        assert len(delivered[request_id]) == 1, "prompt logprobs are handed out exactly once"
        got = delivered[request_id][0]
        assert got is not None
        check_against_reference(hf_model, prompt, got, params.prompt_logprobs)


def test_warm_prefix_cache_still_gives_every_prompt_position(tiny_llama: Any, hf_model: Any) -> None:
    """The same prompt twice: the second run finds the prefix cached, yet computes every position
    for the request that asks, while a plain request still takes the cache."""
    engine = make_engine(tiny_llama, enable_prefix_caching=True)
    prompt = PROMPTS[8]  # 60 tokens: many full blocks
    params = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=2)
    first, _ = run_collecting(engine, [("a", prompt, params)])
    second, _ = run_collecting(engine, [("b", prompt, params)])
    assert first["a"] == second["b"]
    got = second["b"][0]
    assert got is not None
    check_against_reference(hf_model, prompt, got, 2)
    engine.add_request("c", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    assert engine.step().stats.num_cached_tokens > 0  # requests that do not ask still hit the cache


def test_a_resumed_request_does_not_compute_them_again(tiny_llama: Any) -> None:
    """Resumed with output tokens (its prompt logprobs went out with its first token), a request
    neither skips the cache for them nor hands them out again."""
    engine = make_engine(tiny_llama, enable_prefix_caching=True)
    prompt = PROMPTS[8]
    params = SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=1)
    run_collecting(engine, [("warm", prompt, SamplingParams(max_tokens=1, temperature=0.0))])
    engine.add_request("resumed", prompt, params, output_token_ids=[5, 6])
    out = engine.step()
    assert out.stats.num_cached_tokens > 0
    assert all(request.prompt_logprobs is None for request in out.outputs)


def test_one_token_prompt_gives_a_single_null(tiny_llama: Any) -> None:
    delivered, _ = run_collecting(make_engine(tiny_llama), [
        ("r", [42], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=5))])
    assert delivered["r"] == [[None]]
