"""The Redis contract shared by `api` and `worker`: key names, payloads, stream format.

No torch: the API imports it. Nobody else writes Carpool key strings.
Writes: `submit_job`, `cancel_job` (protocol.job_submission). Reads: `JobReader`.
"""

from protocol.job_reader import JobReader, StreamRead
from protocol.job_submission import cancel_job, submit_job, submit_jobs
from protocol.keys import Keys
from protocol.messages import (
    FinishReason,
    JobResult,
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
    "JobReader",
    "JobResult",
    "JobSpec",
    "JobState",
    "JobStatus",
    "Keys",
    "ModelCard",
    "Priority",
    "StreamEntry",
    "StreamRead",
    "WorkerStats",
    "cancel_job",
    "submit_job",
    "submit_jobs",
]
