"""A worker step's round trips to its stream shards (protocol/stream_shards.py), sent before the
main one (worker/jobs/stream_publisher.py): per shard one MULTI/EXEC with the shard's append
script (the tokens of the jobs written to their streams there, and the live jobs' tokens, which
go to subscribers only: "Live tokens" in protocol/stream_steps.py) and the final entries owed to
it. A job's final entry is owed once the main Redis recorded its end (whose cancel guard decides
the outcome), and is resent with later flushes until the shard takes it. The fencing is in
worker/jobs/shard_scripts.py."""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from typing import Any, cast

from redis.exceptions import ResponseError
from redis.typing import EncodableT

from protocol.keys import Keys
from protocol.redis_errors import REDIS_UNAVAILABLE
from protocol.stream_steps import encode_tokens, notify_steps
from worker.jobs.job_scripts import JobScripts
from worker.jobs.running_job import RunningJob
from worker.jobs.script_calls import (
    EndMarker,
    ScriptCall,
    raise_refused_writes,
    retry_missing_scripts,
    token_args,
)
from worker.jobs.stream_shards import StreamShards

log = logging.getLogger(__name__)


class ShardPublisher:
    def __init__(self, shards: StreamShards, scripts: JobScripts, keys: Keys, worker_name: str,
                 lease_ms: int, live_epoch: str) -> None:
        self.shards = shards
        self.scripts = scripts
        self.keys = keys
        self.worker_name = worker_name
        self.lease_ms = lease_ms
        self.live_epoch = live_epoch  # this worker's live fence value ('' without live tokens)
        # Final entries owed to shards: kept across failed flushes (the end is already recorded
        # on the main Redis, so they are resent until a shard takes them).
        self.pending_ends: list[EndMarker] = []
        # The shard the last flush could not reach (None: it reached every shard it wrote).
        self.unreachable: int | None = None
        self.reset()

    def reset(self) -> None:
        """Forget this flush's appends (the owed final entries stay)."""
        self._ids: dict[int, list[str]] = defaultdict(list)
        self._keys: dict[int, list[str]] = defaultdict(list)
        self._args: dict[int, list[EncodableT]] = defaultdict(list)
        # The step's new tokens per stream, for the notification the shard's script writes.
        self._notified: dict[int, list[tuple[str, list[str]]]] = defaultdict(list)

    def append(self, shard: int, job_id: str, token: str, num_tokens: int, entry: list[str],
               tokens: list[str]) -> None:
        """A job's `num_tokens` new tokens (maybe none: its fence check) as one `entry` for its
        stream on `shard`; `tokens`, those subscribers did not get live yet, for the notification."""
        self._ids[shard].append(job_id)
        self._keys[shard] += [self.keys.stream_fence(job_id), self.keys.stream(job_id)]
        self._args[shard] += [token, num_tokens, *entry]
        if tokens:
            self._notified[shard].append((self.keys.stream(job_id), tokens))

    def flush(self, live: list[RunningJob], carried: list[RunningJob], renew: bool) -> set[str]:
        """Each shard's appends, the live tokens of `live` (every live job of the step; those
        streaming to shards go) and its owed final entries as one MULTI/EXEC; returns the jobs
        the shards refused. `carried`: the jobs whose tokens this flush writes to their streams
        (their stream_complete is the shard's clock). Raises on a shard that cannot be reached
        while it has appends (`unreachable` names it), keeping everything queued for the retry;
        final entries owed to a shard out of reach stay owed and hold nothing up."""
        ends_by_shard: dict[int, list[EndMarker]] = defaultdict(list)
        for marker in self.pending_ends:
            ends_by_shard[marker.shard].append(marker)
        live_by_shard = self._by_shard(live)
        carried_by_shard = self._by_shard(carried)
        started = time.monotonic()
        refused: set[str] = set()
        sent_ends: list[EndMarker] = []
        self.unreachable = None
        for shard in sorted(set(self._ids) | set(live_by_shard) | set(ends_by_shard)):
            calls: list[ScriptCall] = []
            has_appends = bool(self._ids.get(shard) or live_by_shard[shard])
            if not has_appends and self.shards.still_out(shard):
                continue  # only final entries owed: they wait until the shard answers again
            if has_appends:
                calls.append(self._append_call(shard, live_by_shard[shard], renew))
            calls += [self._end_call(marker) for marker in ends_by_shard[shard]]
            client = self.shards.clients[shard]
            pipe = client.pipeline(transaction=True)
            for call in calls:
                self.scripts.call(pipe, call.name, call.keys, call.args)
            notify_steps(pipe, self.keys, [marker.job_id for marker in ends_by_shard[shard]])
            try:
                replies = retry_missing_scripts(self.scripts, client, calls,
                                                pipe.execute(raise_on_error=False))
                raise_refused_writes(replies)
            except REDIS_UNAVAILABLE as exc:
                self.shards.mark_out(shard)  # the jobs this worker starts go elsewhere meanwhile
                if not has_appends:
                    # Owed final entries never hold the batch up (their ends are recorded: readers
                    # see them in the jobs' states); they go once the shard answers again.
                    log.warning("stream shard %d unreachable, %d final entries kept for when it "
                                "answers: %s", shard, len(ends_by_shard[shard]), exc)
                    continue
                self.unreachable = shard
                raise
            for call, reply in zip(calls, replies):
                if call.kind == "append":
                    refused |= self._read_append(self._ids[shard], live_by_shard[shard],
                                                 carried_by_shard[shard], started, reply)
                elif reply != 1:
                    log.warning("job %s: final entry refused by its stream shard (%s)",
                                call.job_id, reply)
            sent_ends += ends_by_shard[shard]
        self.pending_ends = [m for m in self.pending_ends if m not in sent_ends]
        return refused

    def drop_appends(self, shard: int) -> set[str]:
        """Forget this flush's appends to `shard` (the worker left its jobs to recovery); returns
        the ids of the jobs they were for."""
        job_ids = set(self._ids.pop(shard, []))
        for queued in (self._keys, self._args, self._notified):
            queued.pop(shard, None)
        return job_ids

    def send_ends(self) -> None:
        """The final entries of sharded jobs that just ended; a shard out of reach gets them
        with a flush after it answers again (meanwhile readers see the end in the job's state).
        Nothing else is queued, so this flush never raises (only appends do)."""
        self.flush([], [], renew=False)

    def _by_shard(self, jobs: list[RunningJob]) -> dict[int, list[RunningJob]]:
        by_shard: dict[int, list[RunningJob]] = defaultdict(list)
        for job in jobs:
            shard = self.shards.remote(job.lease)
            if shard is not None:
                by_shard[shard].append(job)
        return by_shard

    def _append_call(self, shard: int, live: list[RunningJob], renew: bool) -> ScriptCall:
        """The shard's append script for this flush: the jobs written to their streams there,
        and the live jobs whose tokens only go into its notification (and this worker's live
        journal there), as the main append takes them."""
        notified = list(self._notified[shard])
        for job in live:
            tokens = token_args(job.unpublished[job.num_notified:])
            if tokens:
                notified.append((self.keys.stream(job.job_id), tokens))
        oldest_complete_ms = min((job.stream_complete_ms for job in live), default=0)
        return ScriptCall("append", "", "shard_append",
                          [*self._keys[shard], self.keys.stream_steps(),
                           self.keys.live_fence(self.worker_name),
                           self.keys.live_journal(self.worker_name)],
                          [encode_tokens(notified), self.lease_ms, int(renew), len(live),
                           oldest_complete_ms, self.live_epoch, *self._args[shard]])

    def _end_call(self, marker: EndMarker) -> ScriptCall:
        return ScriptCall("end", marker.job_id, "shard_end",
                          [self.keys.stream_fence(marker.job_id), self.keys.stream(marker.job_id)],
                          [marker.token, marker.ttl_s, marker.finish_reason, marker.prompt_tokens,
                           marker.completion_tokens, marker.error, marker.cached_tokens])

    @staticmethod
    def _read_append(job_ids: list[str], live: list[RunningJob], carried: list[RunningJob],
                     started: float, reply: object) -> set[str]:
        """A shard append's reply: `job_ids` were written to their streams there (`carried`,
        the same jobs), `live` only notified; returns the refused. As the main append's, with
        the shard's clock for when their streams were complete (its window check's clock)."""
        if isinstance(reply, ResponseError):
            log.error("shard append script failed: %s", reply)
            for job in live:
                job.record_live(2, False)
            return set(job_ids)
        results, notified, now_ms, live_result = cast("list[Any]", reply)
        refused = set()
        for job_id, result in zip(job_ids, results):
            if result != 1:
                refused.add(job_id)
                if result == -1:
                    log.error("job %s: its tokens refused by the stream shard (not as a "
                              "duplicate): dropped", job_id)
        for job in carried:
            if job.job_id not in refused:
                job.stream_complete_ms, job.stream_complete_at = int(now_ms), started
        for job in live:
            job.record_live(live_result, bool(notified))
        return refused
