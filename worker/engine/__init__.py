"""The engine: requests in, token deltas out, one forward pass per step. No Redis, no RQ.

`Engine` pulls in torch and transformers; the pure parts (scheduler, block manager, sequence,
config, outputs, detokenizer) do not, so their users (and tests) need not pay for that.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from protocol.generation import SamplingParams
from worker.engine.config import BatchingMode, EngineConfig

if TYPE_CHECKING:
    from worker.engine.engine import Engine

__all__ = ["BatchingMode", "Engine", "EngineConfig", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from worker.engine.engine import Engine

        return Engine
    raise AttributeError(f"module 'worker.engine' has no attribute {name!r}")
