"""Object schemas closed as xgrammar and OpenAI read them (protocol.closed_objects): exact
rewrites, and the cases left open because closing would refuse what the schema means."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from protocol.closed_objects import close_objects
from protocol.generation import StructuredOutput, StructuredOutputKind, grammar_of

CLOSED: dict[str, Any] = {"additionalProperties": False}


def test_an_object_naming_its_properties_gets_no_others_at_any_depth() -> None:
    schema = {"type": "object", "required": ["name"],
              "properties": {"name": {"type": "string"},
                             "address": {"type": "object", "properties": {"city": {"type": "string"}}},
                             "tags": {"type": "array", "items": {"properties": {"k": {}}}}}}
    assert close_objects(schema) == {
        "type": "object", "required": ["name"], **CLOSED,
        "properties": {"name": {"type": "string"},
                       "address": {"type": "object", "properties": {"city": {"type": "string"}}, **CLOSED},
                       "tags": {"type": "array", "items": {"properties": {"k": {}}, **CLOSED}}}}


def test_the_input_is_not_changed() -> None:
    schema = {"properties": {"a": {"properties": {"b": {}}}}}
    before = copy.deepcopy(schema)
    close_objects(schema)
    assert schema == before


def test_what_a_pydantic_model_sends_closes_its_definitions() -> None:
    # openai's parse(response_format=Person) with an Optional[Address] field, as pydantic writes it
    schema = {"$defs": {"Address": {"properties": {"city": {"type": "string"}}, "required": ["city"],
                                    "title": "Address", "type": "object"}},
              "properties": {"name": {"type": "string"},
                             "address": {"anyOf": [{"$ref": "#/$defs/Address"}, {"type": "null"}]}},
              "required": ["name", "address"], "title": "Person", "type": "object"}
    closed = close_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["$defs"]["Address"]["additionalProperties"] is False
    assert closed["properties"]["address"] == schema["properties"]["address"]


@pytest.mark.parametrize("schema", [
    {"properties": {"a": {}}, "additionalProperties": True},
    {"properties": {"a": {}}, "additionalProperties": {"type": "integer"}},
    {"properties": {"a": {}}, "unevaluatedProperties": False},
    {"properties": {"a": {}}, "required": ["a", "b"]},  # b has nowhere to go once closed
    {"properties": {"a": {}}, "allOf": [{"properties": {"b": {}}}]},
    {"properties": {"a": {}}, "anyOf": [{"properties": {"b": {}}}, {"properties": {"c": {}}}]},
    {"properties": {"a": {}}, "$ref": "#/$defs/B", "$defs": {}},
    {"properties": {"a": {}}, "if": {"required": ["a"]}, "then": {"properties": {"b": {}}}},
    {"properties": {"a": {}}, "dependentSchemas": {"a": {"properties": {"b": {}}}}},
    {"not": {"properties": {"a": {}}}},
    {"type": "object"},  # names nothing: any object (json_object's schema)
    {"type": "string"},
], ids=["additional-true", "additional-schema", "unevaluated", "required-unlisted", "allOf-beside",
        "anyOf-beside", "ref-beside", "if-then", "dependentSchemas", "not", "any-object", "string"])
def test_left_as_written_where_closing_would_refuse_what_it_means(schema: dict[str, Any]) -> None:
    assert close_objects(schema) == schema


def test_allof_parts_and_the_definitions_they_use_stay_open_alternatives_close() -> None:
    schema = {"$defs": {"Base": {"properties": {"id": {}}}, "Other": {"properties": {"x": {}}}},
              "properties": {
                  "item": {"allOf": [{"$ref": "#/$defs/Base"}, {"properties": {"name": {}}}]},
                  "either": {"oneOf": [{"properties": {"p": {}}}, {"properties": {"q": {}}}]}}}
    closed = close_objects(schema)
    assert closed["$defs"] == {"Base": {"properties": {"id": {}}},
                               "Other": {"properties": {"x": {}}, **CLOSED}}
    assert closed["properties"]["item"] == schema["properties"]["item"]
    assert closed["properties"]["either"] == {"oneOf": [{"properties": {"p": {}}, **CLOSED},
                                                        {"properties": {"q": {}}, **CLOSED}]}


@pytest.mark.parametrize("value", [True, False, None, 3, "text", [{"properties": {"a": {}}}]])
def test_what_is_not_a_schema_object_comes_back_as_given(value: Any) -> None:
    assert close_objects(value) == value


def test_the_compiled_grammar_is_the_closed_schemas() -> None:
    person = {"type": "object", "properties": {"name": {"type": "string"}}}
    closed = {**person, "additionalProperties": False}

    def grammar(schema: dict[str, Any]) -> str:
        return grammar_of(StructuredOutput(StructuredOutputKind.JSON_SCHEMA, json.dumps(schema)))

    assert grammar(person) == grammar(closed)
    assert grammar(person) != grammar({**person, "additionalProperties": True})


def test_a_spec_that_is_not_json_still_gets_the_compilers_own_error() -> None:
    with pytest.raises(ValueError):
        grammar_of(StructuredOutput(StructuredOutputKind.JSON_SCHEMA, "{not json"))
