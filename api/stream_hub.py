"""One reader per API process (and stream shard) for every token stream its subscribers follow.

Without it each SSE subscriber held its own Redis connection blocked on its own XREAD: Redis paid a
command per token per subscriber and a connection per subscriber. The hub keeps two connections
(one subscribed, one for its reads) and fans each entry out in-process to the subscriptions of its
stream.

What it waits on: the step notifications (`Keys.stream_steps`, protocol/stream_steps.py), one Pub/Sub
message per worker step on one channel. A notification that carries its step's tokens (the usual
one) is handed out as it is, after the entries this hub delivered for each stream, and so is a
job's final entry (`f`); one that names streams instead (a step whose append was partly refused,
final entries from a shard or a queued job's cancel), or tokens after a gap,
makes the hub read just those streams, in one non-blocking XREAD. (It used to block on one XREAD
over every watched stream: Redis registered and unregistered each of them as a blocked key, re-ran
the read over all of them at every wake-up whichever had changed, and encoded every entry for it;
at 64 streams that was a third of Redis' CPU per token. Then on an XREAD of a stream of
notifications: a request to Redis at every step; a message sent it costs Redis no request.) No
entry is missed: the hub subscribes before it first reads any stream, and a writer publishes a
notification after its entries in the same script or transaction, so an entry is either in the
hub's read of its stream or in a message it gets. A full read of every watched stream at least
every block interval makes up for anything a notification did not announce (a writer that sends
none). A subscription that lost its connection (redis-py subscribes again, and the messages in
between are gone) ends every subscriber, as any lost connection does: they resume after their
last event.

Live tokens (protocol/stream_steps.py): a notification may carry tokens its stream gets only
later, so the hub's cursor may be ahead of the stream. A stream read after a gap then brings what
the stream has; the tokens after it come with the stream's next write.

Joining: a stream nobody here watches yet is read by the hub from the subscriber's own id at its
next turn: within `_WAIT_SLICE_S`, the longest it waits for a message before looking (on its own
socket: no request). Not when the hub heard its entries from the first on before the subscriber
came (it keeps them a while: `_recent`), and for a fresh subscriber (a job with nothing
generated yet) only when its notifications cannot show the stream complete, and not at all when
the hub has listened since the subscriber saw the job fresh (`subscribe`). A subscriber that
joins a watched stream behind the hub's cursor reads the entries in between itself (`catch_up_to`,
an XRANGE, waiting for the stream to get there: api/job_stream.py) and gets everything after the
cursor from the hub: no gap. Entries can reach a
subscriber twice (its own catch-up and the hub); the reader drops any id not above the last one it
yielded, so none is seen twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import cast

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.client import PubSub
from redis.asyncio.connection import Connection

from protocol.job_reader import XReadReply
from protocol.keys import Keys
from protocol.redis_errors import REDIS_UNREACHABLE
from protocol.stream_ids import STREAM_START, entry_id_key, next_entry_id, token_entry_id
from protocol.stream_steps import note_fields, notified_final, notified_streams, notified_tokens
from protocol.token_runs import RawEntry

log = logging.getLogger(__name__)

# The longest the hub waits for a notification before it looks for newly watched streams (no
# request to Redis: the wait is on the subscribed connection's socket).
_WAIT_SLICE_S = 0.02
# [redis-cost] How long a new stream whose job is fresh (`subscribe(..., fresh_since=...)`),
# seen so before the hub's subscription was confirmed, waits for
# a notification that makes its first read needless, before it is read anyway, with every other
# fresh stream still unread: one XREAD per this interval at most, where each new stream cost one
# at the next turn (every 20 ms or sooner under load). The read is also the safety net for
# entries written before the hub followed the stream whose notifications it did not hear (those
# it heard it keeps: _RECENT_S), which then come up to this much later than at the next turn.
_FRESH_READ_DELAY_S = 0.05
# [redis-cost] A stream's first entries that notifications brought before anyone here followed
# it, kept this long (and this many at most): a subscriber that comes right after (its first
# token raced its subscription, or a busy API served its request late) gets them from here, with
# no read and no wait. Reading the stream instead brought less under live tokens (protocol/
# stream_steps.py): the durable first token alone, then a read at every step (each notification
# a gap) until the stream's next write, the subscriber waiting.
_RECENT_S = 2.0
_RECENT_MAX_ENTRIES = 64
_FIRST_ENTRY_ID = token_entry_id(0)
# How long the hub stays subscribed with nothing to follow before it stops: a next subscriber
# within it costs Redis no new connection and subscription, and its fresh stream no first read
# ([redis-cost]: one job at a time, each had the hub start over: HELLO, SUBSCRIBE and a read).
_LINGER_S = 5.0


class Subscription:
    """One reader's share of the hub: entries of one stream after the hub's cursor, in order."""

    def __init__(self, key: str, watch: _Watch, catch_up_to: str | None, max_pending: int) -> None:
        self.key = key
        self._watch = watch
        # Entries up to this id (after the reader's own position) come from the reader's XRANGE.
        self.catch_up_to = catch_up_to
        self._max_pending = max_pending
        self._pending: deque[RawEntry] = deque()
        self._ready = asyncio.Event()
        self._error: BaseException | None = None

    def deliver(self, entry: RawEntry) -> None:
        if len(self._pending) >= self._max_pending:
            # A reader this far behind (its client reads slowly) re-reads from Redis instead of
            # holding an unbounded backlog here.
            self._pending.clear()
            self.catch_up_to = self._watch.cursor
            self._ready.set()
            return
        self._pending.append(entry)
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()

    def take_catch_up(self) -> str | None:
        bound, self.catch_up_to = self.catch_up_to, None
        return bound

    def rearm(self, bound: str) -> None:
        """The reader's catch-up read stopped short of `bound` (a page): it reads on later."""
        if self.catch_up_to is None or entry_id_key(bound) > entry_id_key(self.catch_up_to):
            self.catch_up_to = bound

    async def next(self, timeout_s: float) -> list[RawEntry]:
        """The entries the hub delivered since the last call; [] after `timeout_s` without any."""
        if not self._pending and self._error is None and self.catch_up_to is None:
            self._ready.clear()
            # asyncio.timeout, not wait_for: wait_for wraps the wait in a task of its own, and
            # 10,000 idle subscribers wait once a block interval each.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await self._ready.wait()
        if self._error is not None:
            raise self._error
        entries = list(self._pending)
        self._pending.clear()
        return entries


