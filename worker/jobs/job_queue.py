"""Taking jobs off the RQ queues of one model into a worker's batch (the claim), highest
priority first; within a priority, the job of the API key with the lowest virtual token counter
(fair shares between keys: worker/jobs/fair_share.py).

Non-blocking at an iteration boundary (the batch must not wait); blocking only while the worker
is idle. Each claim is one Lua script that pops, fences, leases and records the job as started
the way an rq worker does, so a crash can never leave a job popped but unrecorded. (rq itself
LMOVEs into an intermediate list to cover the gap between its pop and its bookkeeping; an atomic
script has no such gap, so Carpool never uses the intermediate lists.)

The idle wait blocks on the queues' wake-up lists (`Keys.wakeups`: one element pushed with every
job), not on the queues: a BLPOP there takes no job, and the claim that follows is the same
atomic script. A worker killed between the two loses a wake-up, never a job: it stays at the
head of its queue and the next claim of any worker (at its next boundary, or after an idle
worker's wait times out) takes it. (A BLPOP on the queues themselves, as rq's multi-queue wait
does, leaves a popped id owned by nobody in that gap; BLMOVE into an in-flight list would close
it for one queue only, since it waits on one source list.)
"""

from __future__ import annotations

import logging
import time
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Any

from redis import Redis
from redis.exceptions import NoScriptError
from redis.typing import EncodableT
from rq.job import Job
from rq.serializers import JSONSerializer
from rq.utils import now as rq_now
from rq.utils import utcformat

from protocol.job_reader import parse_entries
from protocol.job_submission import DEFAULT_FAILURE_TTL, DEFAULT_RESULT_TTL
from protocol.keys import Keys
from protocol.messages import JobSpec, JobState, JobStatus, StreamEntry
from protocol.rq_keys import KeyTemplate, RQKeys
from worker.jobs.fair_share import DEFAULT_CHARGE_TOKENS
from worker.jobs.job_scripts import CLAIM_SUSPENDED, JobScripts
from worker.jobs.lease import Lease

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ClaimedJob:
    """A job this worker now holds, with what it needs to (re)start it."""

    lease: Lease
    spec: JobSpec | None  # None when the payload was malformed (`error` says why)
    state: JobState
    tokens: list[StreamEntry]  # already in its stream (a resumed job continues after them)
    is_canceled: bool
    result_ttl: int
    failure_ttl: int
    error: str = ""
    claimed_at: float = field(default_factory=time.time)
    # An ended job that rq's requeue put back runs again from its start: the stream_shard its
    # old stream was placed by (-1: none recorded), which goes before it starts; None otherwise.
    restarted_from_shard: int | None = None
    # This claim placed the job on this worker's stream shard (its first start): nothing of it
    # is on any shard yet, so it can go back unplaced if that shard is out of reach.
    placed_now: bool = False


class WorkersSuspended(Exception):
    """`rq suspend` holds: no worker starts a new job until `rq resume` (or its --duration)."""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def decode_spec(job_id: str, raw_data: bytes, redis: Redis) -> JobSpec:
    """The JobSpec recorded as the RQ job's argument; ValueError with a clear message if not."""
    try:
        data = zlib.decompress(raw_data)
    except zlib.error:
        data = raw_data  # rq falls back to uncompressed data too
    job = Job(job_id, connection=redis, serializer=JSONSerializer)
    job.data = data
    try:
        args, kwargs = job.args, job.kwargs
    except Exception as exc:  # rq wraps any serializer failure in DeserializationError
        raise ValueError(f"job payload is not rq JSON: {exc.__cause__ or exc}") from exc
    if kwargs or len(args) != 1:
        raise ValueError("job payload must be exactly one argument, the JobSpec object")
    spec = JobSpec.from_json(args[0]) if isinstance(args[0], str) else JobSpec.from_dict(args[0])
    if spec.job_id != job_id:
        raise ValueError(f"job payload names job {spec.job_id!r}, not {job_id!r}")
    return spec


