"""The step notifications a Redis publishes (protocol/stream_steps.py), caught by a subscriber
made before them: Pub/Sub keeps no history, so a test that checks them subscribes first."""

from __future__ import annotations

import weakref

from redis import Redis

from protocol.keys import Keys
from protocol.stream_steps import note_fields

# How long a check waits for one more notification before it takes what came as all of them
# (the publisher's reply has come back by then: the message left Redis in the same turn).
_QUIET_S = 0.05


class StepNotes:
    def __init__(self, redis: Redis, keys: Keys = Keys()) -> None:
        self._pubsub = redis.pubsub()
        self._pubsub.subscribe(keys.stream_steps())
        self._seen: list[dict[object, object]] = []
        while self._pubsub.get_message(timeout=1.0) is None:
            pass  # the subscription's confirmation: notifications published from now on come

    def all(self) -> list[dict[object, object]]:
        """Every notification so far, oldest first, as `notified_streams` and `notified_tokens`
        read them."""
        while (message := self._pubsub.get_message(timeout=_QUIET_S)) is not None:
            if message["type"] == "message":
                self._seen.append(note_fields(message["data"]))
        return list(self._seen)


_NOTES: weakref.WeakKeyDictionary[Redis, StepNotes] = weakref.WeakKeyDictionary()


def listen(redis: Redis) -> Redis:
    """`redis`, its step notifications caught from now on (`notes_of`)."""
    _NOTES[redis] = StepNotes(redis)
    return redis


def notes_of(redis: Redis) -> list[dict[object, object]]:
    return _NOTES[redis].all()
