"""100 json_schema generations from the real SmolLM2-135M-Instruct: every one parses and validates."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from protocol.generation import SamplingParams, StructuredOutput, StructuredOutputKind
from tests.worker.conftest import make_engine
from worker.engine.engine import FinishReason

# About 100 s on a busy 2-core box: with the reliability runs, not the fast suite.
pytestmark = [pytest.mark.slow, pytest.mark.reliability]

PERSON = {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "city", "hobbies"],
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 40},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3},
    },
}
ASKS = ["Describe a fictional person as JSON.", "Invent a character who lives in Paris.",
        "Give me a JSON profile of a retired teacher.", "Make up a person who loves chess."]


def _valid(person: Any) -> bool:
    return (isinstance(person, dict) and set(person) == set(PERSON["required"])
            and isinstance(person["name"], str) and 1 <= len(person["name"]) <= 40
            and isinstance(person["age"], int) and 0 <= person["age"] <= 150
            and isinstance(person["city"], str) and len(person["city"]) <= 40
            and isinstance(person["hobbies"], list) and len(person["hobbies"]) <= 3
            and all(isinstance(h, str) and len(h) <= 30 for h in person["hobbies"]))


def test_one_hundred_json_schema_generations_all_parse_and_validate(smollm2_dir: Path) -> None:
    from worker.model.loader import load_model

    engine = make_engine(load_model(str(smollm2_dir)), num_kv_blocks=1024, block_size=16,
                         max_num_seqs=50, max_num_batched_tokens=512)
    constraint = StructuredOutput(StructuredOutputKind.JSON_SCHEMA, json.dumps(PERSON))
    prompts = [engine.encode_chat([{"role": "user", "content": ASKS[i % len(ASKS)]}]) for i in range(100)]
    params = [SamplingParams(max_tokens=200, temperature=0.0 if i < 4 else 0.8, seed=i,
                             structured_output=constraint) for i in range(100)]
    results = engine.generate(prompts, params)
    for i, result in enumerate(results):
        assert result.finish_reason is FinishReason.STOP, (i, result.text)
        assert _valid(json.loads(result.text)), (i, result.text)
