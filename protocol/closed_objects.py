"""JSON schemas read as vLLM's default grammar engine and OpenAI read them: an object schema that
names its properties allows no others unless it says so.

The JSON Schema spec lets an object carry properties it does not name ("additionalProperties"
defaults to true) and llguidance compiles that faithfully, so SmolLM2 asked for {"name", "age"}
wrote "happy" and "fantasy" after them, and a tool call of get_weather(city) got a "weather"
argument the function does not take. xgrammar, vLLM's default for JSON, generates only the named
properties (its strict mode); OpenAI's structured outputs require "additionalProperties": false;
vLLM's guidance backend has an option for the same (`disable_additional_properties`). Here it is
the default; a schema that wants more says so ("additionalProperties": true, or a schema for them).

An object is left open where closing it would refuse what the schema means: where allOf, anyOf,
oneOf, $ref, if/then/else or dependentSchemas beside its properties may add others; where it
requires a property it does not name; for the members of an allOf (each holds part of one object)
and the definitions such members refer to; under `not`, whose meaning closing would invert.
"""

from __future__ import annotations

from typing import Any

# Keywords whose value is a map of names to subschemas, one subschema, or a list of subschemas.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_VALUES = ("additionalProperties", "items", "contains", "propertyNames", "if", "then", "else",
                  "not", "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
# Beside an object's properties, these may add properties of their own: the object stays open.
_MAY_ADD_PROPERTIES = ("additionalProperties", "unevaluatedProperties", "allOf", "anyOf", "oneOf",
                       "$ref", "if", "then", "else", "dependentSchemas")
_DEFINITION_PREFIXES = ("#/$defs/", "#/definitions/")


def close_objects(schema: Any) -> Any:
    """A copy of `schema` (parsed JSON) whose object schemas that name their properties allow no
    others (see the module's docstring for those left open); anything else is returned as given."""
    return _close(schema, may_close=True, open_definitions=_parts_of_objects(schema))


def _close(schema: Any, may_close: bool, open_definitions: set[str]) -> Any:
    if not isinstance(schema, dict):
        return schema  # a true/false schema, or something the grammar compiler will name
    closed = dict(schema)
    names_properties = "properties" in schema or "patternProperties" in schema
    for keyword in _SCHEMA_MAPS:
        members = schema.get(keyword)
        if isinstance(members, dict):
            is_definitions = keyword in ("$defs", "definitions")
            closed[keyword] = {
                # dependentSchemas add to the object around them, as allOf's members do.
                name: _close(member, keyword != "dependentSchemas"
                             and not (is_definitions and name in open_definitions),
                             open_definitions)
                for name, member in members.items()}
    for keyword in _SCHEMA_VALUES:
        member = schema.get(keyword)
        if isinstance(member, dict):
            # then/else hold part of the object around them (as allOf's members do); `not` inverts.
            member_may_close = keyword not in ("then", "else", "not")
            closed[keyword] = _close(member, member_may_close, open_definitions)
    for keyword in _SCHEMA_LISTS:
        members = schema.get(keyword)
        if isinstance(members, list):
            # anyOf / oneOf alternatives are whole objects, unless the schema around them names
            # properties too (then each adds to those).
            member_may_close = keyword not in ("allOf", "anyOf", "oneOf") or (
                keyword != "allOf" and not names_properties)
            closed[keyword] = [_close(member, member_may_close, open_definitions)
                               for member in members]
    if may_close and _closable(schema):
        closed["additionalProperties"] = False
    return closed


def _closable(schema: dict[str, Any]) -> bool:
    if "properties" not in schema and "patternProperties" not in schema:
        return False
    if any(keyword in schema for keyword in _MAY_ADD_PROPERTIES):
        return False
    properties, required = schema.get("properties", {}), schema.get("required", [])
    if not isinstance(properties, dict) or not isinstance(required, list):
        return False  # malformed: the grammar compiler names it
    # A required name the object does not list would have nowhere to go once closed (unless a
    # pattern takes it, which is not worth guessing): the schema is left as written.
    return all(name in properties for name in required)


def _parts_of_objects(schema: Any) -> set[str]:
    """The local definitions that allOf members (or $refs beside properties) refer to: parts of
    an object defined elsewhere, so left open wherever they are."""
    found: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            parts = list(node.get("allOf", [])) if isinstance(node.get("allOf"), list) else []
            if "properties" in node or "patternProperties" in node:
                parts.append(node)  # a $ref beside properties: the target adds to them
                for keyword in ("anyOf", "oneOf"):
                    if isinstance(node.get(keyword), list):
                        parts.extend(node[keyword])
            for part in parts:
                reference = part.get("$ref") if isinstance(part, dict) else None
                if isinstance(reference, str):
                    for prefix in _DEFINITION_PREFIXES:
                        if reference.startswith(prefix):
                            found.add(reference[len(prefix):])
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(schema)
    return found
