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
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing

import redis.exceptions

from api.job_stream import JobStream, StreamEvent
from protocol.stream_ids import STREAM_START

log = logging.getLogger(__name__)

_FIRST_RETRY_S = 0.1
# Many readers retry at once after an outage: the cap and the jitter spread their reconnects.
_MAX_RETRY_S = 1.0

REDIS_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


async def follow_through_outages(stream: JobStream, grace_s: float, after_id: str = STREAM_START,
                                 fresh_since: float | None = None,
                                 ) -> AsyncGenerator[StreamEvent | None, None]:
    """`stream.follow(after_id, fresh_since)`, resumed after its last event whenever Redis fails
    it, until Redis has failed it for `grace_s` without a successful call between (0: the first
    failure is raised). Yields None while it waits, as `follow` does while a job is quiet."""
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
        except REDIS_ERRORS as exc:
            now = time.monotonic()
            if failing_since is None:
                failing_since = now
                if grace_s > 0:
                    log.warning("job %s: Redis lost while streaming (%s); resuming after %s "
                                "once it answers, for %g s", stream.job_id, exc, last_id, grace_s)
            if now - failing_since >= grace_s:
                raise
        # What the caller saw of the job (nothing generated yet) may be stale now: the hub reads
        # the stream at once rather than waiting for notifications the outage may have taken.
        fresh_since = None
        yield None  # (keep-alives; a client that left is noticed)
        await asyncio.sleep(min(delay_s * random.uniform(0.5, 1.0),
                                max(0.0, failing_since + grace_s - time.monotonic())))
        delay_s = min(2 * delay_s, _MAX_RETRY_S)
