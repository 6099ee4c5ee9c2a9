"""The worker loop: RQ jobs in, engine steps, token streams out, one Redis round trip a step.

Each iteration:
  1. boundary: end jobs flagged canceled or past their deadline (engine.abort frees their
     blocks), then take as many queued jobs as free slots and KV blocks allow (non-blocking
     claim; a claimed job already past its deadline or queue timeout ends without starting);
  2. one engine step;
  3. one publish: tokens + lease renewals + finishes + requeues of preempted jobs + cancel
     checks + stats + metrics (+ RQ heartbeat and recovery when due).
Idle, it blocks on its queues' wake-up lists (BLPOP with a timeout, so heartbeats and recovery
keep running), then claims. A worker serves one model and takes jobs only off that model's queues.
SIGTERM drains: no new jobs, running ones get `drain_seconds` to finish, the rest are requeued.
`rq suspend` holds new jobs back (the claim refuses while it holds): the running ones go on to
their ends, and the worker looks for `rq resume` once a second, as rq's own worker does. rq's
worker commands (rq.command) arrive at iteration boundaries: shutdown drains as SIGTERM does,
stop-job cancels the job (worker/jobs/rq_commands.py).
Redis unreachable (restart, failover, network): every Redis step retries with capped exponential
backoff and jitter, logging each retry; jobs are dropped only once their leases must have lapsed.
A stream shard out of reach holds the batch up for a quarter of a lease; then only the jobs
streaming there leave it (to recovery), and the others go on.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from redis import Redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from rq.worker import WorkerStatus

from protocol.generation import FinishReason, PromptLogprobs, SamplingParams
from protocol.generation_defaults import generation_defaults
from protocol.job_submission import cancel_job
from protocol.keys import Keys
from protocol.messages import JobSpec, JobStatus, ModelCard, Priority, WorkerStats
from protocol.redis_errors import (
    REDIS_REFUSES_WRITES,
    REDIS_UNAVAILABLE,
    RedisReadOnlyError,
    drop_idle_connections,
    why_writes_are_refused,
)
from protocol.stream_shards import shard_urls
from worker.engine.config import BatchingMode
from worker.engine.outputs import StepOutput, StepStats
from worker.jobs.backoff import Backoff
from worker.jobs.job_queue import ClaimedJob, JobQueue, WorkersSuspended
from worker.jobs.job_scripts import JobScripts
from worker.jobs.rq_commands import RQCommands
from worker.jobs.rq_presence import RQPresence
from worker.jobs.rq_suspension import POLL_S as SUSPENSION_POLL_S
from worker.jobs.rq_suspension import Suspension
from worker.jobs.running_job import RunningJob
from worker.jobs.settings import WorkerSettings
from worker.jobs.stream_publisher import JobEnd, PublishReport, StreamPublisher
from worker.jobs.stream_shards import StreamShards

if TYPE_CHECKING:  # the engine (torch) is handed in by worker.__main__, never imported here
    from worker.engine.engine import Engine

log = logging.getLogger(__name__)

_REDIS_DOWN = REDIS_UNAVAILABLE  # waited out: a write is sent again, for a lease at most
# How long the whole batch waits for a stream shard that does not answer (a quarter of the lease)
# before the jobs streaming there are left to recovery and the others go on: long enough to ride
# out a shard's restart (an append-only redis-server is back within a second or two), short
# enough that the others' leases, renewed every eighth of one, never come near lapsing.
_SHARD_HOLD_LEASES = 0.25


@dataclass(slots=True)
class _Pending:
    """A job that ends without (more) engine work, published at the next flush."""

    job: RunningJob
    end: JobEnd


class BatchingWorker:
    def __init__(self, settings: WorkerSettings, engine: Engine, redis: Redis,
                 presence_redis: Redis | None = None, register_presence: bool = True) -> None:
        self.settings = settings
        self.engine = engine
        self.redis = redis
        self.keys = Keys(settings.keys_prefix)
        self.name = settings.name
        self.scripts = JobScripts()
        self.queue = JobQueue(redis, self.scripts, self.keys, self.name,
                              settings.served_model_name, settings.lease_ms,
                              settings.execution_ttl_seconds, settings.block_size)
        # rq's Worker adjusts its client's socket timeout for its own BLPOPs: give it its own,
        # with the main client's connect timeout (rq's commands are read through it at every
        # iteration: a partitioned Redis must not hold the loop past it).
        # rq_entry runs inside an rq worker, which keeps its own presence: no second one.
        rq_redis = presence_redis or _redis_client(settings.redis_url, settings)
        self.presence = RQPresence(rq_redis, self.name, self.queue.queue_names,
                                   ttl_seconds=int(max(settings.heartbeat_seconds * 3, 30))
                                   ) if register_presence else None
        # rq's commands to this worker (a Pub/Sub connection of that client's).
        self.rq_commands = RQCommands(rq_redis, self.name) if register_presence else None
        self.shards = StreamShards(redis, [
            redis if url == settings.redis_url else _redis_client(url, settings)
            for url in shard_urls(settings.redis_url, settings.stream_redis_urls)],
            self.scripts, self.keys)
        self.publisher = StreamPublisher(redis, self.scripts, self.keys, self.name,
                                         settings.lease_ms, self.presence, self.shards,
                                         settings.metrics_interval_ms / 1000,
                                         settings.durable_interval_ms / 1000)
        self.jobs: dict[str, RunningJob] = {}
        self._pending: list[_Pending] = []
        # Jobs of the tiers above batch waiting on this model's queues, as the last flush read
        # them.
        self._num_foreground_queued = 0
        # [redis-cost] The publish just before this boundary read every queue of this model
        # empty: the claim would answer nothing, so it is not sent (on these VMs a request's
        # wake-up of Redis costs more than its work; a worker with a free seat asks at every
        # step). Used once, by the next claim; a wait that wakes claims regardless.
        self._queues_seen_empty = False
        self._is_kv_starved = False  # the last claim found no KV room for a waiting higher tier
        self._foreground_queue_keys = [
            key for key, priority in zip(self.queue.queue_keys, Priority.ordered())
            if not priority.is_background]
        self._stop_requested = False
        # `rq suspend` held at the last claim or wait: no claim is sent until it is gone.
        self.suspension = Suspension(self.queue, self.name)
        self._last_heartbeat = 0.0
        self._last_publish = -math.inf  # monotonic time of the last flush
        self._last_stats: StepStats | None = None
        self._num_kv_blocks_total = 0
        self.model_names = {settings.served_model_name, settings.model}
        self._backoff = Backoff(base_s=settings.redis_backoff_base_seconds,
                                cap_s=settings.redis_backoff_cap_seconds)

    # Lifecycle.
    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)

    def request_stop(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag: raising here could interrupt a BLPOP whose reply holds a popped job id.
        log.info("worker %s: signal %d, draining", self.name, signum)
        self._stop_requested = True

    def run(self) -> int:
        self._warm_up()
        self.scripts.load(self.redis)
        self.shards.load_scripts()
        self.queue.home_shard = self.shards.choose_home(self.settings.stream_shard)
        if self.queue.home_shard is not None:
            log.info("worker %s: the jobs it starts stream to shard %d", self.name,
                     self.queue.home_shard)
        if self.presence is not None:
            self.presence.register_birth()
        if self.rq_commands is not None:
            self.rq_commands.subscribe()
        self._publish_model()
        self.publisher.watch_registration(self.settings.served_model_name)
        log.info("worker %s serving %s on %s", self.name, self.settings.served_model_name,
                 ", ".join(self.queue.queue_names))
        try:
            self._loop()
            if not self.jobs:
                self.publisher.forget_live()
        finally:
            if self.rq_commands is not None:
                self.rq_commands.close()
            if self.presence is not None:
                try:
                    self.presence.register_death()
                except _REDIS_DOWN as exc:  # its registration ages out with its heartbeat's TTL
                    log.warning("worker %s: could not register its death with rq: %s", self.name,
                                exc)
        log.info("worker %s stopped", self.name)
        return 0

    def run_adopted(self, job_id: str, queue_name: str) -> None:
        """Run one job that an rq worker already took off `queue_name`, to its end, through the
        batch's own claim, publish and finish (worker.rq_entry; no other job is taken)."""
        self.scripts.load(self.redis)
        adopt = (job_id, self.queue.queue_names.index(queue_name))
        self._admit(self.queue.claim(0, None, adopt=adopt))
        while self.jobs or self._pending:
            self._expire_overdue()
            self._publish(self.engine.step() if self.engine.has_unfinished() else None)

    def _warm_up(self) -> None:
        """One tiny generation before taking jobs: the first forward pass pays one-off costs
        (allocations, kernel selection) that must not eat into a real job's lease."""
        started = time.monotonic()
        self.engine.generate(["warm up"], SamplingParams(max_tokens=2, temperature=0.0))
        log.info("warm-up generation took %.2fs", time.monotonic() - started)

    def _publish_model(self) -> None:
        tokenizer = self.engine.tokenizer
        card = ModelCard(name=self.settings.served_model_name,
                         max_model_len=self.engine.max_model_len,
                         eos_token=getattr(tokenizer, "eos_token", None),
                         bos_token=getattr(tokenizer, "bos_token", None),
                         chat_template=getattr(tokenizer, "chat_template", None),
                         generation_defaults=self._generation_defaults(),
                         vocab_size=self.engine.vocab_size)
        tokenizer_json = self.engine.model_dir / "tokenizer.json"
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self.keys.models(), card.name, card.to_json())
            if tokenizer_json.is_file():
                pipe.set(self.keys.model_tokenizer(card.name), tokenizer_json.read_text())
            pipe.execute()
        if not tokenizer_json.is_file():
            log.warning("%s has no tokenizer.json: the API cannot count tokens for %s",
                        Path(tokenizer_json).parent, card.name)

    def _generation_defaults(self) -> dict[str, Any]:
        """The model's own sampling defaults, which the API applies to fields a request omits."""
        path = self.engine.model_dir / "generation_config.json"
        try:
            config = json.loads(path.read_text()) if path.is_file() else {}
        except (OSError, ValueError) as exc:
            log.warning("%s is unreadable, serving without its sampling defaults: %s", path, exc)
            return {}
        return generation_defaults(config) if isinstance(config, dict) else {}

    # The loop.
    def _loop(self) -> None:
        drain_deadline: float | None = None
        while True:
            self._act_on_rq_commands()
            if self._stop_requested and drain_deadline is None:
                drain_deadline = time.monotonic() + self.settings.drain_seconds
                log.info("worker %s: draining %d jobs for up to %.0fs", self.name,
                         len(self.jobs), self.settings.drain_seconds)
            draining = drain_deadline is not None
            if drain_deadline is not None and (not self.jobs or time.monotonic() >= drain_deadline):
                self._requeue_all()
                return
            if not draining:
                self._admit(self._claim_now())
            self._expire_overdue()
            output = self.engine.step() if self.engine.has_unfinished() else None
            if output is not None and output.stats.step_time_s > self.settings.lease_seconds / 2:
                log.warning("a step took %.2fs, over half the %.1fs lease: leases may lapse "
                            "(raise --lease-seconds)", output.stats.step_time_s,
                            self.settings.lease_seconds)
            self._publish(output)
            if not draining and not self.jobs and not self._pending and not self._stop_requested:
                self._admit(self._wait_for_jobs())

    def _free_slots(self) -> int:
        free_slots = self.engine.num_free_slots()
        if self.settings.mode is BatchingMode.SEQUENTIAL:
            # One job at a time: holding more would only keep them from other workers.
            return min(free_slots, 0 if self.jobs else 1)
        return free_slots

    def _claim_now(self) -> list[ClaimedJob]:
        queues_seen_empty, self._queues_seen_empty = self._queues_seen_empty, False
        if self.suspension.is_held and not self._has_resumed():
            return []  # nor are batch jobs preempted for waiting ones it would not take
        waiting = self._make_seats_for_foreground()
        free_slots = self._free_slots()
        # Jobs still waiting inside the engine mean it is full already: leave the rest queued
        # for workers that can start them now.
        if (free_slots <= 0 or queues_seen_empty
                or (self._last_stats is not None and self._last_stats.num_waiting)):
            return []
        budget = self.engine.num_free_kv_blocks() if self.engine.has_unfinished() else None
        if self.queue.home_shard is not None:
            # Its shard, or another while that one is out of reach (StreamShards.home_for_claims).
            home = self.shards.home_for_claims()
            if home is None:
                return []  # no shard answers: a job started now could not stream
            self.queue.home_shard = home
        try:
            claims = self.queue.claim(free_slots, budget)
        except WorkersSuspended:
            self.suspension.hold(len(self.jobs))
            return []
        except _REDIS_DOWN as exc:
            self._redis_unreachable("claiming jobs", exc)
            return []
        self._redis_reachable()
        # [redis-cost] With no KV budget to stop it, a claim short of its seats emptied every
        # queue: the next boundary (before any publish reads them again) need not ask.
        self._queues_seen_empty = budget is None and len(claims) < free_slots
        # A higher tier waits and a seat was free, yet nothing of it fit in the KV blocks left
        # (the claim keeps queue order, so it took nothing below it either): batch jobs hold them.
        num_foreground = sum(1 for claim in claims
                             if claim.spec is not None and not claim.spec.priority.is_background)
        self._is_kv_starved = waiting > 0 and budget is not None and not num_foreground
        self._num_foreground_queued = max(0, waiting - num_foreground)
        return claims

    def _make_seats_for_foreground(self) -> int:
        """Batch-tier jobs only fill seats nobody else wants: while higher-tier jobs wait and this
        worker is full, requeue (preempt) its youngest batch-tier jobs, one per waiting job, to
        the front of the batch queue, stream kept, so they resume exactly where they stopped.
        The claim that follows takes the highest tier first. (Another worker with free seats may
        take the waiting jobs first: then the batch jobs were requeued for nothing, a cost of a
        step or two, never a lost or duplicated token.) A worker with seats but no KV blocks left
        for a waiting job (the last claim was starved) gives up one batch job a boundary until
        the job fits. Returns the higher-tier jobs seen waiting."""
        # The last publish's reading, less what claims took since: with a stream interval it
        # serves several boundaries (a KV-starved claim must see it again at the next).
        waiting = self._num_foreground_queued
        shortfall = waiting - self._free_slots()
        if self._is_kv_starved and waiting:
            shortfall = max(shortfall, 1)
        self._is_kv_starved = False
        if shortfall <= 0:
            return waiting
        background = [job for job in self.jobs.values() if job.is_background]
        for job in reversed(background[-shortfall:]):  # the youngest first: the least to redo
            del self.jobs[job.job_id]
            self.engine.abort(job.job_id)  # frees its seat and KV blocks at this boundary
            self.publisher.requeue(job, count_as_preemption=True)
            log.info("job %s (batch tier) preempted: %d higher-tier jobs wait", job.job_id, waiting)
        return waiting

    def _wait_for_jobs(self) -> list[ClaimedJob]:
        self._queues_seen_empty = False  # the last publish's reading is older than the wait
        if self.suspension.is_held:
            # No wait on the wake-ups: each new job would end it early, for a refused claim.
            time.sleep(min(SUSPENSION_POLL_S, self.settings.idle_block_seconds))
            return self._claim_now()
        try:
            woken = self.queue.wait(self.settings.idle_block_seconds)
        except WorkersSuspended:
            self.suspension.hold(len(self.jobs))
            return []
        except _REDIS_DOWN as exc:
            self._redis_unreachable("waiting for jobs", exc)
            return []
        self._redis_reachable()
        if not woken:
            return []
        if self.settings.fault == "kill_after_wake":
            # Test hook: die between the blocking wait and the claim (tests/integration).
            os.kill(os.getpid(), signal.SIGKILL)
        # The job is still on its queue: a claim lost to Redis dropping is retried at the next
        # iteration boundary (or taken by another worker meanwhile).
        return self._claim_now()

    def _act_on_rq_commands(self) -> None:
        if self.rq_commands is None:
            return
        for command in self.rq_commands.received():
            if command.name == "shutdown":
                log.info("worker %s: rq's shutdown command, draining", self.name)
                self._stop_requested = True
            elif command.name in ("stop-job", "stop-execution") and command.job_id in self.jobs:
                # Canceled as through the API: it ends at the next boundary, its stream final.
                log.info("worker %s: rq's %s command for job %s, canceling it", self.name,
                         command.name, command.job_id)
                try:
                    cancel_job(self.redis, command.job_id, self.keys)
                except _REDIS_DOWN as exc:
                    self._redis_unreachable("canceling a job", exc)
            elif command.name in ("stop-job", "stop-execution"):
                log.info("worker %s: rq's %s command for job %s, which it does not run",
                         self.name, command.name, command.job_id)
            else:
                log.warning("worker %s: rq's %s command ignored (Carpool runs no work horse: "
                            "stop-job stops one job, shutdown the worker)", self.name,
                            command.name)

    def _has_resumed(self) -> bool:
        if not self.suspension.is_read_due:
            return False
        try:
            lifted = self.suspension.has_lifted()
        except _REDIS_DOWN as exc:
            self._redis_unreachable("reading rq's suspension", exc)
            return False
        self._redis_reachable()
        return lifted

    def _redis_unreachable(self, doing: str, exc: Exception) -> None:
        delay = self._backoff.next_delay()
        if isinstance(exc, REDIS_REFUSES_WRITES):
            log.warning("Redis refused a write while %s: %s (%s): retry %d in %.2fs", doing,
                        why_writes_are_refused(exc), exc, self._backoff.attempts, delay)
            if isinstance(exc, RedisReadOnlyError):
                clients = [self.redis, *self.shards.clients]
                drop_idle_connections(clients if self.presence is None
                                      else [*clients, self.presence.redis])
        else:
            log.warning("Redis unreachable while %s (%s: %s): retry %d in %.2fs", doing,
                        type(exc).__name__, exc, self._backoff.attempts, delay)
        time.sleep(delay)

    def _redis_reachable(self) -> None:
        if self._backoff.attempts:
            log.info("Redis reachable again after %d retries", self._backoff.reset())

    # Boundary: jobs in.
    def _admit(self, claims: list[ClaimedJob]) -> None:
        unstarted: list[ClaimedJob] = []
        adopted = self.shards.adopt(claims, self.name, unstarted)
        for claim in unstarted:
            # Claimed for their first start onto a shard that turned out to be out of reach:
            # back to the front of their queue, unplaced, with the next publish.
            self.publisher.requeue(_running(claim), count_as_preemption=False, unplace=True)
        for claim in adopted:
            job = _running(claim)
            if claim.is_canceled:
                self._end_later(job, JobEnd(JobStatus.CANCELED, FinishReason.CANCELED))
            elif claim.spec is None:
                self._fail(job, claim.error)
            elif why := claim.spec.expiry(claim.claimed_at, has_started=_has_started(claim)):
                self._expire(job, why)
            else:
                self._start(job, claim.spec)

    def _start(self, job: RunningJob, spec: JobSpec) -> None:
        stale = self.jobs.pop(job.job_id, None)
        if stale is not None:
            # Our old claim lapsed (a step outlived the lease), recovery requeued the job and we
            # took it again: the new lease is the one that counts, and the stream already holds
            # everything the old claim published.
            log.warning("job %s: re-claimed while still held under a lapsed lease", job.job_id)
            self.engine.abort(job.job_id)
        if spec.model not in self.model_names:
            self._fail(job, f"unknown model {spec.model!r}: worker {self.name} serves "
                            f"{self.settings.served_model_name!r}")
            return
        try:
            if spec.messages is not None:
                prompt_ids = list(self.engine.encode_chat(
                    spec.messages, add_generation_prompt=spec.add_generation_prompt,
                    continue_final_message=spec.continue_final_message,
                    template_kwargs=spec.chat_template_kwargs))
            elif spec.prompt_token_ids is not None:
                prompt_ids = list(spec.prompt_token_ids)  # the engine checks them against its vocabulary
            else:
                prompt_ids = list(self.engine.tokenizer.encode(spec.prompt))
            keep = spec.sampling.truncated_prompt_length(len(prompt_ids), self.engine.max_model_len)
            prompt_ids = prompt_ids[len(prompt_ids) - keep:]  # truncate_prompt_tokens: the last ones
            job.num_prompt_tokens = len(prompt_ids)
            if spec.sampling.prompt_logprobs is not None:
                job.prompt_token_ids = tuple(prompt_ids)  # sent with the prompt logprobs
            if job.num_tokens >= spec.sampling.max_tokens:
                # Its last token was published but not its end (cannot happen in one publish,
                # but a job must never run past max_tokens).
                self._end_later(job, JobEnd(JobStatus.FINISHED, FinishReason.LENGTH))
                return
            self.engine.add_request(job.job_id, prompt_ids, spec.sampling,
                                    output_token_ids=tuple(job.token_ids),
                                    preempt_first=spec.priority.is_background,
                                    cache_salt=spec.cache_salt)
        except (ValueError, TypeError) as exc:
            self._fail(job, str(exc))
            return
        except Exception as exc:  # a bad job must not take the worker (and its batch) down
            log.exception("job %s could not start", job.job_id)
            self._fail(job, f"internal error starting the job: {type(exc).__name__}: {exc}")
            return
        self.jobs[job.job_id] = job
        if job.token_ids:
            log.info("job %s resumed at token %d", job.job_id, job.num_tokens)

    def _expire_overdue(self) -> None:
        """Step boundary: running jobs past their deadline end now, keeping their tokens."""
        now = time.time()
        for job_id, job in list(self.jobs.items()):
            if job.spec is not None and job.spec.expiry(now, has_started=True):
                del self.jobs[job_id]
                self.engine.abort(job_id)  # frees its KV blocks at this boundary
                self._expire(job, "deadline")

    def _expire(self, job: RunningJob, why: str) -> None:
        log.info("job %s expired (%s) after %d tokens", job.job_id, why, job.num_tokens)
        self.publisher.count("jobs_expired_total")
        self._end_later(job, JobEnd(JobStatus.FINISHED, FinishReason.EXPIRED))

    def _fail(self, job: RunningJob, message: str) -> None:
        log.warning("job %s failed: %s", job.job_id, message)
        self._end_later(job, JobEnd(JobStatus.FAILED, FinishReason.ERROR, message))

    def _end_later(self, job: RunningJob, end: JobEnd) -> None:
        self._pending.append(_Pending(job, end))

    # Publish: jobs out.
    def _publish(self, output: StepOutput | None) -> None:
        now = time.time()
        pub = self.publisher
        finished: list[tuple[RunningJob, JobEnd]] = []
        if output is not None:
            self._last_stats = output.stats
            self._num_kv_blocks_total = max(self._num_kv_blocks_total,
                                            output.stats.num_kv_blocks_total)
            for preempted in output.preempted:
                job = self.jobs.pop(preempted.request_id, None)
                if job is not None:
                    # The stream is the record: whoever resumes it continues after its tokens.
                    pub.requeue(job, count_as_preemption=True)
            for request in output.outputs:
                job = self.jobs.get(request.request_id)
                if job is None or request.finish_reason is FinishReason.CANCELED:
                    # The engine reports an abort at the step after engine.abort(): this worker
                    # already acted on it (and may hold a new claim under the same id by then).
                    continue
                had_tokens = bool(job.token_ids)
                gaps = job.add_tokens(request.tokens, now)
                if request.prompt_logprobs is not None and not had_tokens:
                    # Only with token 0: a resumed job's were published with its first token.
                    job.prompt_logprobs = PromptLogprobs(
                        job.prompt_token_ids, tuple(request.prompt_logprobs)).encode()
                for gap in gaps:
                    pub.observe("inter_token_latency_seconds", gap)
                if not had_tokens and job.token_ids and job.state.created_at:
                    pub.observe("time_to_first_token_seconds", now - job.state.created_at)
                if request.num_prompt_tokens:
                    job.num_prompt_tokens = request.num_prompt_tokens
                    job.num_cached_tokens = request.num_cached_tokens
                if request.finish_reason is not None:
                    finished.append((job, JobEnd(JobStatus.FINISHED, request.finish_reason)))
        elif not self.engine.has_unfinished():
            self._last_stats = None
        if not (finished or self._is_publish_due(now)):
            return  # the tokens wait in job.unpublished for the next publish
        for job in self.jobs.values():
            pub.append(job)
        if self._free_slots() > 0 or any(job.is_background for job in self.jobs.values()):
            pub.watch_queues(self.queue.queue_keys)  # a few LLENs inside the same transaction
        for job, end in finished:
            pub.finish(job, end, now)
            del self.jobs[job.job_id]
        pending, self._pending = self._pending, []
        for item in pending:
            pub.finish(item.job, item.end, now)
        pub.stats(self._stats(now), self.settings.stats_ttl_seconds)
        pub.worker_state(WorkerStatus.SUSPENDED if self.suspension.is_held
                         else WorkerStatus.BUSY if self.jobs else WorkerStatus.IDLE)
        if not self.jobs or self._stop_requested:
            pub.write_metrics_now()  # idle or draining: no later step to carry them
        if now - self._last_heartbeat >= self.settings.heartbeat_seconds:
            pub.heartbeat([job.lease for job in self.jobs.values()],
                          self.settings.execution_ttl_seconds)
            pub.recover()
            self._last_heartbeat = now
        elif not self.jobs:
            pub.recover()  # idle: look for lapsed leases at every wait
        report = self._flush()
        self._last_publish = time.monotonic()
        for job in self.jobs.values():
            job.prompt_logprobs = ""  # sent with token 0 (a flush retries until it lands)
        self._act_on(report, pending)

    def _is_publish_due(self, now: float) -> bool:
        """Whether this step publishes (always, without a stream interval). Put off only while
        nothing but tokens would go: a job's first token (its time to first token), an end, a
        requeue, an idle or draining worker and the heartbeat go at once."""
        interval_s = self.settings.stream_interval_ms / 1000
        if (interval_s <= 0 or not self.jobs or self._pending or self._stop_requested
                or self.publisher.has_job_changes
                or now - self._last_heartbeat >= self.settings.heartbeat_seconds
                or time.monotonic() - self._last_publish >= interval_s):
            return True
        return any(job.unpublished and job.unpublished[0].index == 0
                   for job in self.jobs.values())

    def _flush(self) -> PublishReport:
        """Send the iteration; while Redis is unreachable retry with backoff, for at most a lease
        (after that the leases have lapsed and recovery hands the jobs on: drop them; their
        streams hold everything published so far). A stream shard out of reach for a quarter of
        a lease costs only its own jobs (_leave_shard)."""
        pub = self.publisher
        started = time.monotonic()
        deadline = started + self.settings.lease_seconds
        while True:
            try:
                report = pub.flush()
            except _REDIS_DOWN as exc:
                shard = pub.unreachable_shard
                if shard is not None and (time.monotonic() - started
                                          >= _SHARD_HOLD_LEASES * self.settings.lease_seconds):
                    self._leave_shard(shard, exc)
                    continue  # the rest at once
                if time.monotonic() < deadline:
                    self._redis_unreachable("publishing", exc)
                    continue
                if self.jobs:
                    log.error("Redis unreachable for a whole lease (%s): dropping %d jobs",
                              exc, len(self.jobs))
                for job_id in list(self.jobs):
                    self.engine.abort(job_id)
                self.jobs.clear()
                pub.discard()
                return PublishReport()
            self._redis_reachable()
            return report

    def _leave_shard(self, shard: int, exc: Exception) -> None:
        """Stream shard `shard` has not answered for a while: its jobs leave this worker's batch
        (their leases lapse; recovery hands them on once it answers, to resume after what their
        streams hold), and the jobs streaming elsewhere go on. Before, the whole batch waited on
        that one shard, for a lease, then was dropped."""
        left = self.publisher.leave_shard(shard)  # (those that ended too: their ends go unsent)
        for job_id, job in list(self.jobs.items()):
            if self.shards.remote(job.lease) == shard:
                left.add(job_id)
                self.engine.abort(job_id)
                del self.jobs[job_id]
        log.warning("stream shard %d unreachable (%s): its %d jobs left to recovery, which hands "
                    "them on once it answers; the %d others go on", shard, exc, len(left),
                    len(self.jobs))

    def _act_on(self, report: PublishReport, pending: list[_Pending]) -> None:
        lengths = report.queue_lengths
        self._num_foreground_queued = sum(lengths.get(key, 0) for key in self._foreground_queue_keys)
        self._queues_seen_empty = (len(lengths) == len(self.queue.queue_keys)
                                   and not any(lengths.values()))
        for job_id in report.refused:
            if self.jobs.pop(job_id, None) is not None:
                # Another worker holds it now (our lease lapsed): stop, write nothing more.
                self.engine.abort(job_id)
                self.publisher.count("fenced_writes_total")
                log.warning("job %s: lease lost, dropped from the batch", job_id)
        for status in report.ended.values():
            self.publisher.count(f"jobs_{status.value}_total")
        for job_id in report.canceled:
            job = self.jobs.pop(job_id, None)
            if job is not None:
                self.engine.abort(job_id)  # frees its KV blocks at this boundary
                self._end_later(job, JobEnd(JobStatus.CANCELED, FinishReason.CANCELED))
        if report.recovered:
            self.publisher.count("jobs_recovered_total", len(report.recovered))
            log.info("recovered %d jobs with lapsed leases: %s", len(report.recovered),
                     ", ".join(report.recovered))
        if report.registration_lost:
            self._register_again()

    def _register_again(self) -> None:
        """Redis lost this worker's registration (restarted without its data, or flushed): the
        API would refuse its model ("no model is registered") and `rq info` would not list it
        until a restart. The model card, the tokenizer and the rq registration, as at start."""
        log.warning("worker %s: its registration is gone from Redis (restarted without its "
                    "data?): registering %s again", self.name, self.settings.served_model_name)
        try:
            self._publish_model()
            if self.presence is not None:
                self.presence.register_again()
        except _REDIS_DOWN as exc:  # the next stats write checks again
            log.warning("worker %s: registering again failed: %s", self.name, exc)

    def _requeue_all(self) -> None:
        """End of a drain: unfinished jobs go back to the front of their queues."""
        for job_id, job in list(self.jobs.items()):
            self.engine.abort(job_id)
            self.publisher.requeue(job, count_as_preemption=False)
        pending, self._pending = self._pending, []
        for item in pending:
            self.publisher.finish(item.job, item.end)
        self.publisher.stats(self._stats(time.time(), drained=True),
                             self.settings.stats_ttl_seconds)
        self.publisher.write_metrics_now()
        if self.jobs:
            log.info("drain over: requeued %d unfinished jobs", len(self.jobs))
        self.jobs.clear()
        self._flush()

    def _stats(self, now: float, drained: bool = False) -> WorkerStats:
        free = self.engine.num_free_kv_blocks()
        total = max(self._num_kv_blocks_total, free)
        stats = self._last_stats if self.engine.has_unfinished() and not drained else None
        return WorkerStats(
            name=self.name, model=self.settings.served_model_name, mode=self.settings.mode.value,
            num_running=stats.num_running if stats else 0,
            num_waiting=stats.num_waiting if stats else 0,
            num_kv_blocks_used=total - free, num_kv_blocks_total=total,
            slot_utilisation=stats.slot_utilisation if stats else 0.0,
            max_num_seqs=self.engine.limits.max_num_seqs, updated_at=now,
            num_jobs=0 if drained else len(self.jobs) + len(self._pending),
            suspended=self.suspension.is_held)


def _running(claim: ClaimedJob) -> RunningJob:
    return RunningJob(lease=claim.lease, spec=claim.spec, state=claim.state,
                      result_ttl=claim.result_ttl, failure_ttl=claim.failure_ttl,
                      num_prompt_tokens=claim.state.prompt_tokens,
                      token_ids=[t.token_id for t in claim.tokens],
                      texts=[t.text for t in claim.tokens], claimed_at=claim.claimed_at)


def _has_started(claim: ClaimedJob) -> bool:
    """Whether an earlier claim started the job: the claim script stamps `started_at` with this
    claim's time (`claimed_at`, passed to it as repr, so equal when it was this claim) only on
    the first one."""
    return bool(claim.tokens) or claim.state.started_at != claim.claimed_at
def _redis_client(url: str, settings: WorkerSettings) -> Redis:
    """A client with the main one's timeouts and one quiet retry on a fresh connection (a pooled
    one may predate a restart): a stream shard's, and rq's presence and commands'."""
    return Redis.from_url(url, socket_timeout=settings.redis_timeout_seconds,
                          socket_connect_timeout=settings.redis_timeout_seconds,
                          health_check_interval=30, retry=Retry(NoBackoff(), 1))
