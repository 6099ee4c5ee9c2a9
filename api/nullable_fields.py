"""OpenAI's optional request fields are nullable ("number or null" in its API reference): a client
may send `"temperature": null` for "not given", and many do (clients that serialize every field of
their own config, vLLM's extras whose defaults are null). Null then means the field was left out:
its default, which for a sampling field is the model's generation default, as OpenAI and vLLM
read it.
"""

from __future__ import annotations

import functools
from typing import Any

from pydantic import BaseModel, GetJsonSchemaHandler, model_validator
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema


@functools.cache  # per request body class, not per request
def _optional_names(model: type[BaseModel]) -> frozenset[str]:
    return frozenset(name for name, field in model.model_fields.items() if not field.is_required())


def _admits_null(schema: JsonSchemaValue) -> bool:
    return schema.get("type") == "null" or any(
        option.get("type") == "null" for option in schema.get("anyOf", ()))


class NullMeansLeftOut(BaseModel):
    """Mixed into a request body: its optional fields take null for "left out"."""

    @model_validator(mode="before")
    @classmethod
    def _nulls_left_out(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        optional = _optional_names(cls)
        # Dropped, not set to the default: "left out" keeps them out of model_fields_set too,
        # which is how routes tell a given value from the model's generation default.
        return {name: value for name, value in data.items()
                if value is not None or name not in optional}

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: CoreSchema,
                                     handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        # The published schema says so too, so that clients and fuzzers generated from it agree
        # with what the route accepts.
        schema = handler(core_schema)
        properties = handler.resolve_ref_schema(schema).get("properties", {})
        for name in _optional_names(cls):
            prop = properties.get(name)
            if prop is None or _admits_null(prop):
                continue
            shown = {key: prop.pop(key) for key in ("title", "description", "default", "examples")
                     if key in prop}
            properties[name] = {**shown, "anyOf": [prop, {"type": "null"}]}
        return schema
