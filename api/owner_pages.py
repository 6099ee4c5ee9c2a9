"""Pages of an owner's objects (files, batches, stored chat completions) as OpenAI lists them:
newest first (or oldest first), after the id `after`, `limit` at a time, with `has_more`. The ids
sit in a sorted set scored by creation time; an id whose object expired is dropped from it as a
page meets it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar

import redis.asyncio as aioredis

T = TypeVar("T")


async def index_page(aio: aioredis.Redis, index_key: str, after: str | None, limit: int,
                     load_many: Callable[[list[str]], Awaitable[list[T | None]]],
                     keep: Callable[[T], bool] = lambda _: True,
                     order: Literal["asc", "desc"] = "desc",
                     scan_batch: int = 1) -> tuple[list[T], bool]:
    """Up to `limit` objects `load_many` finds (None: expired) and `keep` wants, in `order` of
    creation (desc: newest first), and whether more follow. Objects load a batch at a time: the
    page's worth first, then (while `keep` turns some down) what is still missing, at least
    `scan_batch` (a loader that reads many in one request wants more at once)."""
    ids = [str(i) for i in await aio.zrange(index_key, 0, -1, desc=order == "desc")]
    if after is not None:
        ids = ids[ids.index(after) + 1:] if after in ids else []
    found: list[T] = []
    gone: list[str] = []
    start, batch = 0, limit + 1  # one past the page: whether more follow
    while start < len(ids) and len(found) <= limit:
        chunk = ids[start:start + batch]
        for object_id, item in zip(chunk, await load_many(chunk), strict=True):
            if item is None:
                gone.append(object_id)
            elif keep(item):
                found.append(item)
        start, batch = start + len(chunk), max(limit + 1 - len(found), scan_batch)
    if gone:
        await aio.zrem(index_key, *gone)
    return found[:limit], len(found) > limit


def one_by_one(load: Callable[[str], Awaitable[T | None]],
               ) -> Callable[[list[str]], Awaitable[list[T | None]]]:
    """index_page's loader for objects read one at a time."""
    async def load_many(object_ids: list[str]) -> list[T | None]:
        return [await load(object_id) for object_id in object_ids]
    return load_many


def list_object(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """OpenAI's list envelope."""
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}
