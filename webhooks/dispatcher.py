"""The webhook dispatcher: reads `Keys.webhook_events` with a consumer group and POSTs each
event, signed, until a 2xx (at-least-once: an event is acknowledged only then, or once given up
on as a dead letter).

Durable state, all in Redis, so a restarted or replaced dispatcher continues where one stopped:
- an event read and not yet delivered stays pending in the group (XREADGROUP's PEL);
- a failed event's next attempt time is in `Keys.webhook_retries` (sorted set) and its attempt
  count in `Keys.webhook_attempts`; whichever dispatcher ZREMs a due id takes it (XCLAIM);
- a pending event with no retry time whose consumer stopped answering (idle past claim_idle_s:
  its dispatcher died mid-delivery) is taken over with XAUTOCLAIM.
Delivered and dead-lettered events are XACKed and XDELed, so the stream holds only open work.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

from redis import Redis
from redis.exceptions import ResponseError
from redis.typing import EncodableT, FieldT, StreamIdT

from protocol.keys import Keys
from protocol.redis_errors import REDIS_UNAVAILABLE, RedisReadOnlyError, drop_idle_connections
from protocol.webhook_events import DeadLetter, WebhookEvent
from webhooks.sender import Delivery, WebhookSender
from webhooks.settings import DispatcherSettings
from webhooks.signing import WebhookSigner

log = logging.getLogger(__name__)

DEAD_LETTERS_MAXLEN = 10_000  # approximate (MAXLEN ~): the newest are kept for inspection


def backoff_s(attempt: int, base_s: float, max_s: float, rng: Callable[[], float]) -> float:
    """Wait after failed attempt number `attempt` (1-based): base * 2^(attempt-1), capped, then
    jittered down by up to half, so receivers that failed together are not hit together again."""
    delay = min(max_s, base_s * 2.0 ** (attempt - 1))
    return float(delay * (0.5 + 0.5 * rng()))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class WebhookDispatcher:
    def __init__(self, redis: Redis, settings: DispatcherSettings, consumer: str,
                 keys: Keys = Keys(), sender: WebhookSender | None = None,
                 rng: Callable[[], float] = random.random) -> None:
        self.redis = redis
        self.settings = settings
        self.consumer = consumer
        self.keys = keys
        self.sender = sender or WebhookSender(settings.allow_list, settings.webhook_timeout_s)
        self.signer = WebhookSigner(settings.webhook_secret)
        self._rng = rng
        self._pool = ThreadPoolExecutor(settings.webhook_concurrency,
                                        thread_name_prefix="webhook")
        self._next_claim_at = 0.0
        self._claim_cursor = "0-0"

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.sender.close()

    def ensure_group(self) -> None:
        """The consumer group, created at the stream's start (events written before any
        dispatcher ran are delivered too)."""
        try:
            self.redis.xgroup_create(self.keys.webhook_events(), self.keys.webhook_group(),
                                     id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def run(self, stop: threading.Event) -> None:
        has_group = False
        while not stop.is_set():
            try:
                if not has_group:
                    self.ensure_group()
                    has_group = True
                self.step()
            except REDIS_UNAVAILABLE as exc:  # out of reach, or refusing writes for now
                log.warning("Redis unavailable (%s: %s); retrying in 1 s", type(exc).__name__,
                            exc)
                if isinstance(exc, RedisReadOnlyError):
                    drop_idle_connections([self.redis])
                stop.wait(1.0)
            except ResponseError as exc:
                # NOGROUP, or UNBLOCKED when the stream went under a blocked read.
                if not str(exc).startswith(("NOGROUP", "UNBLOCKED")):
                    raise
                # A Redis that came back without its data: the group (and its pending events)
                # went with it; the events written from now on are delivered.
                log.warning("the webhook consumer group is gone from Redis (%s): creating it "
                            "again", exc)
                has_group = False

    def step(self, block_ms: int = 1000) -> int:
        """One round: due retries, events of dead consumers, then new events (blocking up to
        `block_ms`, less when a retry falls due sooner); delivers them at once. Returns how
        many were attempted."""
        room = self.settings.webhook_concurrency
        events = self._take_due_retries(room)
        if len(events) < room and time.time() >= self._next_claim_at:
            events += self._claim_abandoned(room - len(events))
        if len(events) < room:
            events += self._read_new(room - len(events), 0 if events else self._block_ms(block_ms))
        if events:
            list(self._pool.map(self._attempt, events))
        return len(events)

    # Taking events.
    def _take_due_retries(self, count: int) -> list[WebhookEvent]:
        now_ms = int(time.time() * 1000)
        due = [_text(event_id) for event_id in self.redis.zrangebyscore(
            self.keys.webhook_retries(), "-inf", now_ms, start=0, num=count)]
        if not due:
            return []
        # Claim first (its idle time restarts, so no XAUTOCLAIM takes it), then ZREM decides
        # which of the dispatchers that saw it due delivers it: only one gets 1.
        claimed = self.redis.xclaim(self.keys.webhook_events(), self.keys.webhook_group(),
                                    self.consumer, 0, list[StreamIdT](due))
        mine = [event_id for event_id in due
                if self.redis.zrem(self.keys.webhook_retries(), event_id) == 1]
        return self._events([entry for entry in claimed if _text(entry[0]) in mine],
                            expected=mine)

    def _claim_abandoned(self, count: int) -> list[WebhookEvent]:
        """Pending events idle past claim_idle_s that wait on no retry time: their dispatcher
        died before it delivered them or recorded a retry."""
        idle_ms = int(self.settings.webhook_claim_idle_s * 1000)
        reply = self.redis.xautoclaim(self.keys.webhook_events(), self.keys.webhook_group(),
                                      self.consumer, idle_ms, start_id=self._claim_cursor,
                                      count=count)
        cursor, claimed = _text(reply[0]), reply[1]
        deleted = [_text(i) for i in reply[2]] if len(reply) > 2 else []
        self._claim_cursor = cursor
        if cursor == "0-0":  # a full pass over the pending list: the next one after a pause
            self._next_claim_at = time.time() + self.settings.webhook_claim_idle_s / 4
        if deleted:
            self._forget(deleted)
        waiting = set()
        for entry_id, _fields in claimed:
            if self.redis.zscore(self.keys.webhook_retries(), entry_id) is not None:
                waiting.add(_text(entry_id))  # its retry time is not yet: leave it for then
        return [event for event in self._events(claimed) if event.event_id not in waiting]

    def _read_new(self, count: int, block_ms: int) -> list[WebhookEvent]:
        reply = self.redis.xreadgroup(self.keys.webhook_group(), self.consumer,
                                      {self.keys.webhook_events(): ">"}, count=count,
                                      block=block_ms or None)
        entries: list[Any] = []
        for _stream, stream_entries in cast("list[Any]", reply or []):
            entries += stream_entries
        return self._events(entries)

    def _block_ms(self, block_ms: int) -> int:
        first = self.redis.zrange(self.keys.webhook_retries(), 0, 0, withscores=True)
        if not first:
            return block_ms
        wait_ms = int(first[0][1]) - int(time.time() * 1000)
        return max(1, min(block_ms, wait_ms))

    def _events(self, entries: Iterable[Any], expected: Sequence[str] = ()) -> list[WebhookEvent]:
        events = [WebhookEvent.from_entry(entry_id, fields) for entry_id, fields in entries
                  if fields]
        gone = [i for i in expected if i not in {e.event_id for e in events}]
        if gone:
            self._forget(gone)  # deleted from the stream meanwhile: nothing left to deliver
        return events

    def _forget(self, event_ids: Sequence[str]) -> None:
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.xack(self.keys.webhook_events(), self.keys.webhook_group(), *event_ids)
            pipe.hdel(self.keys.webhook_attempts(), *event_ids)
            pipe.zrem(self.keys.webhook_retries(), *event_ids)
            pipe.execute()

    # Delivering.
    def _attempt(self, event: WebhookEvent) -> None:
        try:
            # Counted before sending, so a dispatcher that dies mid-POST still uses one up.
            attempt = int(self.redis.hincrby(self.keys.webhook_attempts(), event.event_id, 1))
            delivery = self._deliver(event)
            self._record(event, attempt, delivery)
        except Exception:  # one event's trouble (Redis blip) must not stop the others
            log.exception("webhook event %s: attempt not recorded; it will be retried",
                          event.event_id)

    def _deliver(self, event: WebhookEvent) -> Delivery:
        if not event.url:
            return Delivery(ok=False, error="event has no url", refused=True)
        try:
            body = event.body()
        except ValueError as exc:
            return Delivery(ok=False, error=f"event data is not JSON: {exc}", refused=True)
        headers = self.signer.headers(event.webhook_id, int(time.time()), body)
        return self.sender.post(event.url, headers, body)

    def _record(self, event: WebhookEvent, attempt: int, delivery: Delivery) -> None:
        if delivery.ok:
            log.info("webhook %s %s delivered to %s (attempt %d)", event.event_id, event.type,
                     event.url, attempt)
            self._finish(event.event_id)
            return
        if delivery.refused or attempt >= self.settings.webhook_max_attempts:
            log.warning("webhook %s %s to %s given up after %d attempt(s): %s", event.event_id,
                        event.type, event.url, attempt, delivery.error)
            self._finish(event.event_id, DeadLetter.of(event, attempt, delivery.status_code,
                                                       delivery.error, time.time()))
            return
        delay = backoff_s(attempt, self.settings.webhook_backoff_base_s,
                          self.settings.webhook_backoff_max_s, self._rng)
        log.info("webhook %s %s to %s failed (attempt %d: %s); next in %.1f s", event.event_id,
                 event.type, event.url, attempt, delivery.error, delay)
        self.redis.zadd(self.keys.webhook_retries(),
                        {event.event_id: int((time.time() + delay) * 1000)})

    def _finish(self, event_id: str, dead_letter: DeadLetter | None = None) -> None:
        """Done with the event: acknowledged and dropped, with its dead letter when given up on,
        in one transaction (a crash leaves it pending, to be sent again: at-least-once)."""
        with self.redis.pipeline(transaction=True) as pipe:
            if dead_letter is not None:
                fields = cast("dict[FieldT, EncodableT]", dead_letter.to_fields())
                pipe.xadd(self.keys.webhook_dead_letters(), fields,
                          maxlen=DEAD_LETTERS_MAXLEN, approximate=True)
            pipe.xack(self.keys.webhook_events(), self.keys.webhook_group(), event_id)
            pipe.xdel(self.keys.webhook_events(), event_id)
            pipe.hdel(self.keys.webhook_attempts(), event_id)
            pipe.zrem(self.keys.webhook_retries(), event_id)
            pipe.execute()
