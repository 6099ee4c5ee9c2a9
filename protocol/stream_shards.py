"""Where a job's token stream lives: one of several Redis servers, the one of the worker that
first started the job.

Jobs per second are few and tokens per second are many, so the queue, job records and leases stay
on the main Redis while the token streams (the per-token traffic) can be spread over a list of
stream shards (`CARPOOL_STREAM_REDIS_URLS`). An empty list means one shard, the main Redis
itself, and everything stays as it was (one server, one script per transition).

Each worker has a shard of its own (its *home*: pinned, or dealt in turn as workers start), and
the claim that first starts a job records the claiming worker's in the job's state
(`JobState.stream_shard`): the job's stream, the fence copy that guards it and its end marker all
live there, for good (a job resumed by another worker stays on it). [redis-cost] So a worker's
step writes one shard, and each shard's cost grows with its own workers' steps only: a step's
transaction and notification cost a shard about as much as the step's tokens, and when every
step wrote every shard (streams spread by a hash of the job id), two shards carried 1.2-1.5x
what one did, not 2x (README, "Stream shards").

Readers find the shard in the state; a job not started yet has none, and its readers wait for
its stream on every shard (api/job_stream.py): the first entries come from its own. A job whose
state records none although it started (started before shards were recorded) is on the shard
`stream_shard(job_id, n)` picks: CRC-32 of the job id, the same in every process and release.
Changing the list moves streams of live jobs, so it changes only with the fleet stopped (or
drained).
"""

from __future__ import annotations

import zlib
from urllib.parse import urlsplit


def stream_shard(job_id: str, num_shards: int) -> int:
    """Index into the shard list of the server holding `job_id`'s stream."""
    if num_shards <= 1:
        return 0
    return zlib.crc32(job_id.encode()) % num_shards


def placed_shard(job_id: str, recorded: int, num_shards: int) -> int:
    """Index of the server holding a started job's stream: the shard its state records, or for
    a job started before shards were recorded (`recorded` < 0), `stream_shard`'s pick."""
    if num_shards <= 1:
        return 0
    return recorded % num_shards if recorded >= 0 else stream_shard(job_id, num_shards)


def started_shard(job_id: str, recorded: int, started_at: float, num_shards: int) -> int | None:
    """A job's stream shard as its state tells it (`recorded`: its `stream_shard`, and its
    `started_at`); None while no worker has started it (the one that does picks the shard)."""
    if recorded < 0 and not started_at:
        return None
    return placed_shard(job_id, recorded, num_shards)


def parse_shard_urls(value: object) -> object:
    """CARPOOL_STREAM_REDIS_URLS as both the API's and the worker's settings read it: a
    comma-separated string becomes its list of URLs (blanks dropped); anything else is left to
    the settings' own validation. ValueError when two name the same server: Pub/Sub spans a
    server's databases, so two shards there would hear each other's step notifications (and a
    reader waiting for a job not started yet could take one for its stream's)."""
    if isinstance(value, str):
        value = [url.strip() for url in value.split(",") if url.strip()]
    if isinstance(value, list):
        servers: dict[tuple[str, int], str] = {}
        for url in value:
            if not isinstance(url, str):
                continue
            parts = urlsplit(url)
            server = (parts.hostname or parts.path, parts.port or 6379)
            if server in servers:
                raise ValueError(f"stream shards {servers[server]!r} and {url!r} are on one Redis "
                                 "server: list one URL per server")
            servers[server] = url
    return value


def shard_urls(main_url: str, stream_urls: list[str]) -> list[str]:
    """The stream shards' URLs: the main Redis alone when none are listed."""
    return list(stream_urls) or [main_url]
