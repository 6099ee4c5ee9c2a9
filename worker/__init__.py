"""Carpool's worker: the continuous-batching engine and the Redis side that feeds it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from worker.engine_config import BatchingMode, EngineConfig
from worker.sampling_params import SamplingParams

if TYPE_CHECKING:
    from worker.engine import Engine

__all__ = ["BatchingMode", "Engine", "EngineConfig", "SamplingParams"]


def __getattr__(name: str) -> Any:
    # Engine pulls in torch and transformers; the scheduler's users (and api/) must not pay for that.
    if name == "Engine":
        from worker.engine import Engine

        return Engine
    raise AttributeError(f"module 'worker' has no attribute {name!r}")
