"""The structured-output fields of a request, turned into the one constraint a job carries.

OpenAI's `response_format` (json_object, json_schema) and vLLM's extras (`structured_outputs`, and
the older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`) all become a
`StructuredOutput`. The API compiles it with llguidance, the worker's grammar engine (no torch),
so a constraint the worker could not compile is a 400 naming the field, and never reaches a worker.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import llguidance
from pydantic import BaseModel, Field

from api.errors import InvalidRequestError
from protocol import StructuredOutput, StructuredOutputKind
from protocol.generation import MAX_STRUCTURED_OUTPUT_CHARS, grammar_of

ANY_JSON_OBJECT = '{"type":"object"}'
# Text Generation Inference's `response_format` is its grammar (`{"type": ..., "value": ...}`,
# grammar_constraint), not OpenAI's; huggingface_hub's InferenceClient, TGI's own client, sends
# OpenAI's json_schema as {"type": "json_object", "value": schema}. Told apart by `value`.
_TGI_RESPONSE_FORMAT_TYPES = ("json", "json_object", "json_schema", "regex")
_STRUCTURED_OUTPUTS_KEYS = {"json": StructuredOutputKind.JSON_SCHEMA, "regex": StructuredOutputKind.REGEX,
                            "choice": StructuredOutputKind.CHOICE, "grammar": StructuredOutputKind.GRAMMAR}


class StructuredOutputParams(BaseModel):
    """Request fields that constrain the output; at most one of them may be given."""

    response_format: dict[str, Any] | None = Field(
        None, description="{'type': 'text'}, {'type': 'json_object'}, or {'type': 'json_schema', "
                          "'json_schema': {'name': ..., 'schema': {...}, 'strict': true}}; or "
                          "Text Generation Inference's, with the constraint in 'value': "
                          "{'type': 'json' (or 'json_object'), 'value': {schema}}, {'type': "
                          "'json_schema', 'value': {'name': ..., 'schema': {...}}}, {'type': "
                          "'regex', 'value': pattern}; or Together AI's and Fireworks', "
                          "{'type': 'json_object', 'schema': {...}}.")
    structured_outputs: dict[str, Any] | None = Field(
        None, description="vLLM's: exactly one of json (a schema), regex, choice (a list of "
                          "strings), grammar (Lark or GBNF), or json_object: true.")
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM's older name: a JSON schema.")
    guided_regex: str | None = Field(None, strict=True, description="vLLM's older name: a regex.")
    guided_choice: list[str] | None = Field(None, description="vLLM's older name: the strings allowed.")
    guided_grammar: str | None = Field(None, strict=True,
                                       description="vLLM's older name: a Lark or GBNF grammar.")

    def structured_output(self) -> StructuredOutput | None:
        """The constraint these fields ask for (None: free text); 400 naming the bad field."""
        found: list[tuple[str, StructuredOutput]] = []
        if self.response_format is not None:
            constraint = _from_response_format(self.response_format)
            if constraint is not None:
                found.append(("response_format", constraint))
        if self.structured_outputs is not None:
            found.append(("structured_outputs", _from_structured_outputs(self.structured_outputs)))
        if self.guided_json is not None:
            found.append(("guided_json", _json_schema(self.guided_json, "guided_json")))
        if self.guided_regex is not None:
            found.append(("guided_regex", _regex(self.guided_regex, "guided_regex")))
        if self.guided_choice is not None:
            found.append(("guided_choice", _choice(self.guided_choice, "guided_choice")))
        if self.guided_grammar is not None:
            found.append(("guided_grammar", _grammar(self.guided_grammar, "guided_grammar")))
        if len(found) > 1:
            names = ", ".join(f"'{name}'" for name, _ in found)
            raise InvalidRequestError(f"Give at most one output constraint; got {names}", param=found[1][0])
        return found[0][1] if found else None


def grammar_constraint(kind: str, value: Any, param: str) -> StructuredOutput:
    """Text Generation Inference's grammar (its `GrammarType`), `value` at `param`: `json` (or
    `json_object`) a JSON schema, an object or its JSON text; `json_schema` TGI's
    `{"name": optional, "schema": ...}` around one; `regex` a regular expression."""
    if kind == "regex":
        if not isinstance(value, str):
            raise InvalidRequestError(f"'{param}' must be a string (a regular expression)", param=param)
        return _regex(value, param)
    if kind == "json_schema":
        if not isinstance(value, dict) or "schema" not in value:
            raise InvalidRequestError(
                f"'{param}' must be an object with 'schema' (and optionally 'name'), as TGI's "
                "json_schema grammar takes it; a bare JSON schema goes with type 'json'", param=param)
        return _json_schema(value["schema"], f"{param}.schema")
    return _json_schema(value, param)


def check_compiles(constraint: StructuredOutput, param: str) -> None:
    """400 naming `param` unless llguidance compiles the constraint."""
    error = _compile_error(constraint)
    if error:
        raise InvalidRequestError(f"'{param}' does not compile to a grammar: {error}", param=param)


@lru_cache(maxsize=256)
def _compile_error(constraint: StructuredOutput) -> str:
    try:
        grammar = grammar_of(constraint)  # as the worker compiles it
    except ValueError as exc:
        return str(exc)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    return messages[0].strip() if is_error else ""


def _from_response_format(value: dict[str, Any]) -> StructuredOutput | None:
    kind = value.get("type")
    if kind in _TGI_RESPONSE_FORMAT_TYPES and "value" in value:
        if "json_schema" in value:
            raise InvalidRequestError("'response_format' has both 'json_schema' (OpenAI's form) and "
                                      "'value' (TGI's); give one", param="response_format.value")
        return grammar_constraint(str(kind), value["value"], "response_format.value")
    if kind in ("json", "regex"):
        raise InvalidRequestError(f"'response_format' of type {kind!r} (TGI's form) needs its "
                                  "constraint in 'value'", param="response_format.value")
    if kind == "text":
        return None
    if kind == "json_object":
        if value.get("schema") is not None:
            # Together AI's, Fireworks' and Anyscale's form, a schema beside the type (what
            # instructor's JSON_SCHEMA mode sends): held to it, not left to any object.
            if "json_schema" in value:
                raise InvalidRequestError("'response_format' has both 'schema' and 'json_schema'; "
                                          "give one", param="response_format.schema")
            return _json_schema(value["schema"], "response_format.schema")
        return StructuredOutput(StructuredOutputKind.JSON_SCHEMA, ANY_JSON_OBJECT)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidRequestError("'response_format.json_schema' must be an object with 'name' and "
                                      "'schema'", param="response_format.json_schema")
        schema = spec.get("schema")
        if schema is None:  # OpenAI makes the schema optional: any JSON object then
            return StructuredOutput(StructuredOutputKind.JSON_SCHEMA, ANY_JSON_OBJECT)
        return _json_schema(schema, "response_format.json_schema.schema")
    raise InvalidRequestError(f"'response_format.type' must be text, json_object or json_schema (or TGI's "
                              f"json and regex, with 'value'); got {kind!r}", param="response_format.type")


def _from_structured_outputs(value: dict[str, Any]) -> StructuredOutput:
    given = sorted(key for key, v in value.items() if v is not None and v is not False)
    unknown = [key for key in given if key not in _STRUCTURED_OUTPUTS_KEYS and key != "json_object"]
    if unknown:
        raise InvalidRequestError(f"'structured_outputs' has unsupported keys: {', '.join(unknown)} (use "
                                  "one of json, regex, choice, grammar, json_object)",
                                  param=f"structured_outputs.{unknown[0]}")
    if len(given) != 1:
        raise InvalidRequestError("'structured_outputs' needs exactly one of json, regex, choice, grammar "
                                  f"and json_object; got {given or 'none'}", param="structured_outputs")
    key = given[0]
    param = f"structured_outputs.{key}"
    if key == "json_object":
        if value[key] is not True:
            raise InvalidRequestError(f"'{param}' must be true", param=param)
        return _constraint(StructuredOutputKind.JSON_SCHEMA, ANY_JSON_OBJECT, param)
    kind = _STRUCTURED_OUTPUTS_KEYS[key]
    if kind is StructuredOutputKind.JSON_SCHEMA:
        return _json_schema(value[key], param)
    if kind is StructuredOutputKind.CHOICE:
        return _choice(value[key], param)
    if not isinstance(value[key], str):
        raise InvalidRequestError(f"'{param}' must be a string", param=param)
    return _regex(value[key], param) if kind is StructuredOutputKind.REGEX else _grammar(value[key], param)


def _json_schema(schema: Any, param: str) -> StructuredOutput:
    if isinstance(schema, str):  # vLLM takes the schema as JSON text too
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"'{param}' is not valid JSON: {exc}", param=param) from exc
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequestError(f"'{param}' must be a JSON schema (an object)", param=param)
    # JSON Schema's booleans: `true` allows any value, as `{}` does (the compile options apply to
    # an object schema only); `false` allows none.
    if schema is True:
        schema = {}
    elif schema is False:
        raise InvalidRequestError(f"'{param}' is false, which no output can satisfy; give a JSON "
                                  "schema, or true (or {}) for any JSON value", param=param)
    return _constraint(StructuredOutputKind.JSON_SCHEMA, json.dumps(schema, separators=(",", ":")), param)


def _regex(pattern: str, param: str) -> StructuredOutput:
    return _constraint(StructuredOutputKind.REGEX, pattern, param)


def _grammar(grammar: str, param: str) -> StructuredOutput:
    return _constraint(StructuredOutputKind.GRAMMAR, grammar, param)


def _choice(choices: Any, param: str) -> StructuredOutput:
    if (not isinstance(choices, list) or not choices
            or not all(isinstance(c, str) and c for c in choices)):
        raise InvalidRequestError(f"'{param}' must be a non-empty list of non-empty strings", param=param)
    return _constraint(StructuredOutputKind.CHOICE, json.dumps(choices), param)


def _constraint(kind: StructuredOutputKind, spec: str, param: str) -> StructuredOutput:
    if not spec:
        raise InvalidRequestError(f"'{param}' is empty", param=param)
    if len(spec) > MAX_STRUCTURED_OUTPUT_CHARS:
        raise InvalidRequestError(f"'{param}' may be at most {MAX_STRUCTURED_OUTPUT_CHARS} characters "
                                  f"(got {len(spec)})", param=param)
    constraint = StructuredOutput(kind, spec)
    check_compiles(constraint, param)
    return constraint
