"""OpenAI's Conversations API: a conversation and its items, which a response naming it
(`conversation` on POST /v1/responses) reads before its input and adds its input and output to
once it ends (api/conversation_turns.py; a background response's turn joins before the items
are read: api/responses_background.py). Each belongs to the API key that created it."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path

from api.auth import caller_owner
from api.context import AppContext, get_context
from api.conversations_schemas import (
    ConversationCreateRequest,
    ConversationObject,
    ConversationUpdateRequest,
    DeletedConversation,
    ItemsCreateRequest,
)
from api.errors import OPENAI_TAG
from api.item_pages import After, ItemList, Limit, Order, item_page
from api.openai_schemas import openai_error_docs
from api.owner_pages import list_object
from api.responses_background import settle_pending_turns
from api.responses_conversation import with_ids

router = APIRouter(prefix="/v1", tags=[OPENAI_TAG], dependencies=[Depends(caller_owner)])

Owner = Annotated[str, Depends(caller_owner)]
Context = Annotated[AppContext, Depends(get_context)]
ConversationId = Annotated[str, Path(description="The conversation's id (conv_...).")]
ItemId = Annotated[str, Path(description="The item's id.")]

_NOT_FOUND = openai_error_docs((401, "Missing or wrong API key."),
                               (404, "No conversation of that id (or another key's), or no item "
                                     "of that id in it."))
_BAD_OR_NOT_FOUND = {**_NOT_FOUND, **openai_error_docs(
    (400, "Invalid request (the message names the field)."))}


@router.post("/conversations", response_model=ConversationObject,
             summary="Create a conversation (OpenAI)",
             responses=openai_error_docs((400, "Invalid request (the message names the field)."),
                                         (401, "Missing or wrong API key.")))
async def create_conversation(body: ConversationCreateRequest, owner: Owner,
                              ctx: Context) -> ConversationObject:
    conversation = await ctx.conversations.create(owner, body.metadata or {},
                                                  with_ids(body.items or []))
    return ConversationObject(**conversation.as_object())


@router.get("/conversations/{conversation_id}", response_model=ConversationObject,
            summary="A conversation (OpenAI)", responses=_NOT_FOUND)
async def get_conversation(conversation_id: ConversationId, owner: Owner,
                           ctx: Context) -> ConversationObject:
    conversation = await ctx.conversations.get(conversation_id, owner)
    return ConversationObject(**conversation.as_object())


@router.post("/conversations/{conversation_id}", response_model=ConversationObject,
             summary="Update a conversation's metadata (OpenAI)", responses=_BAD_OR_NOT_FOUND)
async def update_conversation(conversation_id: ConversationId, body: ConversationUpdateRequest,
                              owner: Owner, ctx: Context) -> ConversationObject:
    conversation = await ctx.conversations.get(conversation_id, owner)
    updated = await ctx.conversations.set_metadata(conversation, body.metadata or {})
    return ConversationObject(**updated.as_object())


@router.delete("/conversations/{conversation_id}", response_model=DeletedConversation,
               summary="Delete a conversation and its items (OpenAI)", responses=_NOT_FOUND)
async def delete_conversation(conversation_id: ConversationId, owner: Owner,
                              ctx: Context) -> DeletedConversation:
    await ctx.conversations.delete(await ctx.conversations.get(conversation_id, owner))
    return DeletedConversation(id=conversation_id, object="conversation.deleted", deleted=True)


@router.post("/conversations/{conversation_id}/items", response_model=ItemList,
             summary="Add items to a conversation (OpenAI)", responses=_BAD_OR_NOT_FOUND)
async def add_items(conversation_id: ConversationId, body: ItemsCreateRequest, owner: Owner,
                    ctx: Context) -> ItemList:
    conversation = await ctx.conversations.get(conversation_id, owner)
    items = with_ids(body.items)
    await ctx.conversations.add(conversation, items)
    return ItemList(**list_object(items, False))


@router.get("/conversations/{conversation_id}/items", response_model=ItemList,
            summary="A conversation's items (OpenAI)", responses=_BAD_OR_NOT_FOUND)
async def list_items(conversation_id: ConversationId, owner: Owner, ctx: Context,
                     limit: Limit = 20, order: Order = "desc",
                     after: After = None) -> ItemList:
    conversation = await ctx.conversations.get(conversation_id, owner)
    await settle_pending_turns(ctx, conversation)
    items = await ctx.conversations.items(conversation)
    return item_page(items, order, after, limit, f"conversation '{conversation_id}'")


@router.get("/conversations/{conversation_id}/items/{item_id}", summary="One item (OpenAI)",
            responses={**_NOT_FOUND, 200: {"description": "The item: a message, a function call "
                                                          "or a function call's output."}})
async def get_item(conversation_id: ConversationId, item_id: ItemId, owner: Owner,
                   ctx: Context) -> dict[str, object]:
    conversation = await ctx.conversations.get(conversation_id, owner)
    await settle_pending_turns(ctx, conversation)
    return await ctx.conversations.item(conversation, item_id)


@router.delete("/conversations/{conversation_id}/items/{item_id}",
               response_model=ConversationObject, summary="Delete an item (OpenAI)",
               responses=_NOT_FOUND)
async def delete_item(conversation_id: ConversationId, item_id: ItemId, owner: Owner,
                      ctx: Context) -> ConversationObject:
    conversation = await ctx.conversations.get(conversation_id, owner)
    await ctx.conversations.delete_item(conversation, item_id)
    return ConversationObject(**conversation.as_object())
