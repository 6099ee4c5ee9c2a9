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
                     load: Callable[[str], Awaitable[T | None]],
                     keep: Callable[[T], bool] = lambda _: True,
                     order: Literal["asc", "desc"] = "desc") -> tuple[list[T], bool]:
    """Up to `limit` objects `load` finds (None: expired) and `keep` wants, in `order` of
    creation (desc: newest first), and whether more follow."""
    ids = [str(i) for i in await aio.zrange(index_key, 0, -1, desc=order == "desc")]
    if after is not None:
        ids = ids[ids.index(after) + 1:] if after in ids else []
    found: list[T] = []
    gone: list[str] = []
    for object_id in ids:
        item = await load(object_id)
        if item is None:
            gone.append(object_id)
        elif keep(item):
            found.append(item)
            if len(found) > limit:  # one past the page: more follow
                break
    if gone:
        await aio.zrem(index_key, *gone)
    return found[:limit], len(found) > limit


def list_object(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """OpenAI's list envelope."""
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}
