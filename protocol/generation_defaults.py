"""The sampling defaults a model ships in its generation_config.json, read as vLLM's
`--generation-config auto` reads them: these fields only, renamed to SamplingParams' names.

Pure standard library: the worker reads the file, the API applies the result to a request.
"""

from __future__ import annotations

from typing import Any

# generation_config.json name -> SamplingParams name (vLLM's list; max_new_tokens is max_tokens).
GENERATION_CONFIG_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def generation_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """The fields of a parsed generation_config.json that a request's omitted fields default to.

    Numbers only (a bool or a string in the file is a broken config, not a default); whether a
    value is in range is for SamplingParams to say when it is applied."""
    defaults: dict[str, Any] = {}
    for theirs, ours in GENERATION_CONFIG_FIELDS.items():
        value = config.get(theirs)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            defaults[ours] = value
    return defaults