@dataclass(slots=True, eq=False)
class _Watch:
    """A stream the hub reads: the last id it read, and who gets its entries."""

    cursor: str
    subscribers: set[Subscription] = field(default_factory=set)


class StreamHub:
    """Follows many streams on two connections; `subscribe` and `unsubscribe` at any time.

    `reader` must be a client of its own (one connection, for the streams' reads); its pool gives
    the subscription to the step notifications another. `keys` names the step notifications and
    the streams they list.
    """

    def __init__(self, reader: aioredis.Redis, block_ms: int,
                 count: int = 256, max_pending: int = 4096, min_interval_ms: float = 0.0,
                 keys: Keys | None = None) -> None:
        self._reader = reader
        # After a turn that brought entries, wait this long from its start before the next, so
        # one turn gathers the steps of several workers (fewer reads, at that much latency).
        self._min_interval_s = min_interval_ms / 1000
        self._block_ms = block_ms
        self._count = count
        self._max_pending = max_pending
        self._keys = keys or Keys()
        self._watches: dict[str, _Watch] = {}
        self._dirty: set[str] = set()  # watched streams to read at the next turn
        # Fresh streams not read yet: when each is read at the latest (monotonic), unless a
        # notification that follows the subscriber's position comes first.
        self._unread: dict[str, float] = {}
        # Streams nobody here follows whose notified entries start at the first (0-1): when the
        # first came (monotonic) and the entries since, consecutive (_RECENT_S). None for the
        # entries: notified entries of a stream not kept (a gap, too many, a `k` naming it).
        self._recent: OrderedDict[str, tuple[float, list[RawEntry] | None]] = OrderedDict()
        # When (monotonic) the subscription to the notifications was confirmed, while it holds
        # (every later notification comes here); None: not subscribed.
        self._listening_since: float | None = None
        # When (monotonic) the last notification came: Redis was serving then (heard_within).
        self._notified_at = -float("inf")
        self._task: asyncio.Task[None] | None = None
        self._is_closed = False
        self._pubsub: PubSub | None = None  # the reader's subscription to the step notifications
        self._subscription_lost = False

    @property
    def _listening(self) -> bool:
        return self._listening_since is not None

    def heard_within(self, seconds: float) -> bool:
        """Whether a notification came in the last `seconds` on a subscription that still
        holds: Redis was up and serving a worker's step that recently, which a route may take
        for a read that would have succeeded (api/recent_submissions.py)."""
        return (self._listening and not self._subscription_lost
                and time.monotonic() - self._notified_at <= seconds)

    @property
    def num_streams(self) -> int:
        return len(self._watches)

    async def subscribe(self, key: str, after_id: str,
                        fresh_since: float | None = None) -> Subscription:
        """Entries of `key` after `after_id`, from now on. A new stream is read first, at the
        hub's next turn, unless the hub heard its entries from the first on up to past
        `after_id` (kept in `_recent`): every entry is notified, so those are all it has.

        `fresh_since`: when (monotonic) the caller last knew the job had nothing generated (before
        it submitted the job, or before its read of a state with no first token); None: not
        known. A new fresh stream is then not read at once ([redis-cost]: it was one XREAD a job)
        while the hub is listening, since every entry written from then on comes with a
        notification: those notified before this call are in `_recent`, or marked there as not
        kept (then it is read); when the hub has listened since `fresh_since` (and that is within
        _RECENT_S), nothing else can have been written, and the stream is not read at all. Else
        the first notification that follows `after_id` shows nothing was missed, one after a gap
        has it read, and with none within _FRESH_READ_DELAY_S it is read anyway (entries written
        before the hub listened, the job maybe ended). The full read every block interval stays
        the safety net."""
        if self._is_closed:
            raise redis.exceptions.ConnectionError("the stream hub is closed")
        watch = self._watches.get(key)
        is_new = watch is None
        if watch is None:
            watch = self._watches[key] = _Watch(cursor=after_id)
        behind = entry_id_key(after_id) < entry_id_key(watch.cursor)
        subscription = Subscription(key, watch, watch.cursor if behind else None,
                                    self._max_pending)
        watch.subscribers.add(subscription)
        if is_new:
            heard = self._recent.pop(key, None)
            kept = heard[1] if heard is not None else None
            if kept and self._listening \
                    and entry_id_key(after_id) <= entry_id_key(kept[-1][0]):
                # [redis-cost] Its entries from the first on came before it was followed, every
                # one notified: the stream holds no others (its live tokens maybe not even
                # those), so reading it would bring nothing more, or less.
                position = entry_id_key(after_id)
                for entry in kept:
                    if entry_id_key(entry[0]) > position:
                        subscription.deliver(entry)
                watch.cursor = kept[-1][0]
            elif (not self._listening or heard is not None  # (entries it did not keep)
                  or fresh_since is None or after_id != STREAM_START):
                self._dirty.add(key)
            elif not self._heard_all_since(fresh_since):
                self._unread[key] = time.monotonic() + _FRESH_READ_DELAY_S
            # else: no entry since the caller saw it fresh; each one to come is notified
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="stream-hub")
        return subscription

    def _heard_all_since(self, moment: float) -> bool:
        """Whether every notification published since `moment` (monotonic) came to this hub and
        is still accounted for: handed out, or kept or marked in `_recent` (which forgets after
        _RECENT_S)."""
        since = self._listening_since
        return (since is not None and since <= moment and not self._subscription_lost
                and time.monotonic() - moment < _RECENT_S)

    def unsubscribe(self, subscription: Subscription) -> None:
        watch = self._watches.get(subscription.key)
        if watch is None or subscription not in watch.subscribers:
            return
        watch.subscribers.discard(subscription)
        if not watch.subscribers:
            del self._watches[subscription.key]  # the reader stops _LINGER_S after the last
            self._unread.pop(subscription.key, None)

    async def close(self) -> None:
        self._is_closed = True
        task = self._task
        if task is not None and not task.done():
            # Left to see it between two waits rather than cancelled inside a read.
            await asyncio.wait({task}, timeout=_WAIT_SLICE_S + 1)
            if not task.done():
                task.cancel()
        self._fail_all(redis.exceptions.ConnectionError("the stream hub is closed"))
        await self._reader.aclose()

    def _fail_all(self, error: BaseException) -> None:
        watches, self._watches = self._watches, {}
        self._unread.clear()
        self._recent.clear()
        for watch in watches.values():
            for subscription in watch.subscribers:
                subscription.fail(error)

    async def _subscribe(self) -> PubSub:
        """The reader's subscription to the step notifications, confirmed. A pooled connection
        left over from a Redis that restarted fails at its first use: nothing was read yet, so
        a second one is tried."""
        try:
            return await self._subscribe_once()
        except redis.exceptions.ConnectionError:
            return await self._subscribe_once()

    async def _subscribe_once(self) -> PubSub:
        pubsub = self._pubsub = self._reader.pubsub()
        pubsub.on_connect = self._on_reconnect  # type: ignore[method-assign]
        try:
            await pubsub.subscribe(self._keys.stream_steps())
            while await pubsub.get_message(timeout=self._block_ms / 1000) is None:
                pass  # the subscription's confirmation
        except BaseException:
            with contextlib.suppress(Exception):
                await pubsub.aclose()
            raise
        self._subscription_lost = False  # a reconnect while subscribing missed nothing yet
        return pubsub

    async def _run(self) -> None:
        pubsub: PubSub | None = None
        try:
            # Subscribed before any stream is read: see the module's docstring.
            pubsub = await self._subscribe()
            self._listening_since = time.monotonic()
            full_read_at = -float("inf")
            idle_since = None  # monotonic time the last stream was left, while none is followed
            while not self._is_closed:
                started = time.monotonic()
                if self._watches:
                    idle_since = None
                elif idle_since is None:
                    idle_since = started
                elif started - idle_since >= _LINGER_S:
                    break
                if started - full_read_at >= self._block_ms / 1000:
                    full_read_at = started
                    self._dirty.update(self._watches)
                while self._recent and next(iter(self._recent.values()))[0] < started - _RECENT_S:
                    self._recent.popitem(last=False)
                if self._unread and min(self._unread.values()) <= started:
                    # Every fresh stream still unread goes in the same XREAD as the one due.
                    self._dirty.update(self._unread)
                brought = bool(self._dirty) and await self._read_dirty()
                # Wait only when nothing is left to read (a stream with more than a page is).
                wait_s = 0.0 if self._dirty else max(0.0, min(
                    _WAIT_SLICE_S, self._block_ms / 1000 - (time.monotonic() - full_read_at)))
                notified = False
                message = await pubsub.get_message(ignore_subscribe_messages=True,
                                                   timeout=wait_s)
                while message is not None:  # every notification that came, in one turn
                    notified = True
                    self._notified_at = time.monotonic()
                    fields = note_fields(message["data"])
                    for key, entries in notified_tokens(fields):
                        self._deliver_notified(key, entries)
                    final = notified_final(fields)
                    if final is not None:
                        self._deliver_notified(final[0], [final[1]])
                    for key in notified_streams(fields):
                        if key in self._watches:
                            self._dirty.add(key)
                        else:
                            self._mark_unkept(key)  # written past what was notified
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0)
                if self._subscription_lost:
                    raise redis.exceptions.ConnectionError(
                        "the stream hub's subscription to the step notifications was lost")
                if (brought or notified) and self._min_interval_s:
                    await asyncio.sleep(self._min_interval_s - (time.monotonic() - started))
        except Exception as exc:
            # Every subscriber ends as a failed XREAD of its own would have ended it.
            if not isinstance(exc, REDIS_UNREACHABLE):
                log.exception("stream hub reader failed")
            self._fail_all(exc)
            # Its connection for reads sat idle through whatever broke the subscription (a Redis
            # restart): the next run starts on a new one.
            if self._reader.connection is not None:
                with contextlib.suppress(Exception):
                    await self._reader.connection.disconnect()
        finally:
            self._listening_since = None
            # Nothing comes for them now: whoever runs the hub next reads them first.
            self._dirty.update(key for key in self._unread if key in self._watches)
            self._unread.clear()
            self._recent.clear()  # what comes meanwhile is not heard
            if pubsub is not None:
                with contextlib.suppress(Exception):
                    await asyncio.shield(pubsub.aclose())
            if self._watches and not self._is_closed:
                # Subscribers came while this run was ending (`subscribe` saw it not done yet).
                self._task = asyncio.create_task(self._run(), name="stream-hub")

    async def _on_reconnect(self, connection: Connection) -> None:
        """redis-py reconnects a subscription that lost its connection and subscribes again: the
        notifications in between are gone, so the subscribers end as on any lost connection (and
        resume after their last event)."""
        self._subscription_lost = True
        if self._pubsub is not None:
            await PubSub.on_connect(self._pubsub, connection)

    async def _read_dirty(self) -> bool:
        """One non-blocking XREAD of the streams marked to read; whether it brought entries."""
        request = {key: self._watches[key] for key in self._dirty if key in self._watches}
        self._dirty.clear()
        for key in request:
            self._unread.pop(key, None)
        if not request:
            return False
        reply = cast(XReadReply, await self._reader.xread(
            {key: watch.cursor for key, watch in request.items()}, count=self._count) or [])
        self._dispatch(request, reply)
        for raw_key, entries in reply:
            if len(entries) >= self._count:  # a full page: more may be there
                key = raw_key.decode() if isinstance(raw_key, bytes) else str(raw_key)
                if key in self._watches:
                    self._dirty.add(key)
        return bool(reply)

    def _deliver_notified(self, key: str, entries: list[RawEntry]) -> None:
        """Entries a notification carried: handed out when they follow the stream's cursor; after
        a gap (entries this hub did not see, e.g. from before it watched the stream) the stream
        is read instead."""
        watch = self._watches.get(key)
        if watch is None:
            self._remember(key, entries)  # a stream nobody here follows (yet)
            return
        ms, seq = entry_id_key(watch.cursor)
        for entry_id, fields in entries:
            entry_ms, entry_seq = entry_id_key(entry_id)
            if (entry_ms, entry_seq) <= (ms, seq):
                continue  # delivered already (read from the stream)
            if entry_ms != ms or entry_seq != seq + 1:
                self._dirty.add(key)
                return
            # The entry right after the cursor: nothing before it is missing (ids are dense).
            self._unread.pop(key, None)
            watch.cursor, seq = entry_id, entry_seq
            for subscription in watch.subscribers:
                subscription.deliver((entry_id, fields))

    def _remember(self, key: str, entries: list[RawEntry]) -> None:
        """Keep a stream's notified entries from its first on (_RECENT_S), while consecutive;
        past a gap or _RECENT_MAX_ENTRIES, only that it got entries not kept."""
        recent = self._recent.get(key)
        if recent is not None and recent[1] is None:
            return  # marked already
        kept = recent[1] if recent is not None else None
        for entry in entries:
            if kept is None:
                if entry[0] != _FIRST_ENTRY_ID:
                    return
                kept = []
                self._recent[key] = (time.monotonic(), kept)
            elif entry_id_key(entry[0]) <= entry_id_key(kept[-1][0]):
                continue
            elif entry[0] != next_entry_id(kept[-1][0]) or len(kept) >= _RECENT_MAX_ENTRIES:
                self._mark_unkept(key)  # a gap, or too long to keep: it is read when followed
                return
            kept.append(entry)

    def _mark_unkept(self, key: str) -> None:
        """`key`, followed by nobody here, got entries the hub does not keep: a fresh subscriber
        to it reads it at once. (Marked since the first entry kept, if any: `_recent` stays in
        the order of its times.)"""
        recent = self._recent.get(key)
        self._recent[key] = (recent[0] if recent is not None else time.monotonic(), None)

    def _dispatch(self, request: dict[str, _Watch], reply: XReadReply) -> None:
        for raw_key, entries in reply:
            key = raw_key.decode() if isinstance(raw_key, bytes) else str(raw_key)
            watch = request[key]
            if self._watches.get(key) is not watch:
                continue  # everyone left (and maybe others joined anew) while the XREAD was out
            for entry_id, fields in entries:
                raw_id = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
                if entry_id_key(raw_id) <= entry_id_key(watch.cursor):
                    continue
                watch.cursor = raw_id
                for subscription in watch.subscribers:
                    subscription.deliver((raw_id, fields))
