"""The logits-processing fields (penalties, logit_bias, min_tokens, stop_token_ids, min_p) and
logprobs, through the engine on a tiny model, against references written here from vLLM's
formulas and transformers' own logits; every case also through preemption and hand-back."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from protocol.generation import SamplingParams
from tests.worker.conftest import Run, make_engine, random_prompts, run_engine
from worker.engine.engine import FinishReason

PROMPTS = random_prompts(10, seed=11)
# A small pool and few seats: sequences are preempted and resumed mid-generation.
PREEMPTING = {"num_kv_blocks": 24, "max_num_seqs": 8}
HANDED_BACK = {**PREEMPTING, "requeue_preempted": False}  # resumed through add_request, as a worker does


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def hf_logits(model: Any, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(torch.tensor([tokens])).logits[0, -1].float()
    return logits.clone()  # outside inference mode: a tensor the tests may edit


def reference_greedy(model: Any, prompt: list[int], p: SamplingParams, eos: set[int]) -> list[int]:
    """vLLM's logits processing, one token at a time with scalar loops, then argmax."""
    tokens, output = list(prompt), []
    stops = set(p.stop_token_ids) | (set() if p.ignore_eos else eos)
    for index in range(p.max_tokens):
        logits = hf_logits(model, tokens).tolist()
        if index < p.min_tokens:
            for token_id in stops:
                logits[token_id] = -math.inf
        for token_id, bias in p.logit_bias:
            logits[token_id] += bias
        for token_id in set(tokens):  # repetition: prompt and output
            value = logits[token_id]
            logits[token_id] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
        for token_id, count in Counter(output).items():  # frequency and presence: output only
            logits[token_id] -= p.frequency_penalty * count + p.presence_penalty
        best = logits.index(max(logits))  # the first of equal maxima: the lowest id
        output.append(best)
        tokens.append(best)
        if best in stops:
            break
    return output


PENALTY_CASES = {
    "repetition": SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.8),
    "repetition-below-one": SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=0.6),
    "frequency": SamplingParams(max_tokens=24, temperature=0.0, frequency_penalty=1.5),
    "presence": SamplingParams(max_tokens=24, temperature=0.0, presence_penalty=2.0),
    "negative-presence": SamplingParams(max_tokens=24, temperature=0.0, presence_penalty=-1.0),
    "all-three": SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.3,
                                frequency_penalty=0.7, presence_penalty=0.4),
}


def requests_of(params: SamplingParams, prompts: list[list[int]] = PROMPTS) -> list[tuple[str, list[int], Any]]:
    return [(f"r{i}", prompt, params) for i, prompt in enumerate(prompts)]


@pytest.mark.parametrize("case", list(PENALTY_CASES))
def test_greedy_penalties_equal_the_reference(tiny_llama: Any, hf_model: Any, case: str) -> None:
    params = PENALTY_CASES[case]
    eos = set(make_engine(tiny_llama).eos_token_ids)
    expected = [reference_greedy(hf_model, prompt, params, eos) for prompt in PROMPTS]
    plain = run_engine(make_engine(tiny_llama), requests_of(dataclasses.replace(
        params, repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0)))
    assert [plain.token_ids[f"r{i}"] for i in range(len(PROMPTS))] != expected  # penalties bite
    for overrides in ({}, PREEMPTING, HANDED_BACK):
        run = run_engine(make_engine(tiny_llama, **overrides), requests_of(params))
        assert [run.token_ids[f"r{i}"] for i in range(len(PROMPTS))] == expected, overrides
        if overrides:
            assert run.num_preemptions > 0


def test_penalised_rows_leave_the_others_alone(tiny_llama: Any, hf_model: Any) -> None:
    """A mixed batch: plain rows get plain greedy, penalised rows their own reference."""
    plain = SamplingParams(max_tokens=16, temperature=0.0)
    penalised = SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=2.0,
                               frequency_penalty=1.0)
    requests = [(f"r{i}", prompt, penalised if i % 2 else plain) for i, prompt in enumerate(PROMPTS)]
    run = run_engine(make_engine(tiny_llama), requests)
    eos = set(make_engine(tiny_llama).eos_token_ids)
    for request_id, prompt, params in requests:
        assert run.token_ids[request_id] == reference_greedy(hf_model, prompt, params, eos)


def test_logit_bias_steers_and_bans(tiny_llama: Any, hf_model: Any) -> None:
    engine = make_engine(tiny_llama)
    eos = set(engine.eos_token_ids)
    plain = run_engine(engine, requests_of(SamplingParams(max_tokens=8, temperature=0.0)))
    banned = plain.token_ids["r0"][0]
    params = SamplingParams(max_tokens=8, temperature=0.0,
                            logit_bias=((banned, -100.0), (4242, 100.0), (77, 3.5)))
    for overrides in ({}, HANDED_BACK):
        run = run_engine(make_engine(tiny_llama, **overrides), requests_of(params))
        for i, prompt in enumerate(PROMPTS):
            assert run.token_ids[f"r{i}"] == reference_greedy(hf_model, prompt, params, eos)
            assert run.token_ids[f"r{i}"] == [4242] * 8  # +100 wins every step
    ban_only = SamplingParams(max_tokens=8, temperature=0.0, logit_bias=((banned, -100.0),))
    run = run_engine(make_engine(tiny_llama), requests_of(ban_only))
    assert banned not in run.token_ids["r0"]
    assert run.token_ids["r0"] == reference_greedy(hf_model, PROMPTS[0], ban_only, eos)


