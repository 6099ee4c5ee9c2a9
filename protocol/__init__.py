"""The Redis contract shared by `api` and `worker`: key names, payloads, stream format.

No torch: the API imports it. Nobody else writes Carpool key strings.
"""

from protocol.keys import Keys
from protocol.messages import (
    FinishReason,
    JobSpec,
    JobState,
    JobStatus,
    ModelCard,
    Priority,
    StreamEntry,
    WorkerStats,
)

__all__ = [
    "FinishReason",
    "JobSpec",
    "JobState",
    "JobStatus",
    "Keys",
    "ModelCard",
    "Priority",
    "StreamEntry",
    "WorkerStats",
]
