"""Pages of an owner's objects (files, batches, stored chat completions) as OpenAI lists them:
newest first (or oldest first), after the id `after`, `limit` at a time, with `has_more`. The ids
sit in a sorted set scored by creation time; a page reads the index a window at a time from its
cursor, so its cost follows the page, not how many objects the owner keeps. An id whose object
expired is dropped from the index as a page meets it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar

import redis.asyncio as aioredis

T = TypeVar("T")

# The ids that follow a cursor id in the index, with their scores, in one step so that ids added
# or removed meanwhile cannot shift the window. A cursor that has left the index (another page
# dropped it as expired, or it was deleted) is found again by its score when the caller knows it.
# KEYS[1] index; ARGV: cursor id ('' for the start), its score ('' when unknown), how many,
# '1' for newest first. Returns false when the cursor is gone and no score places it.
_IDS_AFTER = """
local desc = ARGV[4] == '1'
local start = 0
if ARGV[1] ~= '' then
  local rank = redis.call(desc and 'ZREVRANK' or 'ZRANK', KEYS[1], ARGV[1])
  if rank then
    start = rank + 1
  elseif ARGV[2] ~= '' then
    if desc then
      start = redis.call('ZCOUNT', KEYS[1], ARGV[2], '+inf')
    else
      start = redis.call('ZCOUNT', KEYS[1], '-inf', ARGV[2])
    end
  else
    return false
  end
end
local stop = start + tonumber(ARGV[3]) - 1
if desc then
  return redis.call('ZREVRANGE', KEYS[1], start, stop, 'WITHSCORES')
end
return redis.call('ZRANGE', KEYS[1], start, stop, 'WITHSCORES')
"""


async def index_page(aio: aioredis.Redis, index_key: str, after: str | None, limit: int,
                     load_many: Callable[[list[str]], Awaitable[list[T | None]]],
                     keep: Callable[[T], bool] = lambda _: True,
                     order: Literal["asc", "desc"] = "desc",
                     scan_batch: int = 1) -> tuple[list[T], bool]:
    """Up to `limit` objects `load_many` finds (None: expired) and `keep` wants, in `order` of
    creation (desc: newest first), and whether more follow. Objects load a batch at a time: the
    page's worth first, then (while `keep` turns some down) what is still missing, at least
    `scan_batch` (a loader that reads many in one request wants more at once). An `after` no
    longer in the index gives an empty page."""
    ids_after = aio.register_script(_IDS_AFTER)
    cursor, cursor_score = after or "", ""
    found: list[T] = []
    gone: list[str] = []
    batch = limit + 1  # one past the page: whether more follow
    while len(found) <= limit:
        window = await ids_after(keys=[index_key], args=[
            cursor, cursor_score, batch, "1" if order == "desc" else "0"])
        if not window:
            break
        chunk = [_text(member) for member in window[0::2]]
        for object_id, item in zip(chunk, await load_many(chunk), strict=True):
            if item is None:
                gone.append(object_id)
            elif keep(item):
                found.append(item)
        cursor, cursor_score = chunk[-1], _text(window[-1])
        batch = max(limit + 1 - len(found), scan_batch)
    if gone:
        await aio.zrem(index_key, *gone)
    return found[:limit], len(found) > limit


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


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