def test_stop_token_ids_end_like_eos_and_min_tokens_masks_them(tiny_llama: Any) -> None:
    engine = make_engine(tiny_llama)
    plain = run_engine(engine, requests_of(SamplingParams(max_tokens=12, temperature=0.0)))
    tokens = plain.token_ids["r1"]
    stop_at = tokens[5]
    first = tokens.index(stop_at)
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop_at,))
    run = run_engine(make_engine(tiny_llama), [("r1", PROMPTS[1], params)])
    assert run.token_ids["r1"] == tokens[: first + 1]  # the stop token is kept, as vLLM does
    assert run.reasons["r1"] is FinishReason.STOP
    # min_tokens past that point: the stop token cannot be drawn before it, so the output differs
    # there and runs on to min_tokens at least.
    masked = dataclasses.replace(params, min_tokens=first + 2)
    run = run_engine(make_engine(tiny_llama), [("r1", PROMPTS[1], masked)])
    out = run.token_ids["r1"]
    assert out[:first] == tokens[:first]
    assert stop_at not in out[: first + 2]
    assert len(out) >= first + 2


def test_min_tokens_holds_off_eos(tiny_llama: Any) -> None:
    eos = next(iter(make_engine(tiny_llama).eos_token_ids))
    # +100 on EOS makes it the greedy pick every step: min_tokens alone keeps it out.
    params = SamplingParams(max_tokens=10, temperature=0.0, min_tokens=4, logit_bias=((eos, 100.0),))
    run = run_engine(make_engine(tiny_llama), requests_of(params, PROMPTS[:3]))
    for i in range(3):
        assert len(run.token_ids[f"r{i}"]) == 5
        assert run.token_ids[f"r{i}"][-1] == eos
        assert eos not in run.token_ids[f"r{i}"][:4]
        assert run.reasons[f"r{i}"] is FinishReason.STOP


def test_min_tokens_holds_off_stop_strings(tiny_llama: Any) -> None:
    engine = make_engine(tiny_llama)
    plain = run_engine(engine, [("r0", PROMPTS[0], SamplingParams(max_tokens=12, temperature=0.0))])
    text = plain.texts["r0"]
    stop = text[:3].strip() or text[:3]
    early = run_engine(make_engine(tiny_llama), [("r0", PROMPTS[0], SamplingParams(
        max_tokens=12, temperature=0.0, stop=(stop,)))])
    assert early.reasons["r0"] is FinishReason.STOP
    held = run_engine(make_engine(tiny_llama), [("r0", PROMPTS[0], SamplingParams(
        max_tokens=12, temperature=0.0, stop=(stop,), min_tokens=12))])
    assert held.token_ids["r0"] == plain.token_ids["r0"]
    assert held.texts["r0"] == text


def logprob_reference(model: Any, prompt: list[int], output: list[int], temperature: float = 1.0,
                      ) -> list[torch.Tensor]:
    return [torch.log_softmax(hf_logits(model, prompt + output[:i]) / temperature, dim=-1)
            for i in range(len(output))]


def collect_logprobs(engine: Any, requests: list[tuple[str, list[int], Any]]) -> tuple[Run, dict[str, list[Any]]]:
    logprobs: dict[str, list[Any]] = {}
    run = Run()
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    while engine.has_unfinished():
        out = engine.step()
        run.collect(out)
        for request in out.outputs:
            for entry in request.tokens:
                logprobs.setdefault(request.request_id, []).append(entry.logprobs)
        for preempted in out.preempted:
            prompt, params = next((p, s) for r, p, s in requests if r == preempted.request_id)
            engine.add_request(preempted.request_id, prompt, params, preempted.output_token_ids)
    return run, logprobs


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
@pytest.mark.parametrize("overrides", [{}, HANDED_BACK], ids=["undisturbed", "preempted"])
def test_logprobs_equal_transformers_log_softmax(tiny_llama: Any, hf_model: Any,
                                                 overrides: dict[str, Any], mode: str) -> None:
    """Raw (the default, vLLM's): the model's distribution whatever the temperature; processed:
    at the request's temperature, the distribution the token was drawn from."""
    greedy = SamplingParams(max_tokens=10, temperature=0.0, logprobs=5)
    sampled = SamplingParams(max_tokens=10, temperature=0.7, seed=3, logprobs=3)
    none = SamplingParams(max_tokens=10, temperature=0.0)
    requests = [(f"r{i}", prompt, (greedy, sampled, none)[i % 3]) for i, prompt in enumerate(PROMPTS)]
    run, logprobs = collect_logprobs(make_engine(tiny_llama, logprobs_mode=mode, **overrides),
                                     requests)
    if overrides:
        assert run.num_preemptions > 0
    for request_id, prompt, params in requests:
        output = run.token_ids[request_id]
        if params.logprobs is None:
            assert logprobs[request_id] == [None] * len(output)
            continue
        assert len(logprobs[request_id]) == len(output)
        temperature = (params.temperature or 1.0) if mode == "processed_logprobs" else 1.0
        references = logprob_reference(hf_model, prompt, output, temperature)
        for token_id, entry, reference in zip(output, logprobs[request_id], references):
            assert entry.logprob == pytest.approx(reference[token_id].item(), abs=1e-4)
            top = reference.topk(params.logprobs)
            assert [i for i, _ in entry.top] == top.indices.tolist()
            assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)
            if params.is_greedy:
                assert entry.top[0][0] == token_id


