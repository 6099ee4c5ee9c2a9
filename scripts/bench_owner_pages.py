"""What one page of an owner's listing (files, batches, stored chat completions: api/owner_pages.py)
costs as the owner keeps more objects: Redis CPU (INFO cpu) and wall time per page, for the first
page and for a page deep in the index (after the middle object), on a private redis-server.

Each object is a small JSON record read with one MGET a batch, as the stored chat completions'
listing reads them. Run it at two commits to compare (copy it into the other checkout).

    python scripts/bench_owner_pages.py
    python scripts/bench_owner_pages.py --objects 1000,100000 --pages 200 --limit 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis.asyncio as aioredis  # noqa: E402
from bench_fleet import _start_redis, redis_cpu_seconds  # noqa: E402
from redis import Redis  # noqa: E402

from api.owner_pages import index_page  # noqa: E402

INDEX = "bench:owner:index"


def _record_key(object_id: str) -> str:
    return f"bench:object:{object_id}"


def _fill(redis: Redis, count: int) -> list[str]:
    redis.flushall()
    ids = [f"chatcmpl-{n:08d}" for n in range(count)]
    start = time.time()
    for at in range(0, count, 5000):
        chunk = ids[at:at + 5000]
        with redis.pipeline(transaction=False) as pipe:
            pipe.zadd(INDEX, {object_id: start + n * 1e-6 for n, object_id in enumerate(chunk, at)})
            pipe.mset({_record_key(object_id): json.dumps({"id": object_id, "model": "m"})
                       for object_id in chunk})
            pipe.execute()
    return ids


async def _pages(url: str, after: str | None, pages: int, limit: int) -> float:
    aio = aioredis.Redis.from_url(url, decode_responses=True)

    async def load_many(object_ids: list[str]) -> list[dict[str, str] | None]:
        records = await aio.mget([_record_key(object_id) for object_id in object_ids])
        return [json.loads(record) if record else None for record in records]

    started = time.perf_counter()
    for _ in range(pages):
        found, _ = await index_page(aio, INDEX, after, limit, load_many, order="asc")
        assert len(found) == limit
    elapsed = time.perf_counter() - started
    await aio.aclose()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--objects", default="1000,10000,100000",
                        help="owners' object counts to measure, comma-separated")
    parser.add_argument("--pages", type=int, default=200, help="pages read per measurement")
    parser.add_argument("--limit", type=int, default=20, help="objects a page")
    args = parser.parse_args()
    process, url = _start_redis()
    try:
        redis = Redis.from_url(url)
        print(f"{'objects':>8} {'page':>6} {'Redis us/page':>14} {'wall ms/page':>13}")
        for count in (int(value) for value in args.objects.split(",")):
            ids = _fill(redis, count)
            for name, after in (("first", None), ("middle", ids[count // 2])):
                cpu = redis_cpu_seconds(redis)
                elapsed = asyncio.run(_pages(url, after, args.pages, args.limit))
                cpu = redis_cpu_seconds(redis) - cpu
                print(f"{count:>8} {name:>6} {cpu / args.pages * 1e6:>14.1f} "
                      f"{elapsed / args.pages * 1e3:>13.2f}")
    finally:
        process.terminate()
        process.wait()


if __name__ == "__main__":
    main()
