"""The worker's Redis/RQ side: claim, lease, publish, Lua scripts, presence. It drives the engine
it was handed and imports no torch."""

from worker.jobs.batching_worker import BatchingWorker
from worker.jobs.settings import WorkerSettings

__all__ = ["BatchingWorker", "WorkerSettings"]
