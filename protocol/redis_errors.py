"""The Redis failures that pass: which ones the API and the workers wait out and try again.

A read or a write that meets one of them succeeds later as it is (the worker resends what Redis
did not acknowledge, a reader resumes after its last event); any other Redis error is a bug or
a refusal that trying again does not mend.
"""

from __future__ import annotations

from collections.abc import Iterable

from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError as RedisOutOfMemoryError
from redis.exceptions import ReadOnlyError as RedisReadOnlyError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError


class RedisCannotPersistError(ResponseError):
    """MISCONF: Redis refuses writes because it cannot save to disk (an RDB snapshot or an
    append-only write failed: a full disk, its directory gone or not writable), as its
    `stop-writes-on-bgsave-error` (on by default) asks. Writes are taken again once a save
    succeeds; reads go on meanwhile."""


def _register_misconf() -> None:
    # redis-py names its error classes by the reply's first word (OOM, READONLY, ...) but has
    # none for MISCONF, which it raises as a bare ResponseError, the class of a bug's errors.
    from redis._parsers.base import BaseParser  # (both parsers, hiredis' too, go through it)

    BaseParser.EXCEPTION_CLASSES.setdefault("MISCONF", RedisCannotPersistError)


_register_misconf()

# Redis out of reach: restarting, stopped, across a network that dropped.
REDIS_UNREACHABLE = (RedisConnectionError, RedisTimeoutError)
# Redis refusing writes for now: at its maxmemory (a policy that evicts nothing, as a job queue
# should run; memory comes back as finished jobs' keys expire), unable to save to disk, or a
# read-only replica (READONLY: a failover demoted the server these connections reach; the
# client drops its idle connections, so that new ones find the primary its name leads to now).
REDIS_REFUSES_WRITES = (RedisOutOfMemoryError, RedisCannotPersistError, RedisReadOnlyError)
REDIS_UNAVAILABLE = (*REDIS_UNREACHABLE, *REDIS_REFUSES_WRITES)


def why_writes_are_refused(refusal: BaseException) -> str:
    """A REDIS_REFUSES_WRITES error's cause, in a few words for a log line."""
    if isinstance(refusal, RedisReadOnlyError):
        return "it is a read-only replica now (READONLY: a failover?)"
    if isinstance(refusal, RedisCannotPersistError):
        return "it cannot save to disk (MISCONF)"
    return "it is at its maxmemory (OOM)"


def drop_idle_connections(clients: Iterable[Redis]) -> None:
    """After READONLY: connections to a server a failover demoted stay there, refused every
    write. Each client's next command opens a new one, to the primary its address leads to now
    (connections in use go on: a replica serves reads)."""
    for client in {id(client): client for client in clients}.values():
        client.connection_pool.disconnect(inuse_connections=False)


__all__ = ["REDIS_REFUSES_WRITES", "REDIS_UNAVAILABLE", "REDIS_UNREACHABLE",
           "RedisCannotPersistError", "RedisReadOnlyError", "drop_idle_connections",
           "why_writes_are_refused"]
