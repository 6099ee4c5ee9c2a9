"""Where a job's token stream lives: one of several Redis servers, chosen by its job id.

Jobs per second are few and tokens per second are many, so the queue, job records and leases stay
on the main Redis while the token streams (the per-token traffic) can be spread over a list of
stream shards (`CARPOOL_STREAM_REDIS_URLS`). A job's stream, the fence copy that guards it and its
end marker all live on the shard `stream_shard(job_id, n)` picks; an empty list means one shard,
the main Redis itself, and everything stays as it was (one server, one script per transition).

The hash is CRC-32 of the job id, the same in every process and release: a job's readers and
writers find its stream without asking anyone. Changing the list moves streams of live jobs, so
it changes only with the fleet stopped (or drained).
"""

from __future__ import annotations

import zlib


def stream_shard(job_id: str, num_shards: int) -> int:
    """Index into the shard list of the server holding `job_id`'s stream."""
    if num_shards <= 1:
        return 0
    return zlib.crc32(job_id.encode()) % num_shards


def parse_shard_urls(value: object) -> object:
    """CARPOOL_STREAM_REDIS_URLS as both the API's and the worker's settings read it: a
    comma-separated string becomes its list of URLs (blanks dropped); anything else is left to
    the settings' own validation."""
    if isinstance(value, str):
        return [url.strip() for url in value.split(",") if url.strip()]
    return value


def shard_urls(main_url: str, stream_urls: list[str]) -> list[str]:
    """The stream shards' URLs: the main Redis alone when none are listed."""
    return list(stream_urls) or [main_url]
