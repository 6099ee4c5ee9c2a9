"""Following one job's token stream in Redis: replay from any entry id, then wait for more.

Many readers may follow one stream; none of them consumes it (plain XREAD, no consumer group), so
a reconnecting client or a late subscriber sees the same entries as the first one did. With a
StreamHub the waiting is shared: one XREAD per process for all its readers (api/stream_hub.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import cast

import redis.asyncio as aioredis

from api.state_reads import SharedStateReads, end_if_taken_away_by_rq, read_state
from api.stream_hub import StreamHub, Subscription
from protocol import FinishReason, JobState, JobStatus, Keys, StreamEntry
from protocol.job_reader import XReadReply
from protocol.redis_errors import REDIS_UNREACHABLE
from protocol.rq_keys import RQKeys
from protocol.stream_ids import STREAM_START, entry_id_key, next_entry_id
from protocol.stream_shards import started_shard
from protocol.token_runs import RawEntry, expand_runs

_COUNT = 256  # entries per read
# How often a reader without a hub looks whether a job not started yet got its stream's shard.
_PLACEMENT_POLL_S = 0.05
# How often a reader behind the hub's live tokens looks whether the stream got them (a worker
# writes it at least every CARPOOL_DURABLE_INTERVAL_MS).
_CATCH_UP_POLL_S = 0.02


@dataclass(frozen=True, slots=True)
class StreamEvent:
    entry_id: str
    entry: StreamEntry

    @property
    def is_done(self) -> bool:
        return self.entry.kind == StreamEntry.DONE


def done_from_state(state: JobState) -> StreamEntry:
    """The final entry a finished job's stream should have had (for jobs ended without one)."""
    reason = state.finish_reason or {
        JobStatus.CANCELED: FinishReason.CANCELED, JobStatus.FAILED: FinishReason.ERROR,
    }.get(state.status, FinishReason.STOP)
    return StreamEntry(kind=StreamEntry.DONE, finish_reason=reason,
                       prompt_tokens=state.prompt_tokens,
                       completion_tokens=state.completion_tokens, error=state.error)


@dataclass(frozen=True, slots=True)
class StreamShard:
    """One server a stream may be on: its client, and this process' hub for it (None: readers
    block on XREADs of their own)."""

    redis: aioredis.Redis
    hub: StreamHub | None


