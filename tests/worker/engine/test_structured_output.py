"""Structured outputs: the token mask on the SmolLM2 tokenizer (exact ids), and the engine keeping
its output inside the grammar, greedy and sampled, through preemptions."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from protocol.generation import SamplingParams, StructuredOutput, StructuredOutputKind
from tests.worker.conftest import make_engine, run_engine
from worker.engine.engine import FinishReason
from worker.engine.structured_output import StructuredOutputs

VOCAB_SIZE = 49152
EOS = 2
# SmolLM2 token ids: "y", "ye", "yes", "n", "no", "a", "b", "ab"
Y, YE, YES, N, NO, A, B, AB = 105, 6602, 10407, 94, 4607, 81, 82, 369

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}}}


def choice(*options: str) -> StructuredOutput:
    return StructuredOutput(StructuredOutputKind.CHOICE, json.dumps(list(options)))


def regex(pattern: str) -> StructuredOutput:
    return StructuredOutput(StructuredOutputKind.REGEX, pattern)


def json_schema(schema: dict[str, Any]) -> StructuredOutput:
    return StructuredOutput(StructuredOutputKind.JSON_SCHEMA, json.dumps(schema))


@pytest.fixture(scope="module")
def outputs(smollm2_dir: Path) -> StructuredOutputs:
    from transformers import AutoTokenizer

    return StructuredOutputs(AutoTokenizer.from_pretrained(smollm2_dir), VOCAB_SIZE, {EOS})


def allowed(outputs: StructuredOutputs, request_ids: list[str]) -> list[list[int]]:
    """The token ids each constrained row may take, through the mask as the engine applies it."""
    mask = outputs.bitmask(request_ids)
    assert mask is not None
    logits = torch.zeros(len(request_ids), VOCAB_SIZE)
    mask.apply(logits)
    return [torch.isfinite(logits[row]).nonzero().flatten().tolist() for row in mask.rows.tolist()]


def test_choice_allows_exactly_the_tokens_that_begin_a_choice(outputs: StructuredOutputs) -> None:
    outputs.add("c", choice("yes", "no"), [])
    try:
        assert allowed(outputs, ["c"]) == [[N, Y, NO, YE, YES]]
        assert outputs.advance(["c"], [YES]) == {"c"}  # complete: nothing but EOS may follow
        assert allowed(outputs, ["c"]) == [[EOS]]
    finally:
        outputs.remove("c")


def test_the_mask_covers_only_constrained_rows_of_a_batch(outputs: StructuredOutputs) -> None:
    outputs.add("r", regex("ab|b"), [])
    try:
        mask = outputs.bitmask(["free", "r", "other"])
        assert mask is not None and mask.rows.tolist() == [1]
        logits = torch.zeros(3, VOCAB_SIZE)
        mask.apply(logits)
        assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()
        assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [A, B, AB]
        assert outputs.bitmask(["free", "other"]) is None
        assert outputs.advance(["free", "r"], [A, A]) == set()  # "a": "b" must follow
        assert allowed(outputs, ["r"]) == [[B]]
    finally:
        outputs.remove("r")


def test_replayed_tokens_resume_the_grammar_where_it_was(outputs: StructuredOutputs) -> None:
    outputs.add("resumed", regex("ab|b"), [A])
    outputs.add("done", regex("ab|b"), [AB])
    try:
        assert allowed(outputs, ["resumed", "done"]) == [[B], [EOS]]
    finally:
        outputs.remove("resumed")
        outputs.remove("done")
    with pytest.raises(ValueError, match="do not fit the structured output"):
        outputs.add("bad", regex("ab|b"), [B, B])
    assert "bad" not in outputs


def test_a_grammar_that_does_not_compile_is_a_value_error(outputs: StructuredOutputs) -> None:
    with pytest.raises(ValueError, match="does not compile"):
        outputs.add("x", regex("a(b"), [])
    assert len(outputs) == 0


def test_the_schema_the_api_makes_of_true_allows_any_json_value(outputs: StructuredOutputs,
                                                                smollm2_dir: Path) -> None:
    # JSON Schema's `true` reaches the worker as `{}` (api/structured_output.py): llguidance's
    # compile options apply to object schemas only, and `true` itself failed here at the claim.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    brace, bracket, quote = (tokenizer.convert_tokens_to_ids(t) for t in ("{", "[", '"'))
    outputs.add("any", StructuredOutput(StructuredOutputKind.JSON_SCHEMA, "{}"), [])
    try:
        (first,) = allowed(outputs, ["any"])
        assert {brace, bracket, quote, N} <= set(first)  # an object, an array, a string, null
        assert A not in first and Y not in first and EOS not in first
    finally:
        outputs.remove("any")


def test_an_object_schema_admits_only_the_properties_it_names(outputs: StructuredOutputs,
                                                              smollm2_dir: Path) -> None:
    # As xgrammar (vLLM's default) and OpenAI read it: SmolLM2 wrote "happy" after a person's
    # name and age here while the spec's "additionalProperties: true" was compiled as written.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    person = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}

    def fits(schema: dict[str, Any], text: str) -> bool:
        try:
            outputs.add("p", json_schema(schema), tokenizer.encode(text, add_special_tokens=False))
        except ValueError:
            return False
        outputs.remove("p")
        return True

    assert fits(person, '{"name": "Ann", "age": 7}')
    assert not fits(person, '{"name": "Ann", "age": 7, "happy": 1}')
    assert fits({**person, "additionalProperties": True}, '{"name": "Ann", "age": 7, "happy": 1}')


# -- the engine, on the tiny random model (its logits know nothing of JSON) -------------------

PROMPTS = [[1, 504, 3458, 314], [1, 2030, 17, 11, 900, 42], [1, 77], [1, 9, 8, 7, 6, 5, 4, 3, 100]]


def requests(constraint: StructuredOutput, temperature: float) -> list[tuple[str, list[int], SamplingParams]]:
    return [(f"r{i}", prompt, SamplingParams(max_tokens=48, temperature=temperature, seed=i,
                                             structured_output=constraint))
            for i, prompt in enumerate(PROMPTS)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_output_stays_inside_the_grammar(tiny_llama: Any, temperature: float) -> None:
    engine = make_engine(tiny_llama)
    run = run_engine(engine, requests(regex(r"[a-z]{2,6}( [a-z]{2,6}){2}\."), temperature))
    for request_id, text in run.texts.items():
        assert re.fullmatch(r"[a-z]{2,6}( [a-z]{2,6}){2}\.", text), (request_id, text)
        assert run.reasons[request_id] is FinishReason.STOP
    assert len(engine.structured_outputs) == 0


def test_json_schema_output_parses_or_stops_at_the_length_limit(tiny_llama: Any) -> None:
    engine = make_engine(tiny_llama)
    run = run_engine(engine, requests(json_schema(PERSON), 0.0))
    for request_id, text in run.texts.items():
        if run.reasons[request_id] is FinishReason.STOP:
            person = json.loads(text)
            assert set(person) == {"name", "age"} and isinstance(person["age"], int)
        else:  # a random model may spin in whitespace until max_tokens; what it wrote is a prefix
            assert run.reasons[request_id] is FinishReason.LENGTH
            assert text.lstrip().startswith("{")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_preempted_constrained_requests_resume_identically(tiny_llama: Any, temperature: float) -> None:
    constraint = regex(r"[a-z]{2,6}( [a-z]{2,6}){15}\.")  # long enough to outgrow the pool
    undisturbed = run_engine(make_engine(tiny_llama), requests(constraint, temperature))
    # 20 blocks of 4 slots for 4 sequences of up to 57 tokens: preempted over and over, each
    # resumption handed back and re-added with its tokens, as the Redis worker does.
    engine = make_engine(tiny_llama, num_kv_blocks=20, max_num_seqs=4, requeue_preempted=False)
    pressed = run_engine(engine, requests(constraint, temperature))
    assert pressed.num_preemptions > 0
    assert pressed.token_ids == undisturbed.token_ids
    assert pressed.texts == undisturbed.texts
    for text in pressed.texts.values():
        assert re.fullmatch(r"[a-z]{2,6}( [a-z]{2,6}){15}\.", text)


def test_a_constraint_that_does_not_compile_is_refused_at_add_request(tiny_llama: Any) -> None:
    engine = make_engine(tiny_llama)
    with pytest.raises(ValueError, match="does not compile"):
        engine.add_request("x", [1, 2], SamplingParams(structured_output=regex("a(b")))
    assert not engine.has_unfinished()