def test_logprobs_zero_gives_only_the_sampled_token(tiny_llama: Any, hf_model: Any) -> None:
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=0)
    run, logprobs = collect_logprobs(make_engine(tiny_llama), [("r0", PROMPTS[0], params)])
    references = logprob_reference(hf_model, PROMPTS[0], run.token_ids["r0"])
    for token_id, entry, reference in zip(run.token_ids["r0"], logprobs["r0"], references):
        assert entry.top == ()
        assert entry.logprob == pytest.approx(reference[token_id].item(), abs=1e-4)


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_logprobs_of_a_biased_and_penalized_request(tiny_llama: Any, hf_model: Any,
                                                    mode: str) -> None:
    """Processed (vLLM's processed_logprobs): log_softmax of the processed logits, so the biased
    token's value moves with its bias; raw: the model's own, as if neither were asked."""
    params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=1, logit_bias=((4242, 5.0),),
                            presence_penalty=1.0)
    run, logprobs = collect_logprobs(make_engine(tiny_llama, logprobs_mode=mode),
                                     [("r0", PROMPTS[0], params)])
    output = run.token_ids["r0"]
    for index, entry in enumerate(logprobs["r0"]):
        logits = hf_logits(hf_model, PROMPTS[0] + output[:index])
        if mode == "processed_logprobs":
            logits[4242] += 5.0
            for token_id in set(output[:index]):
                logits[token_id] -= 1.0
        expected = torch.log_softmax(logits, dim=-1)
        assert entry.logprob == pytest.approx(expected[output[index]].item(), abs=1e-4)
        assert entry.top[0] == (expected.argmax().item(), pytest.approx(expected.max().item(), abs=1e-4))


SEEDED = {
    "temperature": SamplingParams(max_tokens=16, temperature=1.0, seed=123),
    "top-k-min-p": SamplingParams(max_tokens=16, temperature=0.9, top_k=50, min_p=0.05, seed=7),
    "penalties-bias": SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=99,
                                     repetition_penalty=1.2, presence_penalty=0.5,
                                     logit_bias=((4242, 2.0),)),
}


@pytest.mark.parametrize("case", list(SEEDED))
def test_seeded_sampling_is_reproducible_and_resume_safe(tiny_llama: Any, case: str) -> None:
    params = SEEDED[case]
    first = run_engine(make_engine(tiny_llama), requests_of(params))
    again = run_engine(make_engine(tiny_llama), requests_of(params))
    alone = run_engine(make_engine(tiny_llama), requests_of(params)[:1])
    preempted = run_engine(make_engine(tiny_llama, **HANDED_BACK), requests_of(params))
    assert preempted.num_preemptions > 0
    assert first.token_ids == again.token_ids == preempted.token_ids
    assert alone.token_ids["r0"] == first.token_ids["r0"]
    other_seed = run_engine(make_engine(tiny_llama), requests_of(dataclasses.replace(params, seed=1)))
    assert other_seed.token_ids != first.token_ids


def _drawn_with_logits(tiny_llama: Any, hf_model: Any,
                       params: SamplingParams) -> Iterator[tuple[int, torch.Tensor]]:
    """Each token the engine drew for the first four prompts, with transformers' logits of the
    position it was drawn at."""
    run = run_engine(make_engine(tiny_llama), requests_of(params, PROMPTS[:4]))
    for i, prompt in enumerate(PROMPTS[:4]):
        output = run.token_ids[f"r{i}"]
        for index, token_id in enumerate(output):
            yield token_id, hf_logits(hf_model, prompt + output[:index])


def test_min_p_keeps_only_tokens_near_the_top(tiny_llama: Any, hf_model: Any) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, min_p=0.5, seed=5)
    for token_id, logits in _drawn_with_logits(tiny_llama, hf_model, params):
        probs = torch.softmax(logits, dim=-1)
        assert probs[token_id] >= 0.5 * probs.max() - 1e-6


def test_typical_p_draws_only_tokens_the_typical_filter_keeps(tiny_llama: Any, hf_model: Any) -> None:
    from transformers.generation.logits_process import TypicalLogitsWarper

    params = SamplingParams(max_tokens=12, temperature=1.0, typical_p=0.3, seed=5)
    for token_id, logits in _drawn_with_logits(tiny_llama, hf_model, params):
        kept = TypicalLogitsWarper(0.3)(torch.zeros(1, 1, dtype=torch.long), logits.unsqueeze(0))[0]
        assert torch.isfinite(kept[token_id]), token_id
