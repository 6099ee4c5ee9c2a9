"""The RQ keys Carpool's Lua scripts touch, derived from rq's own classes (never retyped here).

Carpool takes jobs off RQ queues and records them the way an RQ worker would (status, execution
records, registries, results), but inside Lua scripts so each transition is atomic. Scripts get
these names as KEYS, or as templates (`KeyTemplate`) when the job id is only known in-script.
Checked against rq 3.0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from rq.executions import WORKER_EXECUTIONS_KEY_TEMPLATE, Execution, ExecutionRegistry
from rq.job import Job
from rq.queue import Queue
from rq.registry import (
    CanceledJobRegistry,
    FailedJobRegistry,
    FinishedJobRegistry,
    StartedJobRegistry,
)
from rq.results import Result
from rq.suspension import WORKERS_SUSPENDED
from rq.worker import Worker

# Stand-ins for ids when a key shape is turned into a template (ids never contain them: rq job
# ids are letters, digits, '_' and '-').
_ID = "\x00"
_EXECUTION_ID = "\x01"


@dataclass(frozen=True, slots=True)
class KeyTemplate:
    """A key with one id slot: `prefix + id + suffix`; Lua scripts fill it in the same way."""

    prefix: str
    suffix: str

    @classmethod
    def of(cls, key: str) -> KeyTemplate:
        prefix, _, suffix = key.partition(_ID)
        return cls(prefix, suffix)

    def fill(self, value: str) -> str:
        return f"{self.prefix}{value}{self.suffix}"


@dataclass(frozen=True, slots=True)
class RQKeys:
    """Names of RQ's keys, all computed by rq itself."""

    @staticmethod
    def queue(queue_name: str) -> str:
        return Queue.redis_queue_namespace_prefix + queue_name

    @staticmethod
    def queues_set() -> str:
        """Set of every queue's key (rq info lists queues from it)."""
        return Queue.redis_queues_keys

    @staticmethod
    def job(job_id: str) -> str:
        return Job.key_for(job_id)

    @staticmethod
    def results(job_id: str) -> str:
        # rq's Result.get_key is unannotated (it returns an f-string).
        return cast(str, Result.get_key(job_id))  # type: ignore[no-untyped-call]

    @staticmethod
    def started(queue_name: str) -> str:
        return StartedJobRegistry.key_template.format(queue_name)

    @staticmethod
    def finished(queue_name: str) -> str:
        return FinishedJobRegistry.key_template.format(queue_name)

    @staticmethod
    def failed(queue_name: str) -> str:
        return FailedJobRegistry.key_template.format(queue_name)

    @staticmethod
    def canceled(queue_name: str) -> str:
        return CanceledJobRegistry.key_template.format(queue_name)

    @staticmethod
    def worker(worker_name: str) -> str:
        return Worker.redis_worker_namespace_prefix + worker_name

    @staticmethod
    def workers_suspended() -> str:
        """Set while `rq suspend` holds (`rq resume` deletes it, `--duration` gives it a TTL): no
        worker starts a new job."""
        return WORKERS_SUSPENDED

    @staticmethod
    def workers_set() -> str:
        """Set of the `worker` keys of every registered RQ worker (what `Worker.all()` reads);
        a worker adds itself at birth and removes itself at a clean death."""
        return Worker.redis_workers_keys

    @staticmethod
    def worker_executions(worker_name: str) -> str:
        return WORKER_EXECUTIONS_KEY_TEMPLATE.format(worker_name)

    @staticmethod
    def execution(job_id: str, execution_id: str) -> str:
        return Execution(id=execution_id, job_id=job_id, connection=None).key  # type: ignore[arg-type]

    @staticmethod
    def execution_composite(job_id: str, execution_id: str) -> str:
        execution = Execution(id=execution_id, job_id=job_id, connection=None)  # type: ignore[arg-type]
        return cast(str, execution.composite_key)  # rq: composite_key is unannotated

    @staticmethod
    def executions(job_id: str) -> str:
        """Sorted set of one job's executions (ExecutionRegistry)."""
        return ExecutionRegistry.key_template.format(job_id)

    # Templates for keys whose job id a script only learns while it runs.
    @staticmethod
    def job_template() -> KeyTemplate:
        return KeyTemplate.of(RQKeys.job(_ID))

    @staticmethod
    def executions_template() -> KeyTemplate:
        return KeyTemplate.of(RQKeys.executions(_ID))

    @staticmethod
    def execution_template() -> KeyTemplate:
        """Template over the composite key ("job_id:execution_id"), which scripts build."""
        full = RQKeys.execution(_ID, _EXECUTION_ID)
        composite = RQKeys.execution_composite(_ID, _EXECUTION_ID)
        prefix, _, suffix = full.partition(composite)
        return KeyTemplate(prefix, suffix)

    @staticmethod
    def composite_separator() -> str:
        """What joins job id and execution id in a composite key (':' in rq 3)."""
        composite = RQKeys.execution_composite(_ID, _EXECUTION_ID)
        return composite[len(_ID):-len(_EXECUTION_ID)]
