"""owner_pages.index_page: an owner's objects a page at a time, in either order, after a cursor,
filtered, expired ones dropped from the index, reading a window of the index rather than all of
it, and going on past a window's last id that another request removed meanwhile."""

from __future__ import annotations

from typing import Any

import fakeredis
import pytest

from api.owner_pages import index_page

pytestmark = pytest.mark.anyio

INDEX = "owner:index"


class ReplySizes(fakeredis.FakeAsyncRedis):
    """Records the length of every list Redis answers, to see how much of the index a page read."""
    longest_reply = 0

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        reply = await super().execute_command(*args, **options)
        if isinstance(reply, list):
            ReplySizes.longest_reply = max(ReplySizes.longest_reply, len(reply))
        return reply


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _index(count: int) -> ReplySizes:
    aio = ReplySizes(server=fakeredis.FakeServer(), decode_responses=True)
    # Ids o0000.. made one after another, scored by their creation time.
    await aio.zadd(INDEX, {f"o{n:04d}": 1_700_000_000 + n / 1000 for n in range(count)})
    return aio


async def _load_all(object_ids: list[str]) -> list[str | None]:
    return list(object_ids)


async def _walk(aio: ReplySizes, limit: int, order: str = "desc",
                **options: Any) -> list[tuple[list[str], bool]]:
    """Every page, each started after the last one's last object, as a client pages."""
    pages: list[tuple[list[str], bool]] = []
    after = None
    while True:
        found, has_more = await index_page(aio, INDEX, after, limit, options.pop(
            "load_many", _load_all), order=order, **options)  # type: ignore[arg-type]
        pages.append((found, has_more))
        if not has_more:
            return pages
        after = found[-1]


async def test_pages_newest_first_then_oldest_first() -> None:
    aio = await _index(7)
    assert await _walk(aio, 3) == [(["o0006", "o0005", "o0004"], True),
                                   (["o0003", "o0002", "o0001"], True), (["o0000"], False)]
    assert await _walk(aio, 3, order="asc") == [(["o0000", "o0001", "o0002"], True),
                                                (["o0003", "o0004", "o0005"], True),
                                                (["o0006"], False)]
    assert await _walk(aio, 7) == [([f"o{n:04d}" for n in range(6, -1, -1)], False)]


async def test_an_after_no_longer_indexed_gives_an_empty_page() -> None:
    aio = await _index(4)
    assert await index_page(aio, INDEX, "o9999", 2, _load_all) == ([], False)


async def test_a_filter_reads_on_until_the_page_is_full() -> None:
    aio = await _index(40)

    async def load_many(object_ids: list[str]) -> list[int | None]:
        return [int(object_id[1:]) for object_id in object_ids]

    found, has_more = await index_page(aio, INDEX, "o0030", 4, load_many,
                                       keep=lambda n: n % 7 == 0, scan_batch=3)
    assert (found, has_more) == ([28, 21, 14, 7], True)
    found, has_more = await index_page(aio, INDEX, "o0007", 4, load_many,
                                       keep=lambda n: n % 7 == 0, scan_batch=3)
    assert (found, has_more) == ([0], False)


async def test_expired_objects_are_skipped_and_leave_the_index() -> None:
    aio = await _index(6)
    expired = {"o0004", "o0001"}

    async def load_many(object_ids: list[str]) -> list[str | None]:
        return [None if object_id in expired else object_id for object_id in object_ids]

    assert await index_page(aio, INDEX, None, 3, load_many) == (["o0005", "o0003", "o0002"], True)
    # The page read one past itself to know more follow, meeting o0001 too.
    assert await aio.zrange(INDEX, 0, -1) == ["o0000", "o0002", "o0003", "o0005"]
    assert await index_page(aio, INDEX, "o0002", 3, load_many) == (["o0000"], False)


async def test_a_page_reads_a_window_of_a_large_index() -> None:
    aio = await _index(5000)
    ReplySizes.longest_reply = 0
    found, has_more = await index_page(aio, INDEX, "o2500", 10, _load_all, order="asc")
    assert (found, has_more) == ([f"o{n:04d}" for n in range(2501, 2511)], True)
    # The page's ids and their scores, one past the page: not the 5,000 ids of the index.
    assert ReplySizes.longest_reply == 2 * 11


async def test_a_window_whose_last_id_was_removed_meanwhile_goes_on_after_it() -> None:
    """Another request drops the window's last id (expired, or deleted) before the next window
    is read: the page finds its place again by that id's score, skipping and repeating nothing."""
    aio = await _index(20)

    async def load_many(object_ids: list[str]) -> list[str | None]:
        await aio.zrem(INDEX, object_ids[-1])
        return list(object_ids)

    for order, expected in (("desc", ["o0016", "o0012", "o0008"]),
                            ("asc", ["o0000", "o0004", "o0008"])):
        await aio.zadd(INDEX, {f"o{n:04d}": 1_700_000_000 + n / 1000 for n in range(20)})
        found, has_more = await index_page(aio, INDEX, None, 3, load_many,
                                           keep=lambda object_id: int(object_id[1:]) % 4 == 0,
                                           order=order)  # type: ignore[arg-type]
        assert (found, has_more) == (expected, True), order
