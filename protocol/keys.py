"""Every Redis key Carpool writes, in one place (the role rq's `Job.key_for` plays for rq).

RQ owns `rq:*` (queues, jobs, registries, workers); Carpool adds its own keys under `carpool:*`
for what RQ has no notion of: token streams, leases with fencing tokens, cancel flags, the
models that live workers serve, and worker statistics.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.messages import Priority

# The RQ function path recorded on every job. Carpool workers never call it by name: they take
# jobs straight off the RQ queues into their batch. It makes the job legible in rq info and
# rq-dashboard, and would let a plain `rq worker` run a job unbatched.
RQ_JOB_FUNCTION = "worker.rq_entry.generate"


@dataclass(frozen=True, slots=True)
class Keys:
    prefix: str = "carpool"

    # RQ queue names (RQ itself prefixes them with rq:queue:), one per model and priority, so a
    # worker only ever pops jobs for the model it serves. Listed highest priority first, the
    # order in which workers take jobs. The priority is the last '-' part, so names never clash.
    def queue_name(self, model: str, priority: Priority) -> str:
        return f"{self.prefix}-{model}-{priority.value}"

    def queue_names(self, model: str) -> list[str]:
        return [self.queue_name(model, p) for p in Priority.ordered()]

    def model_of_queue(self, queue_name: str) -> str | None:
        """The model whose queue `queue_name` is (inverse of queue_name); None for another queue."""
        for priority in Priority.ordered():
            head, suffix = f"{self.prefix}-", f"-{priority.value}"
            if queue_name.startswith(head) and queue_name.endswith(suffix) and \
                    len(queue_name) > len(head) + len(suffix):
                return queue_name[len(head):-len(suffix)]
        return None

    def wakeups(self, queue_name: str) -> str:
        """List: one element pushed with every job put on the RQ queue `queue_name`; idle workers
        block on it (BLPOP), then claim from the queue itself. Popping a wake-up takes no job off
        a queue, so a worker killed right after it loses nothing; the claim trims the list to the
        queue's length, so stale wake-ups never pile up."""
        return f"{self.prefix}:queue:{queue_name}:wakeups"

    def queue_owners(self, queue_name: str) -> str:
        """Set: the owners (API key ids) with jobs in their list (`queue_owner_jobs`) of the RQ
        queue `queue_name`: the index the fair-share claim picks an owner from
        (worker/jobs/fair_share.py). Jobs stay on the RQ queue itself too."""
        return f"{self.prefix}:queue:{queue_name}:owners"

    def queue_owner_jobs(self, queue_name: str, owner: str) -> str:
        """List: `owner`'s jobs on the RQ queue `queue_name`, in queue order. Always
        `queue_owners(queue_name) + ":" + owner`: scripts build it that way from the set's key."""
        return f"{self.queue_owners(queue_name)}:{owner}"

    # Per job.
    def state(self, job_id: str) -> str:
        """Hash: Carpool's view of the job (status, owner, timings, usage); see JobState fields."""
        return f"{self.prefix}:job:{job_id}"

    def stream(self, job_id: str) -> str:
        """Stream: one entry per token, then one final entry (StreamEntry)."""
        return f"{self.prefix}:job:{job_id}:stream"

    def lease(self, job_id: str) -> str:
        """String with a TTL: the fencing token of the worker that currently owns the job."""
        return f"{self.prefix}:job:{job_id}:lease"

    def fence(self, job_id: str) -> str:
        """Counter: incremented at each claim; its value is the new owner's fencing token."""
        return f"{self.prefix}:job:{job_id}:fence"

    def stream_fence(self, job_id: str) -> str:
        """String, on the job's stream shard (protocol.stream_shards) when that is not the main
        Redis: the fencing token of the newest claim that adopted the stream; appends carrying
        another token are refused there (see worker/jobs/shard_scripts.py)."""
        return f"{self.prefix}:job:{job_id}:stream-fence"

    def stream_owner(self, job_id: str) -> str:
        """String, beside `stream_fence` on a stream shard: the name of the worker whose claim
        last adopted the stream, whose live journal on that shard may hold tokens the stream
        lacks (the next adoption writes them in: worker/jobs/shard_scripts.py)."""
        return f"{self.prefix}:job:{job_id}:stream-owner"

    def stream_steps(self) -> str:
        """Pub/Sub channel, on every Redis holding token streams (the main one and each stream
        shard): one message per worker step, published in the same script or transaction after
        its streams' entries: the step's tokens, or the stream keys to read (protocol/
        stream_steps.py). An API process' stream hub subscribes to it (api/stream_hub.py) instead
        of blocking on every stream it follows."""
        return f"{self.prefix}:stream-steps"

    def shard_probe(self, prober: str) -> str:
        """String with a 1 s TTL, on a stream shard: the write by which a worker (`prober`, an
        id of its own) looks whether a shard that failed takes writes again
        (worker/jobs/stream_shards.py)."""
        return f"{self.prefix}:shard-probe:{prober}"

    def stream_shard_turns(self) -> str:
        """Counter on the main Redis: worker starts that took a stream shard in turn (each
        takes the next; protocol/stream_shards.py)."""
        return f"{self.prefix}:stream-shard-turns"

    def live_journal(self, worker_name: str) -> str:
        """Stream with a TTL, on the main Redis (and on each stream shard the worker streams to,
        for the jobs there): the token notifications of a worker's steps that carried tokens not
        yet in their streams (live tokens, protocol/stream_steps.py), trimmed to a few live
        windows, so that recovery (a shard: the next adoption) can write a dead worker's live
        tokens into their streams before anyone resumes its jobs."""
        return f"{self.prefix}:worker:{worker_name}:live"

    def live_fence(self, worker_name: str) -> str:
        """String with a TTL, on the main Redis: the epoch of a worker whose every lease held at
        its last renewal, expiring with those leases. The append script notifies that worker's
        live tokens only while it is there (one GET a step, none per job); recovery deletes it
        when it takes any job from the worker, whose next renewal sets it again if it still
        holds the rest. On a stream shard, the same for the fence copies there, deleted by an
        adoption of one of the worker's streams."""
        return f"{self.prefix}:worker:{worker_name}:live-fence"

    # Shared sets.
    def leases(self) -> str:
        """Sorted set job_id -> lease deadline (ms since epoch): where recovery looks for lapsed jobs."""
        return f"{self.prefix}:leases"

    def canceled(self) -> str:
        """Set of job ids whose cancellation was requested; workers check their batch against it."""
        return f"{self.prefix}:canceled"

    def jobs_by_owner(self, owner: str) -> str:
        return f"{self.prefix}:owner:{owner}:jobs"

    def idempotency(self, owner: str, idempotency_key: str) -> str:
        """String with a TTL: the job id the owner's first submission with this Idempotency-Key
        made (written in the enqueue's own transaction)."""
        return f"{self.prefix}:owner:{owner}:idempotency:{idempotency_key}"

    def response(self, response_id: str) -> str:
        """String with a TTL: a stored Responses API response (api/responses_store.py) as JSON,
        with its owner, its input items and the chat a continuation starts from."""
        return f"{self.prefix}:response:{response_id}"

    # Stored chat completions (`store: true` on POST /v1/chat/completions;
    # api/chat_completions_store.py), owned by an API key, kept for the result retention.
    def chat_completion(self, completion_id: str) -> str:
        """String with a TTL: a stored chat completion as JSON, with its owner, metadata and the
        request's messages."""
        return f"{self.prefix}:chat-completion:{completion_id}"

    def chat_completions_by_owner(self, owner: str) -> str:
        """Sorted set completion id -> creation time of the owner's stored chat completions (ids
        whose record expired are dropped as listings meet them)."""
        return f"{self.prefix}:owner:{owner}:chat-completions"

    # The Conversations API (api/conversations_store.py): a conversation's record and its items,
    # kept for the server's result retention after their last write.
    def conversation(self, conversation_id: str) -> str:
        """Hash with a TTL: a conversation's owner, created_at and metadata (JSON)."""
        return f"{self.prefix}:conversation:{conversation_id}"

    def conversation_items(self, conversation_id: str) -> str:
        """List with a TTL: a conversation's items as JSON, oldest first."""
        return f"{self.prefix}:conversation:{conversation_id}:items"

    def conversation_pending(self, conversation_id: str) -> str:
        """List with a TTL: the background responses taking a turn in the conversation whose turn
        has not joined it yet, in the order they were made (settled by its next reader)."""
        return f"{self.prefix}:conversation:{conversation_id}:pending"

    def conversation_response(self, response_id: str) -> str:
        """String with a TTL: set once a response's input and output joined its conversation, so
        that two readers settling one background response add them once."""
        return f"{self.prefix}:response:{response_id}:in-conversation"

    # The Batch API (api/batch_*): files and batches, owned by an API key, kept for a retention.
    def file(self, file_id: str) -> str:
        """Hash with a TTL: a file's metadata fields (api.batch_files.FileObject) and `content`."""
        return f"{self.prefix}:file:{file_id}"

    def files_by_owner(self, owner: str) -> str:
        """Sorted set file id -> created_at of the owner's files (ids whose file expired are
        dropped as listings meet them)."""
        return f"{self.prefix}:owner:{owner}:files"

    def batch(self, batch_id: str) -> str:
        """Hash: the batch object's fields (api.batch_store.BatchRecord) and its answer counts."""
        return f"{self.prefix}:batch:{batch_id}"

    def batch_lines(self, batch_id: str) -> str:
        """Hash: input line index -> the jobs that line was submitted as (api.batch_store.LineJobs
        JSON), written once the line is queued."""
        return f"{self.prefix}:batch:{batch_id}:lines"

    def batch_answers(self, batch_id: str) -> str:
        """Hash: input line index -> its output or error file line, written once (HSETNX)."""
        return f"{self.prefix}:batch:{batch_id}:answers"

    def batches_by_owner(self, owner: str) -> str:
        """Sorted set batch id -> created_at of the owner's batches."""
        return f"{self.prefix}:owner:{owner}:batches"

    def batches_open(self) -> str:
        """Set of batch ids not yet in a final status: what the batch runners advance."""
        return f"{self.prefix}:batches:open"

    def batch_lock(self, batch_id: str) -> str:
        """String with a TTL: the token of the API process advancing the batch right now."""
        return f"{self.prefix}:batch:{batch_id}:lock"

    # Fair shares between API keys (worker/jobs/fair_share.py) and per-key limits.
    def fair_weights(self) -> str:
        """Hash owner id -> weight (a positive number; missing: 1), written by the API from its
        settings at start: the share of seats each key gets when keys compete."""
        return f"{self.prefix}:fair:weights"

    def fair_vtimes(self, model: str) -> str:
        """Hash owner id -> virtual token counter (tokens charged / weight) over `model`'s
        workers; the claim serves the owner with the lowest first."""
        return f"{self.prefix}:model:{model}:fair:vtimes"

    def fair_clock(self, model: str) -> str:
        """String: `model`'s virtual clock, the counter of the owner served last (it only grows);
        an owner coming back from idle starts there, so idling banks no credit."""
        return f"{self.prefix}:model:{model}:fair:clock"

    def owner_token_log(self, owner: str) -> str:
        """Sorted set: one member "<id>:<tokens>" per admitted submission -> its time (ms, Redis
        clock), over the last minute: the owner's tokens-per-minute limit counts from it."""
        return f"{self.prefix}:owner:{owner}:token-log"

    # Workers and models.
    def models(self) -> str:
        """Hash model name -> ModelCard JSON, written by workers at start and never removed: the
        models ever served here, whose jobs queue even while no worker serves them. Which of
        them are live is read from the live workers' stats (`worker_stats`, a TTL'd hash)."""
        return f"{self.prefix}:models"

    def model_tokenizer(self, model: str) -> str:
        """String: the model's tokenizer.json, so the API can count tokens without model files."""
        return f"{self.prefix}:model:{model}:tokenizer"

    def worker_stats(self, worker_name: str) -> str:
        """Hash with a TTL: a live worker's WorkerStats, refreshed every iteration."""
        return f"{self.prefix}:worker:{worker_name}:stats"

    def worker_stats_pattern(self) -> str:
        return f"{self.prefix}:worker:*:stats"

    # Webhooks (protocol.webhook_events; the dispatcher is the `webhooks` package).
    def webhook_events(self) -> str:
        """Stream: one entry per event to deliver (WebhookEvent fields), written in the same script
        or transaction as the change it reports; read by the dispatchers' consumer group
        (`webhook_group`) and deleted once delivered or dead-lettered."""
        return f"{self.prefix}:webhooks:events"

    def webhook_group(self) -> str:
        """The consumer group name of the dispatchers on `webhook_events` (not a key)."""
        return f"{self.prefix}-webhook-dispatchers"

    def webhook_retries(self) -> str:
        """Sorted set: event stream id -> when its next attempt is due (ms since epoch). The
        entry stays pending in the group meanwhile, so a restarted dispatcher continues."""
        return f"{self.prefix}:webhooks:retries"

    def webhook_attempts(self) -> str:
        """Hash: event stream id -> delivery attempts made so far."""
        return f"{self.prefix}:webhooks:attempts"

    def webhook_dead_letters(self) -> str:
        """Stream: events given up on (DeadLetter fields): attempts spent or URL refused."""
        return f"{self.prefix}:webhooks:dead-letters"

    # Metrics aggregated across workers (HINCRBY/HINCRBYFLOAT fields).
    def counters(self) -> str:
        """Hash: counter name (protocol.messages.COUNTERS) -> running total over all workers."""
        return f"{self.prefix}:metrics:counters"

    def histogram(self, name: str) -> str:
        """Hash: bucket upper bound (`str(bound)` of HISTOGRAM_BUCKETS, or '+Inf') -> count, plus
        'sum' and 'count'. Counts are cumulative, as Prometheus' `le` buckets: an observation
        increments every bucket whose bound is >= it, and '+Inf' always."""
        return f"{self.prefix}:metrics:hist:{name}"
