"""Everything a worker writes in one iteration, sent as ONE round trip (a MULTI/EXEC pipeline)
to the main Redis, plus one to each stream shard that holds some of the batch's streams.

Per job: the fenced append script (new tokens + lease renewal), or the finish/requeue script.
A job whose stream lives on a shard (protocol.stream_shards) has its tokens appended there by
the shard's fenced script, or notified live there between two writes of its stream, sent before
the main round trip (worker/jobs/shard_publisher.py), and its lease checked and renewed on the
main Redis as before; its final entry goes to the shard once the main Redis recorded the end
(an extra round trip to that shard in a step where one of its jobs ended).
For the batch: SMISMEMBER on the canceled set, the WorkerStats hash, metric counters and
histograms, and, when due, RQ heartbeats and the recovery script. `flush()` sends it and
reports what Redis refused or flagged, for the worker to act on at the next boundary.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import logging
import math
import time
import uuid
import zlib
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, cast

from redis import Redis
from redis.client import Pipeline
from redis.exceptions import ResponseError
from redis.typing import EncodableT
from rq.results import Result
from rq.serializers import JSONSerializer
from rq.utils import now as rq_now
from rq.utils import utcformat
from rq.worker import WorkerStatus

from protocol.generation import FinishReason, TokenEntry
from protocol.keys import Keys
from protocol.messages import (
    HISTOGRAM_BUCKETS,
    JobResult,
    JobStatus,
    WorkerStats,
    finished_counter,
)
from protocol.rq_keys import KeyTemplate, RQKeys
from protocol.stream_steps import encode_tokens
from protocol.token_runs import run_fields
from worker.jobs.job_scripts import JobScripts
from worker.jobs.lease import Lease
from worker.jobs.rq_presence import RQPresence
from worker.jobs.running_job import RunningJob
from worker.jobs.script_calls import (
    EndMarker,
    ScriptCall,
    raise_refused_writes,
    retry_missing_scripts,
    token_args,
)
from worker.jobs.shard_publisher import ShardPublisher
from worker.jobs.stream_shards import StreamShards

log = logging.getLogger(__name__)

# Leases are renewed at the first flush after 1/8 of a lease passed, so a lease always has more
# than 7/8 of its time left at a flush, less the step before it.
_RENEWALS_PER_LEASE = 8
_BUCKET_NAMES = [str(bound) for bound in HISTOGRAM_BUCKETS]


@dataclass(frozen=True, slots=True)
class JobEnd:
    """How a job ends; `finish` turns it into the final stream entry, JobState and RQ result."""

    status: JobStatus  # FINISHED, FAILED or CANCELED
    finish_reason: FinishReason
    error: str = ""


@dataclass(slots=True)
class PublishReport:
    refused: set[str] = field(default_factory=set)  # not our lease any more: drop, write nothing
    canceled: set[str] = field(default_factory=set)  # cancel requested: end them next iteration
    ended: dict[str, JobStatus] = field(default_factory=dict)  # status each finish wrote
    requeued: set[str] = field(default_factory=set)
    recovered: list[str] = field(default_factory=list)
    # How many jobs wait on each queue `watch_queues` named, by queue key (empty: none watched).
    queue_lengths: dict[str, int] = field(default_factory=dict)
    # The model card of `watch_registration`, or this worker's own rq registration, was gone from
    # Redis at this flush (a Redis restarted without its data, or flushed): the worker registers
    # again.
    registration_lost: bool = False


@dataclass(frozen=True, slots=True)
class _ShardedAppend:
    """The main-Redis part of a sharded job's append: the append script's keys and arguments."""

    job_id: str
    keys: list[str]
    args: list[EncodableT]
    is_first: bool  # brings the job's first token: its state needs first_token_at now


def _entry_args(unpublished: list[TokenEntry], tokens: list[str]) -> list[str]:
    """The one stream entry a publish writes for a job, as the append scripts take it: nothing
    for no token; (index, token_id, text, logprobs) for one; for several, a run
    (protocol/token_runs.py) encoded here, where it costs Redis nothing: (first index, token ids,
    texts, logprobs or '')."""
    if len(unpublished) <= 1:
        return tokens
    asked = any(token.logprobs is not None for token in unpublished)
    fields = run_fields(unpublished[0].index, [t.token_id for t in unpublished],
                        [t.text for t in unpublished],
                        [t.logprobs.encode() if t.logprobs is not None else ""
                         for t in unpublished] if asked else None)
    return [fields["index"], fields["token_ids"], fields["text"], fields.get("lp", "")]


class StreamPublisher:
    def __init__(self, redis: Redis, scripts: JobScripts, keys: Keys, worker_name: str,
                 lease_ms: int, presence: RQPresence | None = None,
                 shards: StreamShards | None = None, metrics_interval_s: float = 0.0,
                 durable_interval_s: float = 0.0) -> None:
        self.redis = redis
        self.shards = shards or StreamShards(redis, [redis], scripts, keys)
        self.presence = presence
        self.scripts = scripts
        self.keys = keys
        self.worker_name = worker_name
        self.lease_ms = lease_ms
        self._renewed_at = -math.inf  # monotonic time of the last flush that renewed the leases
        # [redis-cost] Least time between two writes of a job's tokens to its stream; between
        # them its tokens go to subscribers live, in the step notifications only (0: every
        # publish writes the streams). See "Live tokens" in protocol/stream_steps.py.
        self.durable_interval_s = durable_interval_s
        # Set as this worker's live fence (Keys.live_fence) at renewals that found every lease.
        self._live_epoch = uuid.uuid4().hex if durable_interval_s > 0 else ""
        self._to_shards = ShardPublisher(self.shards, scripts, keys, worker_name, lease_ms,
                                         self._live_epoch)
        self._dropped_jobs = False  # discard() ran: the live journal may be all there is
        self._recover_templates = self._templates()
        # [redis-cost] Counters and histograms add up here between writes (WorkerSettings.
        # metrics_interval_ms): they are sums, so one write a second says what forty did.
        self.metrics_interval_s = metrics_interval_s
        self._metrics_written_at = -math.inf  # monotonic
        self._stats: tuple[WorkerStats, float] | None = None  # not written yet
        self._registered_model: str | None = None  # watch_registration
        self._stats_written_at = -math.inf  # monotonic
        self._metrics_now = False
        self._counters: Counter[str] = Counter()
        self._observations: dict[str, list[float]] = defaultdict(list)
        self._reset()

    def _templates(self) -> list[str]:
        k = self.keys
        templates = [KeyTemplate.of(k.state("\x00")), KeyTemplate.of(k.stream("\x00")),
                     KeyTemplate.of(k.lease("\x00")), RQKeys.job_template(),
                     RQKeys.execution_template(), RQKeys.executions_template(),
                     KeyTemplate.of(RQKeys.queue("\x00")), KeyTemplate.of(RQKeys.started("\x00")),
                     KeyTemplate.of(RQKeys.failed("\x00")),
                     KeyTemplate.of(RQKeys.worker_executions("\x00")),
                     KeyTemplate.of(k.wakeups("\x00"))]
        owners = KeyTemplate.of(k.queue_owners("\x00"))  # fair-share index, after the separator
        journal, fence = KeyTemplate.of(k.live_journal("\x00")), KeyTemplate.of(k.live_fence("\x00"))
        return [part for t in templates for part in (t.prefix, t.suffix)] + [
            RQKeys.composite_separator(), owners.prefix, owners.suffix, journal.prefix,
            journal.suffix, fence.prefix, fence.suffix]

    def _reset(self) -> None:
        self._to_shards.reset()
        self._calls: list[ScriptCall] = []
        # The jobs whose tokens this flush writes to their streams (by id): sent once it lands.
        self._carried: dict[str, RunningJob] = {}
        # Live jobs: their new tokens go in the step's notification only (by id).
        self._live: dict[str, RunningJob] = {}
        self._renew: bool | None = None  # whether this flush renews the leases (once asked)
        self._append_ids: list[str] = []
        self._append_keys: list[str] = []
        self._append_args: list[EncodableT] = []
        # Jobs streaming to a shard: their main-Redis part (lease check and renewal, first-token
        # state), sent with the append only when the step renews leases or brings the first token.
        self._sharded: list[_ShardedAppend] = []
        # The step's new tokens per stream, for the notification the append scripts write.
        self._notified: list[tuple[str, list[str]]] = []
        self._extra: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []  # plain commands (heartbeats)
        self._watched: list[str] = []  # RQ queue keys whose lengths this flush reads
        self._heartbeat = False
        self._worker_state: WorkerStatus | None = None

    @property
    def is_empty(self) -> bool:
        return not (self._calls or self._append_ids or self._live or self._sharded or self._extra
                    or self._counters or self._stats
                    or self._observations or self._heartbeat or self._to_shards.pending_ends)

    # Per job.
    def append(self, job: RunningJob, may_go_live: bool = True) -> None:
        """New tokens (maybe none), the lease renewal and the cancel check, fenced by the job's
        token. All the batch's appends go to Redis as one script call. The tokens go to the
        job's stream, or, for a live job, to subscribers only until its stream is due."""
        self._counters["generated_tokens_total"] += len(job.unpublished) - job.num_notified
        if may_go_live and self._goes_live(job):
            self._live[job.job_id] = job
        else:
            self._append_to_stream(job)

    def _goes_live(self, job: RunningJob) -> bool:
        """Whether the job's new tokens go to subscribers only: its stream (wherever it lives)
        was complete less than the durable interval ago, and they are not its first (the first
        token, with its state fields, goes to the stream at once)."""
        return (self.durable_interval_s > 0 and job.stream_complete_ms > 0
                and bool(job.unpublished) and job.unpublished[0].index > 0
                and time.monotonic() - job.stream_complete_at < self.durable_interval_s
                and not self._renews())

    def _renews(self) -> bool:
        """Whether this flush renews the leases (decided once, at the first ask): a few times a
        lease, not each step, since it costs two commands a job. A renewing flush writes every
        job's stream (the live path has no renewal)."""
        if self._renew is None:
            self._renew = (time.monotonic() - self._renewed_at
                           >= self.lease_ms / 1000 / _RENEWALS_PER_LEASE)
        return self._renew

    def _append_to_stream(self, job: RunningJob) -> None:
        lease = job.lease
        self._carried[lease.job_id] = job
        entry = _entry_args(job.unpublished, token_args(job.unpublished))
        # The notification carries the tokens subscribers did not get live yet.
        tokens = token_args(job.unpublished[job.num_notified:])
        is_first = bool(job.unpublished) and job.unpublished[0].index == 0
        prompt_logprobs = job.prompt_logprobs if is_first else ""
        shard = self.shards.remote(lease)
        append_keys = [self.keys.lease(lease.job_id), self.keys.stream(lease.job_id),
                       self.keys.state(lease.job_id)]
        if shard is None:
            self._append_keys += append_keys
            self._append_args += [lease.job_id, lease.token, job.num_prompt_tokens,
                                  repr(job.first_token_at), prompt_logprobs, len(job.unpublished),
                                  *entry]
            self._append_ids.append(lease.job_id)
            if tokens:
                self._notified.append((self.keys.stream(lease.job_id), tokens))
        else:
            # The main Redis checks and renews the lease; the shard takes the tokens.
            self._sharded.append(_ShardedAppend(
                lease.job_id, append_keys,
                [lease.job_id, lease.token, job.num_prompt_tokens,
                 repr(job.first_token_at) if is_first else "", prompt_logprobs, 0], is_first))
            self._to_shards.append(shard, lease.job_id, lease.token, len(job.unpublished), entry,
                                   tokens)

    def finish(self, job: RunningJob, end: JobEnd, now: float | None = None) -> None:
        """The final entry, JobState and RQ status/result; refused if the lease is not ours, and
        turned into `canceled` if a cancel was requested meanwhile (the finish guard)."""
        self._append_unpublished(job)
        now = time.time() if now is None else now
        lease = job.lease
        state = job.state
        result = JobResult(
            job_id=lease.job_id, status=end.status, text=job.text, token_ids=list(job.token_ids),
            finish_reason=end.finish_reason, error=end.error,
            prompt_tokens=job.num_prompt_tokens, completion_tokens=job.num_tokens,
            created_at=state.created_at, started_at=state.started_at or job.claimed_at,
            first_token_at=state.first_token_at or job.first_token_at, finished_at=now,
            num_preemptions=state.num_preemptions, worker=self.worker_name)
        ended_at = rq_now()
        started_at = datetime.fromtimestamp(job.claimed_at or now, tz=UTC)
        rq_result = Result(
            lease.job_id,
            Result.Type.FAILED if end.status == JobStatus.FAILED else Result.Type.SUCCESSFUL,
            connection=self.redis, serializer=JSONSerializer,
            return_value=None if end.status == JobStatus.FAILED else result.to_dict(),
            exc_string=end.error if end.status == JobStatus.FAILED else None,
            worker_name=self.worker_name, execution_id=lease.execution_id,
            execution_started_at=started_at, execution_ended_at=ended_at)
        queue = lease.queue_name
        keys = [self.keys.lease(lease.job_id), self.keys.stream(lease.job_id), self.keys.leases(),
                self.keys.state(lease.job_id), self.keys.canceled(), RQKeys.job(lease.job_id),
                RQKeys.results(lease.job_id), RQKeys.execution(lease.job_id, lease.execution_id),
                RQKeys.executions(lease.job_id), RQKeys.started(queue), RQKeys.finished(queue),
                RQKeys.failed(queue), RQKeys.canceled(queue),
                RQKeys.worker_executions(self.worker_name), RQKeys.worker(self.worker_name),
                self.keys.fence(lease.job_id), self.keys.webhook_events(),
                # The owner's fair-share counter of the job's model, settled to what it generated.
                self.keys.fair_vtimes(self.keys.model_of_queue(queue) or ""),
                self.keys.stream_steps()]
        args: list[EncodableT] = [
            lease.token, lease.job_id, end.status.value, end.finish_reason.value, end.error,
            job.num_prompt_tokens, job.num_tokens, job.text,
            json.dumps(job.token_ids, separators=(",", ":")), job.result_ttl, job.failure_ttl,
            lease.composite, lease.execution_id, utcformat(ended_at), repr(now),
            repr(max(0.0, now - (job.claimed_at or now))),
            zlib.compress(end.error.encode()) if end.status == JobStatus.FAILED else b"",
            job.num_cached_tokens]
        shard = self.shards.remote(lease)
        args.append("1" if shard is None else "0")
        for name, value in rq_result.serialize().items():
            args += [name, value]
        marker = None if shard is None else EndMarker(
            shard, lease.job_id, lease.token,
            job.failure_ttl if end.status == JobStatus.FAILED else job.result_ttl,
            end.finish_reason.value, job.num_prompt_tokens, job.num_tokens, end.error,
            job.num_cached_tokens)
        # The finish script notifies the final entry it writes (`f`); a shard's comes with its END.
        self._calls.append(ScriptCall("finish", lease.job_id, "finish", keys, args, marker))
        self._counters["prompt_tokens_total"] += job.num_prompt_tokens
        # vLLM's prefix cache counters count tokens: the prompt's, and those found cached.
        self._counters["prefix_cache_queries_total"] += job.num_prompt_tokens
        self._counters["prefix_cache_hits_total"] += job.num_cached_tokens
        self._counters[finished_counter(end.finish_reason)] += 1
        if end.status == JobStatus.FINISHED and state.created_at:
            self.observe("e2e_latency_seconds", now - state.created_at)

    def requeue(self, job: RunningJob, count_as_preemption: bool, unplace: bool = False) -> None:
        """Back to the FRONT of its queue (preempted, or unfinished at the end of a drain).
        `unplace`: a job claimed for its first start whose stream shard was out of reach goes
        back as never started (REQUEUE), and is not counted as preempted."""
        self._append_unpublished(job)
        lease = job.lease
        keys = [self.keys.lease(lease.job_id), self.keys.leases(), self.keys.state(lease.job_id),
                RQKeys.job(lease.job_id), RQKeys.queue(lease.queue_name),
                RQKeys.started(lease.queue_name),
                RQKeys.execution(lease.job_id, lease.execution_id),
                RQKeys.executions(lease.job_id), RQKeys.worker_executions(self.worker_name),
                self.keys.stream(lease.job_id), self.keys.wakeups(lease.queue_name),
                self.keys.queue_owners(lease.queue_name)]
        args: list[EncodableT] = [lease.token, lease.job_id, lease.composite, lease.execution_id,
                                  job.num_prompt_tokens, 1 if count_as_preemption else 0,
                                  job.num_tokens, 1 if unplace else 0]
        self._calls.append(ScriptCall("requeue", lease.job_id, "requeue", keys, args))
        if not unplace:
            self._counters["jobs_preempted_total"] += 1

    def _append_unpublished(self, job: RunningJob) -> None:
        """A job leaving the batch takes its tokens not yet in its stream along (a worker with a
        stream interval holds them for a few steps; a live job's went to subscribers only),
        ahead of its end or requeue in the same transaction: its stream must hold every token
        its end counts, and a resumer continues after them."""
        if self._live.pop(job.job_id, None) is not None:
            self._append_to_stream(job)  # counted by its append
        elif job.unpublished and job.job_id not in self._carried:
            self.append(job, may_go_live=False)

    @property
    def has_job_changes(self) -> bool:
        """Whether a job's status changes in the next flush (a finish, requeue or recovery is
        queued, or a final entry is owed to a shard): such a flush is not put off."""
        return bool(self._calls or self._to_shards.pending_ends)

    # For the batch.
    def stats(self, stats: WorkerStats, ttl_seconds: float) -> None:
        """The worker's WorkerStats, written with the metrics ([redis-cost] once a metrics
        interval, or at once for an idle or draining worker): the latest of them wins."""
        self._stats = (stats, ttl_seconds)

    def watch_registration(self, model: str) -> None:
        """Check with each stats write that `model`'s card is still registered, and this worker
        in rq's workers set (an HEXISTS and a SISMEMBER in the same transaction, once a metrics
        interval): PublishReport.registration_lost. Each worker checks its own: another one that
        registered the card again does not register this one with rq."""
        self._registered_model = model

    def heartbeat(self, leases: list[Lease], execution_ttl_s: int) -> None:
        """RQ's worker heartbeat and its execution records' TTLs (as rq's maintain_heartbeats)."""
        self._heartbeat = self.presence is not None
        deadline = int(time.time()) + execution_ttl_s
        for lease in leases:
            self._extra.append(("expire", (RQKeys.execution(lease.job_id, lease.execution_id),
                                           execution_ttl_s), {}))
            self._extra.append(("zadd", (RQKeys.started(lease.queue_name),
                                         {lease.composite: deadline}), {"xx": True}))
            self._extra.append(("zadd", (RQKeys.executions(lease.job_id),
                                         {lease.execution_id: deadline + 60}), {"xx": True}))

    def watch_queues(self, queue_keys: list[str]) -> None:
        """Read how many jobs wait on these queues in this flush (PublishReport.queue_lengths):
        how a worker learns, at no extra round trip, that a higher tier waits for the seats its
        batch-tier jobs hold, and that a claim at the next boundary would find nothing."""
        self._watched = list(queue_keys)

    def worker_state(self, state: WorkerStatus) -> None:
        """RQ's view of the worker: busy while it has jobs, idle otherwise."""
        self._worker_state = state

    def recover(self, max_jobs: int = 100) -> None:
        self._calls.append(ScriptCall("recover", "", "recover",
                                       [self.keys.leases(), self.keys.stream_steps()],
                                       [max_jobs, *self._recover_templates]))

    # Metrics.
    def count(self, name: str, amount: int = 1) -> None:
        self._counters[name] += amount

    def observe(self, histogram: str, value: float) -> None:
        self._observations[histogram].append(value)

    def write_metrics_now(self) -> None:
        """The next flush writes the metrics whatever the interval (an idle or draining worker:
        nothing may wait for a later flush)."""
        self._metrics_now = True

    def _are_metrics_due(self, now: float) -> bool:
        return bool(self._counters or self._observations) and (
            self._metrics_now or now - self._metrics_written_at >= self.metrics_interval_s)

    def _queue_metrics(self, pipe: Pipeline) -> None:
        counters = {name: amount for name, amount in self._counters.items() if amount}
        for name, amount in counters.items():
            pipe.hincrby(self.keys.counters(), name, amount)
        for histogram, values in self._observations.items():
            # Cumulative buckets: each observation counts in every bucket whose bound >= it.
            increments = [0] * len(HISTOGRAM_BUCKETS)
            for value in values:
                first = bisect.bisect_left(HISTOGRAM_BUCKETS, value)
                if first < len(increments):
                    increments[first] += 1
            key = self.keys.histogram(histogram)
            running = 0
            for name, increment in zip(_BUCKET_NAMES, increments):
                running += increment
                if running:
                    pipe.hincrby(key, name, running)
            pipe.hincrby(key, "+Inf", len(values))
            pipe.hincrby(key, "count", len(values))
            pipe.hincrbyfloat(key, "sum", sum(values))

    # The round trip.
    def flush(self) -> PublishReport:
        """Send everything queued since the last flush in one MULTI/EXEC and report.

        On a connection error the queued work is kept, so calling flush again resends it: a
        resent append skips the tokens already there, a resent finish or requeue is refused
        (the job already ended or left), so a retry after an ambiguous failure is harmless
        (metric counters aside, which may count that iteration twice). Stream shards go first,
        so a job's tokens are in its stream before the main Redis records its end.
        """
        report = PublishReport()
        report.refused |= self._to_shards.flush(list(self._live.values()),
                                                list(self._carried.values()), self._renews())
        calls = self._calls
        started = time.monotonic()
        renew = self._renews()
        append_ids, append_keys, append_args = (list(self._append_ids), list(self._append_keys),
                                                list(self._append_args))
        # [redis-cost] A sharded job's main-Redis lease check adds nothing to its stream's
        # fencing (its shard's fence refuses an older claim's tokens, and the shard append runs
        # before this round trip anyway): it only tells this worker that the lease is gone,
        # which a renewal (every 1/8 lease) tells as well. Between renewals such a job costs the
        # main Redis one SMISMEMBER argument (its cancel flag), not a script's lease GET.
        flag_only = []
        for sharded in self._sharded:
            if renew or sharded.is_first:
                append_ids.append(sharded.job_id)
                append_keys += sharded.keys
                append_args += sharded.args
            else:
                flag_only.append(sharded.job_id)
        # Live jobs streaming here; those on shards went live in their shards' round trips and
        # only need their cancel flags.
        live = []
        for job in self._live.values():
            if self.shards.remote(job.lease) is None:
                live.append(job)
            else:
                flag_only.append(job.job_id)
        notified = list(self._notified)
        for job in live:
            tokens = token_args(job.unpublished[job.num_notified:])
            if tokens:
                notified.append((self.keys.stream(job.job_id), tokens))
        oldest_complete_ms = min((job.stream_complete_ms for job in live), default=0)
        if append_ids or live:
            # Appends first: a job's last tokens precede its finish in the same transaction.
            calls = [ScriptCall("append", "", "append",
                                 [self.keys.leases(), self.keys.canceled(),
                                  self.keys.live_fence(self.worker_name), *append_keys,
                                  self.keys.stream_steps(),
                                  self.keys.live_journal(self.worker_name)],
                                 [self.lease_ms, int(renew), encode_tokens(notified), len(live),
                                  oldest_complete_ms, self._live_epoch, *append_args]),
                     *calls]
        pipe = self.redis.pipeline(transaction=True)
        for call in calls:
            self.scripts.call(pipe, call.name, call.keys, call.args)
        # Replies right after the scripts': the cancel flags of sharded jobs, then the watched
        # queue lengths.
        if flag_only:
            pipe.smismember(self.keys.canceled(), flag_only)
        watched = self._watched
        for queue_key in watched:
            pipe.llen(queue_key)
        for command, args, kwargs in self._extra:
            getattr(pipe, command)(*args, **kwargs)
        if self.presence is not None:
            if self._heartbeat:
                self.presence.heartbeat(pipe)
            if self._worker_state is not None:
                self.presence.set_state(self._worker_state, pipe)
        write_metrics = self._are_metrics_due(started)
        if write_metrics:
            self._queue_metrics(pipe)
        stats = self._stats
        write_stats = stats is not None and (
            self._metrics_now or started - self._stats_written_at >= self.metrics_interval_s)
        if stats is not None and write_stats:
            key = self.keys.worker_stats(stats[0].name)
            pipe.hset(key, mapping=cast(Any, stats[0].to_fields()))
            pipe.pexpire(key, int(stats[1] * 1000))
        checks = 0  # the last replies: the registration checks
        if write_stats and self._registered_model is not None:
            pipe.hexists(self.keys.models(), self._registered_model)
            checks = 1
            if self.presence is not None:
                pipe.sismember(RQKeys.workers_set(), RQKeys.worker(self.presence.name))
                checks = 2
        replies = pipe.execute(raise_on_error=False)
        # Reset only once the scripts have run too: if Redis drops while they are reloaded, the
        # next flush resends the whole iteration (its appends are idempotent; its finishes and
        # requeues are refused if they ran; only metric counters may count twice).
        replies = retry_missing_scripts(self.scripts, self.redis, calls, replies)
        raise_refused_writes(replies)  # (before the reset: the whole flush is sent again)
        if renew and append_ids:
            self._renewed_at = started
        carried = list(self._carried.values())
        self._reset()
        if write_metrics:
            self._counters.clear()
            self._observations.clear()
            self._metrics_written_at = started
        if write_stats:
            self._stats, self._stats_written_at = None, started
        self._metrics_now = False
        # 0 only: an error reply (a Redis out again) says nothing either way.
        report.registration_lost = checks > 0 and 0 in replies[len(replies) - checks:]
        if watched:
            first = len(calls) + (1 if flag_only else 0)
            lengths = replies[first:first + len(watched)]
            report.queue_lengths = {key: int(n) for key, n in zip(watched, lengths)
                                    if isinstance(n, int)}
        # None when no append went (the carried jobs are sharded ones between renewals).
        append_reply = next((reply for call, reply in zip(calls, replies)
                             if call.kind == "append"), None)
        self._read_appends(append_ids, live, carried, started, append_reply, report)
        for call, reply in zip(calls, replies):
            if call.kind != "append":
                self._read(call, reply, report)
        if flag_only:
            flags = replies[len(calls)]
            if isinstance(flags, ResponseError):
                log.error("cancel check failed: %s", flags)
            else:
                report.canceled.update(job_id for job_id, flag in zip(flag_only, flags) if flag)
        if self._to_shards.pending_ends:
            self._to_shards.send_ends()
        return report

    @property
    def unreachable_shard(self) -> int | None:
        """The stream shard the last flush failed on, None if it failed elsewhere (or not)."""
        return self._to_shards.unreachable

    def leave_shard(self, shard: int) -> set[str]:
        """Take out of the queued flush everything of the jobs whose streams are on `shard`
        (which does not answer): their tokens, first-token state, lease renewals, finishes and
        requeues, so that the rest goes without them. Their leases then lapse and recovery hands
        them on once the shard answers; their streams end where they are, and a resumer
        continues after them. Returns their ids: the worker drops those it still runs."""
        on_shard = self._to_shards.drop_appends(shard)
        on_shard |= {job_id for job_id, job in self._live.items()
                     if self.shards.remote(job.lease) == shard}
        for jobs in (self._live, self._carried):
            for job_id in on_shard:
                jobs.pop(job_id, None)
        self._sharded = [sharded for sharded in self._sharded if sharded.job_id not in on_shard]
        self._calls = [call for call in self._calls if call.job_id not in on_shard]
        self._dropped_jobs = True  # recovery may need the live journal
        return on_shard

    def _read_appends(self, job_ids: list[str], live: list[RunningJob],
                      carried: list[RunningJob], started: float, reply: object,
                      report: PublishReport) -> None:
        """The append script's reply (None: no append this flush; `job_ids`: the jobs written to
        their streams); what the jobs now hold unpublished and notified follows from it."""
        results: list[int] = []
        canceled: list[int] = []
        notified, now_ms, live_result, canceled_ids = 0, 0, 2, []
        if isinstance(reply, ResponseError):
            log.error("append script failed: %s", reply)
            report.refused.update(job_ids)
        elif reply is not None:
            results, canceled, notified, now_ms, live_result, canceled_ids = cast("list[Any]",
                                                                                  reply)
        result_of = dict(zip(job_ids, results))
        for job in carried:
            job.unpublished.clear()  # in their streams now (or refused: the job leaves)
            job.num_notified = 0
            # A sharded job's stream_complete is its shard's (ShardPublisher).
            if result_of.get(job.job_id) == 1 and self.shards.remote(job.lease) is None:
                job.stream_complete_ms, job.stream_complete_at = int(now_ms), started
        for job in live:
            job.record_live(live_result, bool(notified))
        live_canceled = {raw.decode() if isinstance(raw, bytes) else str(raw)
                         for raw in canceled_ids}
        report.canceled.update(job.job_id for job in live if job.job_id in live_canceled)
        for job_id, result, flag in zip(job_ids, results, canceled):
            if result != 1:
                report.refused.add(job_id)
                if result == -1:
                    log.error("job %s: its tokens refused by the stream (not as a duplicate): "
                              "dropped", job_id)
            elif flag:
                report.canceled.add(job_id)

    def forget_live(self) -> None:
        """A worker stopping with no job left: every stream is complete, so its live journal
        and fence go (best effort: otherwise they expire)."""
        if not self._live_epoch or self._dropped_jobs:
            return  # jobs dropped without Redis: recovery needs the journal
        self.shards.forget_live(self.worker_name)

    def discard(self) -> None:
        """Forget what is queued (the worker gave up on Redis and dropped its jobs); final
        entries owed to shards stay owed (their jobs' ends are recorded already)."""
        self._dropped_jobs = True
        self._reset()

    def _read(self, call: ScriptCall, reply: object, report: PublishReport) -> None:
        if isinstance(reply, ResponseError):
            # A script error is a bug (ours), not a refusal: say so loudly, treat as refused so
            # the job leaves this worker and recovery hands it on.
            log.error("%s script failed for job %s: %s", call.kind, call.job_id, reply)
            report.refused.add(call.job_id)
            return
        if call.kind == "finish":
            if reply is None:
                report.refused.add(call.job_id)
            else:
                status = JobStatus(reply.decode() if isinstance(reply, bytes) else reply)
                report.ended[call.job_id] = status
                if call.end is not None:
                    # The cancel guard may have turned a finish into a cancel.
                    reason = (FinishReason.CANCELED.value if status == JobStatus.CANCELED
                              else call.end.finish_reason)
                    self._to_shards.pending_ends.append(
                        dataclasses.replace(call.end, finish_reason=reason))
        elif call.kind == "requeue":
            if reply == 1:
                report.requeued.add(call.job_id)
            else:
                report.refused.add(call.job_id)
        elif call.kind == "recover":
            recovered = cast("list[bytes | str] | None", reply)  # the job ids the script requeued
            report.recovered = [r.decode() if isinstance(r, bytes) else r for r in recovered or []]