class JobStream:
    """Reads `Keys.stream(job_id)` after a given entry id until the final entry.

    `unplaced`: the stream shards, for a job not started yet: the worker that starts it picks
    the shard (protocol/stream_shards.py), so `follow` waits for its stream on all of them and
    stays on the one its first entries come from (or its state names). A shard that fails
    meanwhile is left out of the wait rather than ending the reader: its workers start their
    jobs on another shard while it is out (worker/jobs/stream_shards.py), and the job's state,
    which the reader looks at every block interval, names the shard it started on. The reader
    fails, as a placed one whose shard fails, when that is a shard out, or every shard is out
    (api/stream_outages.py rides the outage out and follows again)."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, job_id: str, block_ms: int,
                 hub: StreamHub | None = None, stream_redis: aioredis.Redis | None = None,
                 state_reads: SharedStateReads | None = None,
                 unplaced: list[StreamShard] | None = None) -> None:
        self._redis = redis  # the main Redis: the job's state
        self._state_reads = state_reads  # shared by this process' readers of the job
        # The job's stream shard (protocol.stream_shards); the main Redis when not sharded.
        self._streams = stream_redis if stream_redis is not None else redis
        self._keys = keys
        self.job_id = job_id
        self._block_ms = block_ms
        self._hub = hub  # None: this reader blocks on an XREAD (and a connection) of its own
        self._shards = unplaced
        self._placed = not unplaced
        # The shards whose hubs failed while this job was not placed, with their errors
        # (api/stream_outages.py waits for the others only).
        self._shards_out: dict[int, BaseException] = {}

    def redis_clients(self) -> list[aioredis.Redis]:
        """The servers this reader reads: the main Redis (the job's state) and its stream's shard
        (every shard while the job is not placed)."""
        if self._placed or self._shards is None:
            servers = [self._redis, self._streams]
        else:
            shards = [shard for index, shard in enumerate(self._shards)
                      if index not in self._shards_out] or self._shards
            servers = [self._redis, *(shard.redis for shard in shards)]
        return list({id(server): server for server in servers}.values())

    async def last_event(self) -> StreamEvent | None:
        if not self._placed:
            return None  # not started when its state was read: nothing generated
        entries = expand_runs(cast("list[RawEntry]", await self._streams.xrevrange(
            self._keys.stream(self.job_id), count=1)))
        return _event(*entries[-1]) if entries else None

    async def read_all(self) -> list[StreamEvent]:
        if not self._placed:
            return []
        entries = cast("list[RawEntry]", await self._streams.xrange(self._keys.stream(self.job_id)))
        return [_event(entry_id, fields) for entry_id, fields in expand_runs(entries)]

    def _place(self, index: int) -> None:
        assert self._shards is not None
        self._streams, self._hub = self._shards[index].redis, self._shards[index].hub
        self._placed = True

    async def follow(self, after_id: str = STREAM_START, fresh_since: float | None = None,
                     ) -> AsyncGenerator[StreamEvent | None, None]:
        """Yield each entry after `after_id`, and None whenever a wait of `block_ms` brought nothing.

        `fresh_since`: when (monotonic) the caller last knew the job had nothing generated (None:
        not known), so the hub may skip reading its stream at first (StreamHub.subscribe).

        The Nones let the caller send keep-alives and notice a gone client. Ends after the final
        entry, or when the job's state hash is gone (expired). A job whose state says it ended
        without a final entry in its stream gets one synthesized, so no reader waits forever.
        """
        key = self._keys.stream(self.job_id)
        last_id = after_id
        subscription: Subscription | None = None
        # Not started yet: one subscription per shard's hub until the stream shows on one.
        waiting: dict[int, Subscription] = {}
        if not self._placed:
            assert self._shards is not None
            self._shards_out.clear()  # (a new try after an outage: each shard again)
            for index, shard in enumerate(self._shards):
                if shard.hub is not None:
                    waiting[index] = await shard.hub.subscribe(key, after_id, fresh_since)
        elif self._hub is not None:
            subscription = await self._hub.subscribe(key, after_id, fresh_since)
        try:
            while True:
                if not self._placed:
                    found, entries = await self._next_unplaced(waiting)
                    if found is not None:
                        self._place(found)
                        subscription = waiting.pop(found, None)
                        self._leave(waiting)
                        if not entries:
                            continue  # read there now
                elif subscription is None:
                    reply = cast(XReadReply, await self._streams.xread(
                        {key: last_id}, block=self._block_ms, count=_COUNT))
                    entries = reply[0][1] if reply else []
                else:
                    entries = await self._next_from_hub(subscription, key, last_id)
                if entries:
                    # A run (several tokens in one entry) is taken apart here, whichever read
                    # brought it; its tokens up to last_id were sent already.
                    for entry_id, fields in expand_runs(entries, after=last_id):
                        event = _event(entry_id, fields)
                        if entry_id_key(event.entry_id) <= entry_id_key(last_id):
                            continue  # read both by a catch-up and by the hub
                        last_id = event.entry_id
                        yield event
                        if event.is_done:
                            return
                    continue
                state_key, rq_job_key = self._keys.state(self.job_id), RQKeys.job(self.job_id)
                state_fields, rq_status = (
                    await self._state_reads.read(state_key, rq_job_key)
                    if self._state_reads is not None
                    else await read_state(self._redis, state_key, rq_job_key))
                if not state_fields:
                    return
                state = JobState.from_fields(state_fields)
                if await end_if_taken_away_by_rq(self._redis, self._keys, self.job_id,
                                                 state.status, rq_status):
                    continue  # to its final entry, which ends this reader
                if not self._placed:
                    assert self._shards is not None
                    started = started_shard(self.job_id, state.stream_shard, state.started_at,
                                            len(self._shards))
                    if started in self._shards_out:
                        # On a shard that failed under this reader: it fails as a placed one
                        # would, and the outage's retry looks again. (A worker that claimed the
                        # job onto its shard as the shard went puts it back unplaced: then it
                        # is waited for on the others again.)
                        raise self._shards_out[started]
                    if started is not None:
                        self._place(started)
                        # Its hub has followed the stream from this reader's position all along.
                        subscription = waiting.pop(started, None)
                        self._leave(waiting)
                        continue
                if state.status.is_final and not self._placed:
                    # Ended before any worker started it (canceled while queued).
                    yield StreamEvent(next_entry_id(last_id), done_from_state(state))
                    return
                if state.status.is_final:
                    # Whatever was written with the final status is visible now; read once more.
                    tail = await self._streams.xread({key: last_id}, count=_COUNT)
                    if tail:
                        if subscription is not None:  # read them at once, not when the hub does
                            subscription.rearm(cast(XReadReply, tail)[0][1][-1][0])
                        continue
                    yield StreamEvent(next_entry_id(last_id), done_from_state(state))
                    return
                yield None
        finally:
            if subscription is not None and self._hub is not None:
                self._hub.unsubscribe(subscription)
            self._leave(waiting)

    def _leave(self, waiting: dict[int, Subscription]) -> None:
        assert self._shards is not None or not waiting
        for index, subscription in waiting.items():
            hub = self._shards[index].hub if self._shards is not None else None
            if hub is not None:
                hub.unsubscribe(subscription)
        waiting.clear()

    async def _next_unplaced(self, waiting: dict[int, Subscription]
                             ) -> tuple[int | None, list[RawEntry]]:
        """Wait (a block interval at most) for the stream of a job not started yet on every
        shard: the shard its first entries came from (or whose hub has seen them: the reader
        then catches up there), with those entries; (None, []) when nothing came. Without hubs,
        look at its state until it names the shard."""
        assert self._shards is not None
        if not waiting:
            deadline = time.monotonic() + self._block_ms / 1000
            while time.monotonic() < deadline:
                shard, started_at = await self._redis.hmget(
                    self._keys.state(self.job_id), ["stream_shard", "started_at"])
                index = started_shard(self.job_id, int(shard) if shard else -1,
                                      float(started_at or 0), len(self._shards))
                if index is not None:
                    return index, []
                await asyncio.sleep(_PLACEMENT_POLL_S)
            return None, []
        for index, subscription in list(waiting.items()):
            if subscription.catch_up_to is not None:
                # Its hub followed the stream past this reader already (the reader catches up
                # there), unless another reader's position is all it had (no stream there).
                try:
                    if await self._shards[index].redis.exists(self._keys.stream(self.job_id)):
                        return index, []
                except REDIS_UNREACHABLE as exc:
                    self._shard_failed(index, waiting, exc)
                    continue
                subscription.take_catch_up()
        nexts = {asyncio.ensure_future(subscription.next(self._block_ms / 1000)): index
                 for index, subscription in waiting.items()}
        if not nexts:  # (none left: _shard_failed raised at the last; asyncio.wait takes no empty set)
            return None, []
        done, pending = await asyncio.wait(nexts, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()  # its subscription keeps anything delivered meanwhile
        await asyncio.gather(*pending, return_exceptions=True)
        found: tuple[int | None, list[RawEntry]] = (None, [])
        for task in done:
            try:
                entries = task.result()
            except REDIS_UNREACHABLE as exc:
                self._shard_failed(nexts[task], waiting, exc)
                continue
            if entries:
                found = (nexts[task], entries)
        return found

    def _shard_failed(self, index: int, waiting: dict[int, Subscription],
                      error: BaseException) -> None:
        """Leave shard `index` out of the wait for a job not placed yet; with every shard out,
        the reader fails as a placed one does when its shard fails."""
        assert self._shards is not None
        subscription = waiting.pop(index)
        hub = self._shards[index].hub
        if hub is not None:
            hub.unsubscribe(subscription)
        self._shards_out[index] = error
        if len(self._shards_out) == len(self._shards):
            raise error

    async def _next_from_hub(self, subscription: Subscription, key: str,
                             last_id: str) -> list[RawEntry]:
        """The hub's next entries, after those between `last_id` and the hub's cursor when this
        reader joined (or fell behind), which it reads itself. The hub may have delivered live
        tokens its stream does not hold yet (protocol/stream_steps.py): then the reader waits,
        a block interval at most, for the stream to get there before it takes the hub's."""
        bound = subscription.take_catch_up()
        if bound is not None and entry_id_key(last_id) < entry_id_key(bound):
            deadline = time.monotonic() + self._block_ms / 1000
            while True:
                # To the end, not to `bound`: a run (protocol/token_runs.py) that holds the
                # bound's token sits at its last token's id, past it. What the hub also has is
                # dropped by id.
                entries = cast("list[RawEntry]", await self._streams.xrange(
                    key, min=f"({last_id}", count=_COUNT))
                reached = bool(entries) and (
                    entry_id_key(_text(entries[-1][0])) >= entry_id_key(bound))
                if not reached:
                    subscription.rearm(bound)
                if entries:
                    return entries
                if time.monotonic() >= deadline:
                    return []
                await asyncio.sleep(_CATCH_UP_POLL_S)
        return await subscription.next(self._block_ms / 1000)


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _event(entry_id: object, fields: dict[object, object]) -> StreamEvent:
    return StreamEvent(_text(entry_id), StreamEntry.from_fields(fields))
