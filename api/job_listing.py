"""JobListing: one API key's jobs, newest first, a page at a time, optionally of one status.

The index is the owner's sorted set (`Keys.jobs_by_owner`: job id -> created_at), written in the
enqueue's transaction. A page starts after a cursor job (its rank is looked up again on every
request, so jobs submitted meanwhile neither repeat nor shift the page) and reads the states of
a bounded window of ids; ids whose state has expired (retention) are dropped from the index as
they are met.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import redis.asyncio as aioredis

from api.errors import InvalidRequestError
from protocol import JobState, JobStatus, Keys

# Ids read per round trip, and at most per request when a status filter skips most of them (the
# page then ends early, with has_more and a cursor to go on from).
_CHUNK = 100
_MAX_SCANNED = 1000


@dataclass(frozen=True, slots=True)
class JobPage:
    jobs: list[JobState]
    has_more: bool
    last_scanned: str | None  # the cursor for the next page (`after`)


class JobListing:
    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self._redis = redis
        self._keys = keys

    async def page(self, owner: str, limit: int, after: str | None = None,
                   status: JobStatus | None = None) -> JobPage:
        index = self._keys.jobs_by_owner(owner)
        start = 0
        if after is not None:
            rank = await self._redis.zrevrank(index, after)
            if rank is None:
                raise InvalidRequestError(f"'after' must be the id of one of your jobs still kept "
                                          f"(got {after!r})", param="after", location="query")
            start = cast(int, rank) + 1
        jobs: list[JobState] = []
        scanned: str | None = None
        num_scanned = 0
        while len(jobs) < limit and num_scanned < _MAX_SCANNED:
            window = await self._redis.zrevrange(index, start, start + _CHUNK - 1)
            ids = [_text(cast("bytes | str", member)) for member in window]
            if not ids:
                break
            async with self._redis.pipeline(transaction=False) as pipe:
                for job_id in ids:
                    pipe.hgetall(self._keys.state(job_id))
                states = await pipe.execute()
            gone = []
            for job_id, fields in zip(ids, states):
                start += 1
                num_scanned += 1
                if not fields:
                    gone.append(job_id)
                    continue
                state = JobState.from_fields(fields)
                scanned = job_id
                if status is None or state.status is status:
                    jobs.append(state)
                    if len(jobs) == limit:
                        break
            if gone:
                await self._redis.zrem(index, *gone)
                start -= len(gone)  # the ranks after them moved up
        has_more = await self._redis.zcard(index) > start
        return JobPage(jobs, has_more=has_more, last_scanned=scanned)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
