"""A response's turn in a conversation (`conversation` on POST /v1/responses): the conversation's
items are the chat before the response's input, and once the response ends, completed or
incomplete (cut by max_output_tokens), its input items and output items join the conversation,
once (api/conversations_store.py `add_once`). A response that failed or was cancelled adds
nothing, so the conversation holds only turns that were answered."""

from __future__ import annotations

from typing import Any

from api.context import AppContext
from api.conversations_store import Conversation
from api.responses_conversation import chat_messages
from api.responses_schemas import normalized_item

_ADDED_WHEN = ("completed", "incomplete")


async def conversation_history(ctx: AppContext, conversation: Conversation) -> list[dict[str, Any]]:
    """The conversation's items as chat messages."""
    items = await ctx.conversations.items(conversation)
    return chat_messages([normalized_item(item, f"conversation item {number}")
                          for number, item in enumerate(items)])


async def add_turn(ctx: AppContext, conversation_id: str | None,
                   input_items: list[dict[str, Any]], response: dict[str, Any]) -> None:
    """Add an ended response's input and output to its conversation (none: nothing to do)."""
    if conversation_id is not None and response["status"] in _ADDED_WHEN:
        await ctx.conversations.add_once(conversation_id, response["id"],
                                         input_items + response["output"])
