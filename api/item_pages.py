"""A page of a list of items as OpenAI lists them (a stored response's input items, a
conversation's items): in `order`, after the item `after`, `limit` at a time, with `has_more`.
The whole list is in hand: these lists are the chats a model reads, not an owner's objects
(api/owner_pages.py pages those from an index)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import Query
from pydantic import BaseModel, Field

from api.errors import InvalidRequestError
from api.owner_pages import list_object

Limit = Annotated[int, Query(ge=1, le=100, description="Items per page.")]
Order = Annotated[Literal["asc", "desc"], Query(
    description="desc (newest first, OpenAI's default) or asc.")]
After = Annotated[str | None, Query(description="List the items after this item id.")]


class ItemList(BaseModel):
    object: Literal["list"] = Field("list", description="The kind of object.")
    data: list[dict[str, Any]] = Field(description="The items, each with its id.")
    first_id: str | None = Field(description="The first item's id on this page.")
    last_id: str | None = Field(description="The last item's id on this page.")
    has_more: bool = Field(description="Whether more items follow (pass last_id as after).")


def item_page(items: list[dict[str, Any]], order: str, after: str | None, limit: int,
              of: str) -> ItemList:
    """The page of `items` (oldest first) a listing asks for; a 400 when `after` names no item
    (`of`: whose items, for that message)."""
    if order == "desc":
        items = items[::-1]
    if after is not None:
        position = next((i for i, item in enumerate(items) if item["id"] == after), None)
        if position is None:
            raise InvalidRequestError(f"'after' names no item of {of} (got {after!r})",
                                      param="after", location="query")
        items = items[position + 1:]
    return ItemList(**list_object(items[:limit], len(items) > limit))
