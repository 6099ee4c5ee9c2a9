"""The worker's view of the stream shards: which server holds a job's stream, and the adoption
of a claimed job's stream there (see worker/jobs/shard_scripts.py for the fencing)."""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from typing import Any, cast

from redis import ConnectionPool, Redis
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError
from redis.retry import Retry
from redis.typing import EncodableT

from protocol.job_reader import parse_entries
from protocol.keys import Keys
from protocol.redis_errors import REDIS_UNAVAILABLE
from protocol.rq_keys import KeyTemplate
from protocol.stream_shards import placed_shard
from worker.jobs.backoff import Backoff
from worker.jobs.job_queue import ClaimedJob
from worker.jobs.job_scripts import JobScripts
from worker.jobs.lease import Lease

log = logging.getLogger(__name__)

# How long an adopted stream and its fence copy outlive a job that never ends (abandoned for
# good); the job's end sets its result TTL instead.
STREAM_KEEP_MS = 24 * 3600 * 1000
# How long a look at whether a shard that was out of reach answers again may hold up the worker's
# step loop (a stopped shard takes the connection but never answers).
_PROBE_TIMEOUT_S = 0.2


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
        # This worker's own shard (choose_home), and the one the jobs it starts go to now: another
        # that answers while its own is out of reach; None while none does.
        self._own_home: int | None = None
        self.home: int | None = None
        self._out: set[int] = set()  # shards a call failed on, until one answers again
        self._probes: dict[int, Redis] = {}
        self._probe_backoff = Backoff(base_s=0.5, cap_s=5.0)
        self._probe_at = 0.0  # (monotonic) the next look at the shards out
        self._probe_key = keys.shard_probe(uuid.uuid4().hex[:12])

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
            self._own_home = pinned % len(self.clients)
        else:
            turn = int(self.main.incr(self.keys.stream_shard_turns()))
            self._own_home = (turn - 1) % len(self.clients)
        self.home = self._own_home
        return self._own_home

    def mark_out(self, index: int) -> None:
        """A call to shard `index` failed: the jobs this worker starts go elsewhere until it
        answers again (home_for_claims)."""
        if self.clients[index] is not self.main and index not in self._out:
            self._out.add(index)
            self._probe_at = 0.0  # the next claim looks for a home at once

    def still_out(self, index: int) -> bool:
        """Whether shard `index` is out of reach: a call there failed and it has not taken a
        probe since (looked at again when due, as home_for_claims does)."""
        self._look_again()
        return index in self._out

    def home_for_claims(self) -> int | None:
        """The shard the jobs this worker claims now stream to (the claim records it in their
        state, for good: a job stays on the shard its stream is on). Its own, or while that one
        is out of reach the next in turn that answers, so that the jobs it claims while its
        shard is lost do not stick there with it; back to its own once that answers again.
        None while no shard answers: no job could stream, and none should be claimed. Shards
        out are looked at with a short write (a shard that answers a PING may still refuse
        writes: at its maxmemory, or unable to save), at growing intervals (0.5 s up to 5 s)."""
        if self._own_home is None or not self._out:
            return self.home
        self._look_again()
        return self.home if self.home not in self._out else None

    def _look_again(self) -> None:
        """Probe the shards out of reach, when due, and pick the home the answers leave."""
        now = time.monotonic()
        if not self._out or now < self._probe_at:
            return
        for index in list(self._out):
            if self._answers(index):
                self._out.discard(index)
        self._probe_at = now + self._probe_backoff.next_delay()
        if not self._out:
            self._probe_backoff.reset()
        if self._own_home is None:
            return
        size = len(self.clients)
        turn = [(self._own_home + step) % size for step in range(size)]
        home = next((index for index in turn if index not in self._out), None)
        if home != self.home:
            if home is None:
                log.warning("every stream shard is out of reach: no job is claimed until "
                            "one answers")
            elif home == self._own_home:
                log.warning("stream shard %d answers again: the jobs this worker starts "
                            "stream to it again", home)
            else:
                log.warning("stream shard %d out of reach: the jobs this worker starts "
                            "stream to shard %d meanwhile", self._own_home, home)
            self.home = home

    def _answers(self, index: int) -> bool:
        probe = self._probes.get(index)
        if probe is None:
            pool = self.clients[index].connection_pool
            # No retry: the shard client's one retry made a look at a stopped shard take 0.8 s
            # (4 x 0.2 s), all of it the worker's step loop waiting.
            probe = self._probes[index] = Redis(connection_pool=ConnectionPool(
                connection_class=pool.connection_class,
                **{**pool.connection_kwargs, "socket_timeout": _PROBE_TIMEOUT_S,
                   "socket_connect_timeout": _PROBE_TIMEOUT_S, "retry": Retry(NoBackoff(), 0)}))
        try:
            return bool(probe.set(self._probe_key, 1, px=1000))
        except REDIS_UNAVAILABLE:
            return False

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
            self.mark_out(index)
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

    def adopt(self, claims: list[ClaimedJob], worker_name: str,
              unstarted: list[ClaimedJob] | None = None) -> list[ClaimedJob]:
        """Raise each sharded claim's fence on its shard, with the previous owner's live tokens
        written into its stream there, and read the stream (what a resumed job continues after);
        `worker_name` (the claimer) is recorded as the stream's owner. A claim whose shard cannot
        be reached, or whose stream a newer claim adopted, is left out: its lease lapses and
        recovery hands it on. Except, when `unstarted` is given, a claim that placed its job on
        that shard (its first start: nothing of it is anywhere yet): it goes into `unstarted`,
        for the caller to put back on its queue unplaced (StreamPublisher.requeue), so that a
        worker whose shard answers starts it now, not after a lease."""
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
                self.mark_out(index)
                given_back = [position for position in positions
                              if unstarted is not None and claims[position].placed_now]
                log.warning("stream shard %d unreachable: %d claimed jobs put back unplaced, "
                            "%d left to recovery: %s", index, len(given_back),
                            len(positions) - len(given_back), exc)
                for position in positions:
                    if position in given_back:
                        assert unstarted is not None
                        unstarted.append(claims[position])
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
