"""The worker's view of the stream shards: which server holds a job's stream, and the adoption
of a claimed job's stream there (see worker/jobs/shard_scripts.py for the fencing)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, cast

from redis import Redis
from redis.exceptions import NoScriptError
from redis.typing import EncodableT

from protocol.job_reader import parse_entries
from protocol.keys import Keys
from protocol.redis_errors import REDIS_UNAVAILABLE
from protocol.rq_keys import KeyTemplate
from protocol.stream_shards import placed_shard
from worker.jobs.job_queue import ClaimedJob
from worker.jobs.job_scripts import JobScripts
from worker.jobs.lease import Lease

log = logging.getLogger(__name__)

# How long an adopted stream and its fence copy outlive a job that never ends (abandoned for
# good); the job's end sets its result TTL instead.
STREAM_KEEP_MS = 24 * 3600 * 1000


class StreamShards:
    """`clients[i]` holds the streams of the jobs whose state records shard i (those of a job
    started before shards were recorded: `stream_shard`'s pick). A client that *is* the main
    one keeps its jobs on the single-server path (one script per transition)."""

    def __init__(self, main: Redis, clients: list[Redis], scripts: JobScripts, keys: Keys) -> None:
        self.main = main
        self.clients = clients or [main]
        self.scripts = scripts
        self.keys = keys
        journal, fence = KeyTemplate.of(keys.live_journal("\x00")), KeyTemplate.of(
            keys.live_fence("\x00"))
        self._live_templates = [journal.prefix, journal.suffix, fence.prefix, fence.suffix]

    def remote(self, lease: Lease) -> int | None:
        """The shard index of the leased job's stream, or None when it is on the main Redis."""
        index = placed_shard(lease.job_id, lease.stream_shard, len(self.clients))
        return None if self.clients[index] is self.main else index

    def choose_home(self, pinned: int) -> int | None:
        """This worker's shard: where the streams of the jobs it starts go (the claim records
        it in their state), so each of its steps writes one shard, not every shard ([redis-
        cost]: a step's transaction and notification cost a shard about as much as its tokens).
        `pinned` (0 or more) if given, else the next in turn over the fleet's worker starts (a
        counter on the main Redis); None while the streams are not sharded."""
        if len(self.clients) <= 1:
            return None
        if pinned >= 0:
            return pinned % len(self.clients)
        turn = int(self.main.incr(self.keys.stream_shard_turns()))
        return (turn - 1) % len(self.clients)

    @property
    def has_remote(self) -> bool:
        return any(client is not self.main for client in self.clients)

    def load_scripts(self) -> None:
        for client in self.clients:
            if client is not self.main:
                self.scripts.load(client)

    def forget_live(self, worker_name: str) -> None:
        """A worker stopping with no job left: its live journal and fence go, on the main Redis
        and on every shard (best effort: otherwise they expire)."""
        remote = [client for client in self.clients if client is not self.main]
        for client in [self.main, *remote]:
            try:
                client.delete(self.keys.live_journal(worker_name), self.keys.live_fence(worker_name))
            except REDIS_UNAVAILABLE as exc:
                log.warning("could not delete the live journal: %s", exc)

    def _drop_old_stream(self, claim: ClaimedJob) -> bool:
        """An ended job that rq's requeue put back starts over: its old stream goes first from the
        shard it was placed on (the claim deleted one on the main Redis). False when that shard
        cannot be reached: the claim is left out, its lease lapses and recovery hands it on."""
        if claim.restarted_from_shard is None:
            return True
        index = placed_shard(claim.lease.job_id, claim.restarted_from_shard, len(self.clients))
        if self.clients[index] is self.main:
            return True
        try:
            self.clients[index].delete(self.keys.stream(claim.lease.job_id))
        except REDIS_UNAVAILABLE as exc:
            log.warning("stream shard %d unreachable, job %s (requeued by rq) left to recovery: "
                        "%s", index, claim.lease.job_id, exc)
            return False
        return True

    def call(self, index: int, name: str, keys: list[str], args: list[EncodableT]) -> Any:
        client = self.clients[index]
        try:
            return self.scripts.call(client, name, keys, args)
        except NoScriptError:
            self.scripts.load(client)  # the shard restarted (or its script cache was flushed)
            return self.scripts.call(client, name, keys, args)

    def adopt(self, claims: list[ClaimedJob], worker_name: str) -> list[ClaimedJob]:
        """Raise each sharded claim's fence on its shard, with the previous owner's live tokens
        written into its stream there, and read the stream (what a resumed job continues after);
        `worker_name` (the claimer) is recorded as the stream's owner. A claim whose shard cannot
        be reached, or whose stream a newer claim adopted, is left out: its lease lapses and
        recovery hands it on."""
        claims = [claim for claim in claims if self._drop_old_stream(claim)]
        by_shard: dict[int, list[int]] = {}
        for position, claim in enumerate(claims):
            index = self.remote(claim.lease)
            if index is not None:
                by_shard.setdefault(index, []).append(position)
        if not by_shard:
            return claims
        adopted: list[ClaimedJob | None] = list(claims)
        for index, positions in by_shard.items():
            keys: list[str] = []
            args: list[EncodableT] = [STREAM_KEEP_MS, worker_name, *self._live_templates]
            for position in positions:
                job_id = claims[position].lease.job_id
                keys += [self.keys.stream_fence(job_id), self.keys.stream(job_id),
                         self.keys.stream_owner(job_id)]
                args.append(claims[position].lease.token)
            keys.append(self.keys.stream_steps())
            try:
                replies = cast("list[list[Any]]", self.call(index, "shard_adopt", keys, args))
            except REDIS_UNAVAILABLE as exc:
                log.warning("stream shard %d unreachable, %d claimed jobs left to recovery: %s",
                            index, len(positions), exc)
                for position in positions:
                    adopted[position] = None
                continue
            for position, (is_adopted, entries) in zip(positions, replies):
                if is_adopted != 1:
                    log.warning("job %s: a newer claim adopted its stream", claims[position].lease.job_id)
                    adopted[position] = None
                    continue
                tokens = parse_entries([(entry[0], dict(zip(entry[1][::2], entry[1][1::2])))
                                        for entry in entries]).tokens
                adopted[position] = dataclasses.replace(claims[position], tokens=tokens)
        return [claim for claim in adopted if claim is not None]