class JobQueue:
    def __init__(self, redis: Redis, scripts: JobScripts, keys: Keys, worker_name: str,
                 model: str, lease_ms: int, execution_ttl_s: int, block_size: int) -> None:
        self.redis = redis
        self.scripts = scripts
        self.keys = keys
        self.worker_name = worker_name
        self.lease_ms = lease_ms
        self.execution_ttl_s = execution_ttl_s
        self.block_size = block_size
        # The stream shard of the jobs this worker starts (protocol/stream_shards.py); None
        # while the streams are not sharded.
        self.home_shard: int | None = None
        # Only the served model's queues: another model's jobs are never taken here.
        self.queue_names = keys.queue_names(model)
        self.queue_keys = [RQKeys.queue(name) for name in self.queue_names]
        self.wakeup_keys = [keys.wakeups(name) for name in self.queue_names]
        templates: list[KeyTemplate] = [
            KeyTemplate.of(keys.state("\x00")), KeyTemplate.of(keys.stream("\x00")),
            KeyTemplate.of(keys.lease("\x00")), KeyTemplate.of(keys.fence("\x00")),
            RQKeys.job_template(), RQKeys.execution_template(), RQKeys.executions_template(),
        ]
        self._template_args = [part for t in templates for part in (t.prefix, t.suffix)]
        self._script_keys = [keys.leases(), keys.canceled(), RQKeys.worker_executions(worker_name),
                             RQKeys.worker(worker_name), *self.queue_keys,
                             *(RQKeys.started(name) for name in self.queue_names),
                             *self.wakeup_keys, keys.fair_weights(), keys.fair_vtimes(model),
                             keys.fair_clock(model),
                             *(keys.queue_owners(name) for name in self.queue_names),
                             RQKeys.workers_suspended()]

    def claim(self, max_jobs: int, free_kv_blocks: int | None = None,
              adopt: tuple[str, int] | None = None) -> list[ClaimedJob]:
        """Take up to `max_jobs` jobs without blocking (by priority, then fair share between
        owners), stopping at the first one that needs more than `free_kv_blocks` (None: no
        limit). `adopt` = (job_id, queue index) of a job already taken off its queue (by an rq
        worker: worker.rq_entry), claimed first. Raises WorkersSuspended, taking nothing, while
        `rq suspend` holds (an adopted job is claimed regardless)."""
        if max_jobs <= 0 and adopt is None:
            return []
        now = time.time()
        adopt_id, adopt_index = adopt if adopt else ("", 0)
        args: list[EncodableT] = [
            self.worker_name, self.lease_ms, max_jobs,
            -1 if free_kv_blocks is None else free_kv_blocks, self.block_size,
            adopt_id, adopt_index + 1 if adopt else 0, self.execution_ttl_s,
            utcformat(rq_now()), repr(now), uuid.uuid4().hex[:12] + "-", len(self.queue_names),
            *self._template_args, RQKeys.composite_separator(),
            DEFAULT_CHARGE_TOKENS, "" if self.home_shard is None else self.home_shard,
        ]
        try:
            reply = self.scripts.call(self.redis, "claim", self._script_keys, args)
        except NoScriptError:
            # Redis restarted or its script cache was flushed: load again and retry once.
            self.scripts.load(self.redis)
            reply = self.scripts.call(self.redis, "claim", self._script_keys, args)
        if not isinstance(reply, list) and _text(reply) == CLAIM_SUSPENDED:
            raise WorkersSuspended
        return [self._claimed(row, now) for row in reply]

    def wait(self, timeout_s: float) -> bool:
        """Block until a job is queued (a wake-up popped: True) or `timeout_s` passed (False).
        Nothing is taken off a queue: `claim` takes the jobs, highest priority first. Raises
        WorkersSuspended after the wait while `rq suspend` held when it began."""
        # [redis-cost] One request, the flag read just before the wait. A wake-up it pops while
        # suspended is lost, never its job: claims take jobs off the queues, wake-ups or not.
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.exists(RQKeys.workers_suspended())
            pipe.blpop(self.wakeup_keys, timeout=timeout_s)
            suspended, woken = pipe.execute()
        if suspended:
            raise WorkersSuspended
        return woken is not None

    def is_suspended(self) -> bool:
        """Whether `rq suspend` holds now."""
        return bool(self.redis.exists(RQKeys.workers_suspended()))

    def _claimed(self, row: list[Any], now: float) -> ClaimedJob:
        job_id, queue_index, fence, execution_id, data, result_ttl, failure_ttl, state_flat, \
            entries, canceled, restarted, placed = row
        job_id = _text(job_id)
        state_fields = dict(zip(state_flat[::2], state_flat[1::2]))
        try:
            state = JobState.from_fields(state_fields)
        except (KeyError, ValueError):
            # A job enqueued without its JobState (not through submit_job): start one.
            state = JobState(job_id=job_id, status=JobStatus.RUNNING)
        lease = Lease(job_id=job_id, token=_text(fence),
                      queue_name=self.queue_names[int(queue_index) - 1],
                      execution_id=_text(execution_id), stream_shard=state.stream_shard)
        spec: JobSpec | None = None
        error = ""
        try:
            spec = decode_spec(job_id, data if isinstance(data, bytes) else _text(data).encode(),
                               self.redis)
        except ValueError as exc:
            error = f"malformed job: {exc}"
        tokens = parse_entries([(entry[0], dict(zip(entry[1][::2], entry[1][1::2])))
                                for entry in entries]).tokens
        return ClaimedJob(lease=lease, spec=spec, state=state, tokens=tokens,
                          is_canceled=bool(canceled),
                          result_ttl=_ttl(result_ttl, DEFAULT_RESULT_TTL),
                          failure_ttl=_ttl(failure_ttl, DEFAULT_FAILURE_TTL), error=error,
                          claimed_at=now,
                          restarted_from_shard=int(_text(restarted)) if restarted else None,
                          placed_now=bool(int(placed)))


def _ttl(raw: Any, default: int) -> int:
    text = _text(raw) if raw is not None else ""
    return int(text) if text.lstrip("-").isdigit() else default
