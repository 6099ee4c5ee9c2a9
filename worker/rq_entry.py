"""The function RQ records on every Carpool job (protocol.keys.RQ_JOB_FUNCTION).

Carpool workers never call it: they take jobs off the queues into their batch. It is here so a
plain RQ worker can run a job too, unbatched, one request through the engine:

    rq worker --serializer rq.serializers.JSONSerializer -w rq.worker.SimpleWorker \
        --url redis://... carpool-high carpool-normal carpool-low

It streams tokens to the job's stream (explicit entry ids, so Redis still refuses duplicates),
honours cancellation between tokens, writes the JobState, and returns the JobResult as the RQ
result. What it does not do: fencing and lease-based recovery (RQ's own abandoned-job handling
applies instead), and batching. SimpleWorker keeps the loaded engine between jobs; rq's default
forking worker loads the model for every job.
"""

from __future__ import annotations

import json
import time
from typing import Any

from rq import get_current_job

from protocol.keys import Keys
from protocol.messages import FinishReason, JobResult, JobSpec, JobStatus, StreamEntry

# Engines by model, kept for the life of the process (a SimpleWorker runs many jobs).
_engines: dict[str, Any] = {}

_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH,
            "abort": FinishReason.CANCELED}


def _engine(model: str) -> Any:
    if model not in _engines:
        from worker.engine.engine import Engine
        from worker.engine.config import EngineConfig

        _engines[model] = Engine(EngineConfig(model=model, max_num_seqs=1))
    return _engines[model]


def generate(spec_data: dict[str, Any], keys_prefix: str = "carpool") -> dict[str, Any]:
    """Run one job to its end; returns JobResult.to_dict() (RQ stores it as the job's result).
    Raises ValueError with a clear message for a bad job (RQ marks it failed)."""
    from worker.engine.sampling_params import SamplingParams

    spec = JobSpec.from_dict(spec_data)
    job = get_current_job()
    redis = job.connection if job is not None else None
    keys = Keys(keys_prefix)
    engine = _engine(spec.model)
    started_at = time.time()
    try:
        prompt = (engine.encode_chat(spec.messages) if spec.messages is not None
                  else engine.tokenizer.encode(spec.prompt))
        params = SamplingParams(max_tokens=spec.max_tokens, temperature=spec.temperature,
                                top_p=spec.top_p, top_k=spec.top_k, seed=spec.seed,
                                stop=tuple(spec.stop), ignore_eos=spec.ignore_eos)
        engine.add_request(spec.job_id, list(prompt), params)
    except ValueError as exc:
        if redis is not None:
            done = StreamEntry(kind=StreamEntry.DONE, finish_reason=FinishReason.ERROR,
                               error=str(exc))
            with redis.pipeline(transaction=True) as pipe:
                pipe.xadd(keys.stream(spec.job_id), done.to_fields(), id="0-1")
                pipe.hset(keys.state(spec.job_id), mapping={
                    "status": JobStatus.FAILED.value, "finish_reason": FinishReason.ERROR.value,
                    "error": str(exc), "finished_at": repr(time.time())})
                pipe.execute()
        raise
    if redis is not None:
        redis.hset(keys.state(spec.job_id), mapping={"status": JobStatus.RUNNING.value,
                                                     "started_at": repr(started_at),
                                                     "worker": job.worker_name or ""})
    token_ids: list[int] = []
    texts: list[str] = []
    first_token_at = 0.0
    reason = FinishReason.LENGTH
    while engine.has_unfinished():
        if redis is not None and redis.sismember(keys.canceled(), spec.job_id):
            engine.abort(spec.job_id)
            reason = FinishReason.CANCELED
        out = engine.step()
        for request in out.outputs:
            with (redis.pipeline(transaction=True) if redis is not None else _NoPipe()) as pipe:
                for delta in request.tokens:
                    token_ids.append(delta.token_id)
                    texts.append(delta.text)
                    first_token_at = first_token_at or time.time()
                    entry = StreamEntry(kind=StreamEntry.TOKEN, index=delta.index,
                                        token_id=delta.token_id, text=delta.text)
                    pipe.xadd(keys.stream(spec.job_id), entry.to_fields(),
                              id=StreamEntry.token_entry_id(delta.index))
                pipe.execute()
            if request.finish_reason is not None and reason is not FinishReason.CANCELED:
                reason = _REASONS[request.finish_reason.value]
    status = JobStatus.CANCELED if reason is FinishReason.CANCELED else JobStatus.FINISHED
    result = JobResult(job_id=spec.job_id, status=status, text="".join(texts),
                       token_ids=token_ids, finish_reason=reason, prompt_tokens=len(prompt),
                       completion_tokens=len(token_ids), created_at=spec.created_at,
                       started_at=started_at, first_token_at=first_token_at,
                       finished_at=time.time(), worker=job.worker_name or "" if job else "")
    if redis is not None:
        done = StreamEntry(kind=StreamEntry.DONE, finish_reason=reason,
                           prompt_tokens=len(prompt), completion_tokens=len(token_ids))
        with redis.pipeline(transaction=True) as pipe:
            pipe.xadd(keys.stream(spec.job_id), done.to_fields(),
                      id=StreamEntry.done_entry_id(len(token_ids)))
            pipe.hset(keys.state(spec.job_id), mapping={
                "status": status.value, "finish_reason": reason.value,
                "prompt_tokens": len(prompt), "completion_tokens": len(token_ids),
                "text": result.text, "token_ids": json.dumps(token_ids),
                "first_token_at": repr(first_token_at), "finished_at": repr(result.finished_at)})
            pipe.srem(keys.canceled(), spec.job_id)
            ttl = job.get_result_ttl(86400)
            if ttl > 0:
                pipe.expire(keys.stream(spec.job_id), ttl)
                pipe.expire(keys.state(spec.job_id), ttl)
            pipe.execute()
    return result.to_dict()


class _NoPipe:
    """Stands in for a pipeline when the function runs outside RQ (tests, a REPL)."""

    def __enter__(self) -> "_NoPipe":
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def xadd(self, *args: object, **kwargs: object) -> None:
        return None

    def execute(self) -> list[object]:
        return []
