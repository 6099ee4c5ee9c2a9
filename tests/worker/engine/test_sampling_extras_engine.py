"""allowed_token_ids and bad_words through the engine on the tiny model: greedy output against a
reference that applies vLLM's rules to transformers' own logits one token at a time, undisturbed
and through preemption and hand-back (a resumed request's output still counts for bad words)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from protocol.generation import SamplingParams
from tests.worker.conftest import make_engine, random_prompts, run_engine
from tests.worker.engine.test_sampling_fields import HANDED_BACK, hf_logits

PROMPTS = random_prompts(10, seed=11)
# The tiny model's SmolLM2 tokenizer: vLLM's own update_from_tokenizer gives these sequences.
BAD_WORD_SEQUENCES = {
    "Living": ((28293,), (12532,)),  # one token as is and after a space: both kept
    "Outside sampler": ((45221, 44039), (30743, 44039)),
    "pox quadr": ((18101, 20378), (47628, 20378)),
}


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def reference_greedy(model: Any, prompt: list[int], max_tokens: int, eos: set[int],
                     allowed: tuple[int, ...] | None = None,
                     bad_sequences: tuple[tuple[int, ...], ...] = ()) -> list[int]:
    """vLLM's whitelist, then its bad-words ban (against the output only), then argmax."""
    output: list[int] = []
    for _ in range(max_tokens):
        logits = hf_logits(model, prompt + output)
        if allowed is not None:
            keep = torch.zeros_like(logits, dtype=torch.bool)
            keep[list(allowed)] = True
            logits[~keep] = float("-inf")
        for sequence in bad_sequences:
            prefix = sequence[:-1]
            if len(prefix) <= len(output) and tuple(output[len(output) - len(prefix):]) == prefix:
                logits[sequence[-1]] = float("-inf")
        best = int(logits.argmax().item())
        output.append(best)
        if best in eos:
            break
    return output


def outputs(loaded: Any, params: SamplingParams, prompts: list[list[int]] = PROMPTS,
            **overrides: Any) -> list[list[int]]:
    run = run_engine(make_engine(loaded, **overrides),
                     [(f"r{i}", prompt, params) for i, prompt in enumerate(prompts)])
    if overrides:
        assert run.num_preemptions > 0
    return [run.token_ids[f"r{i}"] for i in range(len(prompts))]


def test_bad_words_are_tokenized_as_vllm_does(tiny_llama: Any) -> None:
    engine = make_engine(tiny_llama)
    words = ["hello", " hello", "Hello world", "unbelievable", "  spaced", "x", "123", "日本", "@",
             "hello"]
    # vLLM 0.x's SamplingParams(bad_words=words).update_from_tokenizer(tokenizer), on this tokenizer:
    # the spaced form is dropped where it is longer or shorter ("unbelievable", "123", "日本").
    assert engine._tokenize_bad_words(words) == (
        (28120,), (33662,), (28120,), (33662,), (19556, 905), (38699, 905), (419, 23282, 16275),
        (2401, 2568), (104,), (1792,), (33, 34, 35), (23274, 115, 40993), (48,), (3394,))
    for word, sequences in BAD_WORD_SEQUENCES.items():
        assert engine._tokenize_bad_words([word]) == sequences


@pytest.mark.parametrize("overrides", [{}, HANDED_BACK], ids=["undisturbed", "preempted"])
def test_greedy_with_allowed_token_ids_is_the_argmax_over_them(tiny_llama: Any, hf_model: Any,
                                                               overrides: dict[str, Any]) -> None:
    eos = set(make_engine(tiny_llama).eos_token_ids)
    allowed = tuple(random.Random(5).sample(range(49152), 64))
    params = SamplingParams(max_tokens=12, temperature=0.0, allowed_token_ids=allowed)
    got = outputs(tiny_llama, params, **overrides)
    expected = [reference_greedy(hf_model, prompt, 12, eos, allowed=allowed) for prompt in PROMPTS]
    assert got == expected
    assert all(token in allowed for output in got for token in output)
    plain = outputs(tiny_llama, SamplingParams(max_tokens=12, temperature=0.0))
    assert not any(token in allowed for output in plain for token in output)  # the mask bites


@pytest.mark.parametrize("overrides", [{}, HANDED_BACK], ids=["undisturbed", "preempted"])
def test_greedy_with_bad_words_equals_the_reference_and_never_completes_one(
        tiny_llama: Any, hf_model: Any, overrides: dict[str, Any]) -> None:
    eos = set(make_engine(tiny_llama).eos_token_ids)
    sequences = tuple(s for group in BAD_WORD_SEQUENCES.values() for s in group)
    params = SamplingParams(max_tokens=12, temperature=0.0, bad_words=tuple(BAD_WORD_SEQUENCES))
    got = outputs(tiny_llama, params, **overrides)
    assert got == [reference_greedy(hf_model, prompt, 12, eos, bad_sequences=sequences)
                   for prompt in PROMPTS]
    for output in got:
        for sequence in sequences:
            windows = {tuple(output[i:i + len(sequence)]) for i in range(len(output))}
            assert sequence not in windows
    plain = outputs(tiny_llama, SamplingParams(max_tokens=12, temperature=0.0))
    # Each word was in the plain output: "Living" (prompts 0 and 9), "Outside sampler" (1), and
    # "pox quadr" in its spaced form (2); the other prompts' outputs are unchanged.
    changed = [i for i in range(len(PROMPTS)) if got[i] != plain[i]]
    assert changed == [0, 1, 2, 9]
    assert plain[1][3:5] == [45221, 44039] and got[1][:4] == plain[1][:4] and got[1][4] != 44039


def test_a_bad_words_prefix_in_the_prompt_does_not_count(tiny_llama: Any) -> None:
    plain = outputs(tiny_llama, SamplingParams(max_tokens=12, temperature=0.0), PROMPTS[1:2])[0]
    prompt = PROMPTS[1] + plain[:4]  # ends with "Outside" (45221), which "sampler" (44039) follows
    params = SamplingParams(max_tokens=2, temperature=0.0, bad_words=("Outside sampler",))
    assert outputs(tiny_llama, params, [prompt])[0][0] == 44039  # vLLM matches the output only


def test_an_allowed_token_id_outside_the_vocabulary_is_refused(tiny_llama: Any) -> None:
    engine = make_engine(tiny_llama)
    params = SamplingParams(temperature=0.0, allowed_token_ids=(5, 49152))
    with pytest.raises(ValueError, match=r"allowed_token_ids holds 49152, outside the vocabulary \[0, 49152\)"):
        engine.add_request("r0", [1, 2], params)
    assert not engine.has_unfinished()
