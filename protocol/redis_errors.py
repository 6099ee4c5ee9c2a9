"""The Redis failures that pass: which ones the API and the workers wait out and try again.

A read or a write that meets one of them succeeds later as it is (the worker resends what Redis
did not acknowledge, a reader resumes after its last event); any other Redis error is a bug or
a refusal that trying again does not mend.
"""

from __future__ import annotations

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError as RedisOutOfMemoryError
from redis.exceptions import TimeoutError as RedisTimeoutError

# Redis out of reach: restarting, stopped, across a network that dropped.
REDIS_UNREACHABLE = (RedisConnectionError, RedisTimeoutError)
# ...or refusing writes at its maxmemory (a policy that evicts nothing, as a job queue should run),
# whose memory comes back as finished jobs' keys expire. Reads still succeed there.
REDIS_UNAVAILABLE = (*REDIS_UNREACHABLE, RedisOutOfMemoryError)
