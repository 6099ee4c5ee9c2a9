"""Following a job's stream through a short Redis outage (the main Redis or the stream's shard
restarting): the reader resumes after the last event it handed out once Redis answers again.

An OpenAI, TGI or Anthropic stream has no way to resume: a client cut off mid-answer has lost it
(its job goes on, and only Carpool's own stream route could pick it up). A browser's EventSource
does reconnect with Last-Event-ID, but a reconnect that meets the outage's 503 fails for good
(the HTML standard's "fail the connection" on a non-200 answer). So every reader rides an outage
out in the API process, for `CARPOOL_STREAM_OUTAGE_S` from its first failed call: it keeps its
client's connection alive meanwhile (the Nones it yields), then follows the same stream again
from its position. Stream entries have fixed ids (token i is `0-(i+1)`), and the worker resends
what Redis did not acknowledge, so the resumed reader sees each token once, in order. Past the
grace the last error is raised, as before, and the route says so in its stream.

While Redis is out, the readers do not each try it: one PING at a time per server
(RedisRecovery), shared by all of them, says when it answers. 10,000 SSE subscribers retrying on
their own would each have started a connection every second.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass

import redis.asyncio as aioredis

from api.job_stream import JobStream, StreamEvent
from protocol.redis_errors import REDIS_UNREACHABLE
from protocol.stream_ids import STREAM_START

log = logging.getLogger(__name__)

_FIRST_RETRY_S = 0.1
_MAX_RETRY_S = 1.0



@dataclass(slots=True)
class _Probe:
    task: asyncio.Task[None]
    waiters: int = 0


class RedisRecovery:
    """Waits for Redis servers to answer again: one PING in flight per server, with capped,
    jittered backoff, however many readers wait for it; a probe nobody waits for stops."""

    def __init__(self) -> None:
        self._probes: dict[int, _Probe] = {}

    async def answered(self, clients: Sequence[aioredis.Redis]) -> None:
        """When each of `clients` has answered a PING sent after this call began."""
        await asyncio.gather(*(self._answered(client) for client in clients))

    async def _answered(self, client: aioredis.Redis) -> None:
        key = id(client)
        probe = self._probes.get(key)
        if probe is None or probe.task.done():
            # One line per outage and server, not one per reader (10,000 of them at once).
            log.warning("Redis at %s unreachable under open streams: they wait for it to answer "
                        "(CARPOOL_STREAM_OUTAGE_S)", _address(client))

            def waiters() -> int:
                return self._probes[key].waiters

            probe = self._probes[key] = _Probe(asyncio.create_task(
                _ping_until_answered(client, waiters)))
        probe.waiters += 1
        try:
            await asyncio.shield(probe.task)
        finally:
            probe.waiters -= 1
            if probe.waiters == 0 and not probe.task.done():
                probe.task.cancel()


def _address(client: aioredis.Redis) -> str:
    kwargs = client.connection_pool.connection_kwargs
    return f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"


async def _ping_until_answered(client: aioredis.Redis, waiting: Callable[[], int]) -> None:
    delay_s = _FIRST_RETRY_S
    while True:
        try:
            await client.ping()
            log.warning("Redis at %s answers again: %d open streams resume", _address(client),
                        waiting())
            return
        except REDIS_UNREACHABLE:
            await asyncio.sleep(delay_s * random.uniform(0.5, 1.0))
            delay_s = min(2 * delay_s, _MAX_RETRY_S)


async def follow_through_outages(stream: JobStream, grace_s: float, recovery: RedisRecovery,
                                 after_id: str = STREAM_START, fresh_since: float | None = None,
                                 tick_s: float = 1.0) -> AsyncGenerator[StreamEvent | None, None]:
    """`stream.follow(after_id, fresh_since)`, resumed after its last event whenever Redis fails
    it, until Redis has failed it for `grace_s` without a successful call between (0: the first
    failure is raised). Yields None while it waits, as `follow` does while a job is quiet: at
    least every `tick_s` (the route's keep-alive interval; a wake-up per reader costs the event
    loop, with 10,000 of them)."""
    last_id = after_id
    failing_since: float | None = None
    delay_s = _FIRST_RETRY_S
    while True:
        try:
            async with aclosing(stream.follow(last_id, fresh_since)) as events:
                async for event in events:
                    # Each item follows a call that Redis answered (a None: a wait that ended
                    # with a read of the job's state).
                    failing_since, delay_s = None, _FIRST_RETRY_S
                    if event is not None:
                        last_id = event.entry_id
                    yield event
            return
        except REDIS_UNREACHABLE as exc:
            now = time.monotonic()
            if failing_since is None:
                failing_since = now
                if grace_s > 0:
                    log.debug("job %s: Redis lost while streaming (%s); resuming after %s once "
                              "it answers, for %g s", stream.job_id, exc, last_id, grace_s)
            if now - failing_since >= grace_s:
                raise
            last_error = exc
        deadline = failing_since + grace_s
        # What the caller saw of the job (nothing generated yet) may be stale now: the hub reads
        # the stream at once rather than waiting for notifications the outage may have taken.
        fresh_since = None
        yield None  # (keep-alives; a client that left is noticed)
        # A pause before each try, so that a Redis that answers PING but fails the reads (its
        # append-only file still loading) is not asked in a tight loop...
        await asyncio.sleep(min(delay_s * random.uniform(0.5, 1.0),
                                max(0.0, deadline - time.monotonic())))
        delay_s = min(2 * delay_s, _MAX_RETRY_S)
        # ...then until every server the stream needs answers.
        answered = asyncio.ensure_future(recovery.answered(stream.redis_clients()))
        try:
            while not answered.done():
                remaining_s = deadline - time.monotonic()
                if remaining_s <= 0:
                    raise last_error
                await asyncio.wait({answered}, timeout=min(tick_s, remaining_s))
                if not answered.done():
                    yield None
            answered.result()
        finally:
            answered.cancel()
