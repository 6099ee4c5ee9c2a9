"""A model's own sampling defaults (its generation_config.json, published on its ModelCard)
applied to the fields a request left out, as vLLM's `--generation-config auto` does.

Only fields SamplingParams has are applied, picked by name: a new sampling field whose name
generation_config.json shares is honoured as soon as SamplingParams grows it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from protocol import SamplingParams

log = logging.getLogger(__name__)


def served_defaults(defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The defaults this server applies (those SamplingParams knows), as /v1/models shows them."""
    names = SamplingParams.field_names()
    return {name: value for name, value in defaults.items() if name in names}


def with_model_defaults(sampling: SamplingParams, defaults: Mapping[str, Any],
                        explicit: frozenset[str]) -> SamplingParams:
    """`sampling` with each default of the model whose field the request did not set.

    max_tokens is left to the caller (it is bounded by the context). A default SamplingParams
    refuses (a broken generation_config.json) is skipped, not turned into a failed request."""
    result = sampling
    for name, value in served_defaults(defaults).items():
        if name in explicit or name == "max_tokens":
            continue
        try:
            result = dataclasses.replace(result, **{name: value})
        except (ValueError, TypeError) as exc:
            log.warning("ignoring the model's default %s=%r: %s", name, value, exc)
    return result
