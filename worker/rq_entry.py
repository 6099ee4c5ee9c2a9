"""The function RQ records on every Carpool job (protocol.keys.RQ_JOB_FUNCTION).

Carpool workers never call it: they take jobs off the queues into their batch. It is here so a
plain RQ worker can run a job too, unbatched, one request through the engine:

    rq worker --serializer rq.serializers.JSONSerializer -w rq.worker.SimpleWorker \
        --url redis://... carpool-MODEL-high carpool-MODEL-normal carpool-MODEL-low

It runs the job through the batching worker's own path (`BatchingWorker.run_adopted`): the same
claim (fence, lease, resume from the stream), the same fenced appends, cancel checks and finish
script, so its stream, JobState and result are exactly what a Carpool worker writes, and a job
whose rq worker dies is recovered by Carpool's lease sweep. It returns the JobResult as the RQ
result and raises ValueError with the job's error when it failed (RQ marks it failed).
SimpleWorker keeps the loaded engine between jobs; rq's default forking worker loads the model
for every job.
"""

from __future__ import annotations

from typing import Any

from rq import get_current_job

from protocol import JobReader, JobStatus, Keys

# Engines by (model, CARPOOL_* settings), kept for the life of the process.
_engines: dict[str, Any] = {}


def generate(spec_data: dict[str, Any], keys_prefix: str = "carpool") -> dict[str, Any]:
    """Run one job to its end; returns JobResult.to_dict() (RQ stores it as the job's result)."""
    from worker.jobs.batching_worker import BatchingWorker
    from worker.jobs.settings import WorkerSettings

    rq_job = get_current_job()
    if rq_job is None:
        raise RuntimeError("worker.rq_entry.generate runs inside an rq worker (get_current_job())")
    redis = rq_job.connection
    overrides: dict[str, Any] = {"keys_prefix": keys_prefix, "max_num_seqs": 1}
    if isinstance(spec_data, dict) and isinstance(spec_data.get("model"), str) and spec_data["model"]:
        overrides["model"] = spec_data["model"]  # else CARPOOL_MODEL; the claim fails a bad payload
    # The worker serves the model of the queue the job came from, so that queue is among its own
    # (a payload naming another model then fails as such, with its stream and state written).
    served = Keys(keys_prefix).model_of_queue(rq_job.origin)
    if served is None:
        raise ValueError(f"job {rq_job.id} came from {rq_job.origin!r}, not a Carpool queue")
    overrides["served_model_name"] = served
    if rq_job.worker_name:
        overrides["name"] = rq_job.worker_name
    settings = WorkerSettings(**overrides)
    worker = BatchingWorker(settings, _engine(settings), redis, register_presence=False)
    worker.run_adopted(rq_job.id, rq_job.origin)
    state = JobReader(redis, Keys(keys_prefix)).state(rq_job.id)
    if state is None:
        raise ValueError(f"job {rq_job.id} vanished while it ran (deleted or expired)")
    if state.status is JobStatus.FAILED:
        raise ValueError(state.error)
    return state.result().to_dict()


def _engine(settings: Any) -> Any:
    if settings.model not in _engines:
        from worker.engine.engine import Engine

        _engines[settings.model] = Engine(settings.engine_config())
    return _engines[settings.model]
