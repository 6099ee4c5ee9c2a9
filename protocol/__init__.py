"""The Redis contract shared by `api` and `worker`: key names, payloads, stream ids, and the
sampling spec that travels whole from the HTTP schemas to the sampler.

No torch: the API imports it. Nobody else writes Carpool key strings.
Writes: `submit_job`, `cancel_job` (protocol.job_submission). Reads: `JobReader`.
The Redis-free modules (generation, stream_ids) are what the engine may import: the names that
need redis or rq are loaded on first use, so `import protocol.generation` pulls in neither.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from protocol.generation import (
    FinishReason,
    SamplingParams,
    StructuredOutput,
    StructuredOutputKind,
    TokenEntry,
    TokenLogprobs,
)
from protocol.keys import Keys
from protocol.messages import (
    JobResult,
    JobSpec,
    JobState,
    JobStatus,
    ModelCard,
    Priority,
    StreamEntry,
    WorkerStats,
)

if TYPE_CHECKING:
    from protocol.job_reader import JobReader, StreamRead
    from protocol.job_submission import cancel_job, submit_job, submit_jobs

_LAZY = {"JobReader": "protocol.job_reader", "StreamRead": "protocol.job_reader",
         "cancel_job": "protocol.job_submission", "submit_job": "protocol.job_submission",
         "submit_jobs": "protocol.job_submission"}

__all__ = [
    "FinishReason", "JobReader", "JobResult", "JobSpec", "JobState", "JobStatus", "Keys",
    "ModelCard", "Priority", "SamplingParams", "StreamEntry", "StreamRead", "StructuredOutput",
    "StructuredOutputKind", "TokenEntry", "TokenLogprobs", "WorkerStats", "cancel_job",
    "submit_job", "submit_jobs",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'protocol' has no attribute {name!r}")
