"""OpenAI's stored chat completions: those made with `store: true` on POST /v1/chat/completions
(api/chat_completions_store.py), listed, read, given new metadata and deleted by the API key that
made them, with the messages each was asked with."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.responses import JSONResponse

from api.auth import caller_owner
from api.chat_completions_schemas import (
    ChatCompletionList,
    ChatCompletionUpdateRequest,
    DeletedChatCompletion,
    StoredChatCompletionObject,
)
from api.context import AppContext, get_context
from api.errors import OPENAI_TAG
from api.item_pages import After, ItemList, Limit, item_page
from api.openai_schemas import openai_error_docs
from api.owner_pages import list_object

# A stored completion is answered as it was kept (as the create route answered it), not through
# its documented response model, which would add the fields that route leaves out as nulls.
router = APIRouter(prefix="/v1", tags=[OPENAI_TAG], dependencies=[Depends(caller_owner)])

Owner = Annotated[str, Depends(caller_owner)]
Context = Annotated[AppContext, Depends(get_context)]
CompletionId = Annotated[str, Path(description="The chat completion's id (chatcmpl-...).")]
# Oldest first by default here, as OpenAI lists stored completions and their messages.
Order = Annotated[Literal["asc", "desc"], Query(
    description="asc (oldest first, OpenAI's default here) or desc.")]

_NOT_FOUND = openai_error_docs((401, "Missing or wrong API key."),
                               (404, "No stored chat completion of that id (or another key's)."))
_BAD_OR_NOT_FOUND = {**_NOT_FOUND, **openai_error_docs(
    (400, "Invalid request (the message names the field)."))}
# `metadata[key]=value` query parameters (OpenAI's filter by metadata).
_METADATA_PARAM = re.compile(r"^metadata\[(.+)\]$")


@router.get("/chat/completions", response_model=ChatCompletionList,
            summary="Stored chat completions (OpenAI)",
            description="The caller's chat completions made with store: true. Filter with `model` "
                        "and `metadata[key]=value` (every pair must match).",
            responses=openai_error_docs((400, "Invalid request (the message names the field)."),
                                        (401, "Missing or wrong API key.")))
async def list_chat_completions(request: Request, owner: Owner, ctx: Context,
                                limit: Limit = 20, order: Order = "asc", after: After = None,
                                model: Annotated[str | None, Query(
                                    description="Only completions of this model.")] = None,
                                ) -> JSONResponse:
    metadata = {match.group(1): value for name, value in request.query_params.multi_items()
                if (match := _METADATA_PARAM.match(name))}
    found, has_more = await ctx.chat_completions.page(owner, after=after, limit=limit,
                                                      order=order, model=model, metadata=metadata)
    return JSONResponse(list_object([stored.as_object() for stored in found], has_more))


@router.get("/chat/completions/{completion_id}", response_model=StoredChatCompletionObject,
            summary="A stored chat completion (OpenAI)", responses=_NOT_FOUND)
async def get_chat_completion(completion_id: CompletionId, owner: Owner,
                              ctx: Context) -> JSONResponse:
    stored = await ctx.chat_completions.get(completion_id, owner)
    return JSONResponse(stored.as_object())


@router.post("/chat/completions/{completion_id}", response_model=StoredChatCompletionObject,
             summary="Update a stored chat completion's metadata (OpenAI)",
             responses=_BAD_OR_NOT_FOUND)
async def update_chat_completion(completion_id: CompletionId, body: ChatCompletionUpdateRequest,
                                 owner: Owner, ctx: Context) -> JSONResponse:
    stored = await ctx.chat_completions.get(completion_id, owner)
    updated = await ctx.chat_completions.set_metadata(stored, body.metadata or {})
    return JSONResponse(updated.as_object())


@router.delete("/chat/completions/{completion_id}", response_model=DeletedChatCompletion,
               summary="Delete a stored chat completion (OpenAI)", responses=_NOT_FOUND)
async def delete_chat_completion(completion_id: CompletionId, owner: Owner,
                                 ctx: Context) -> DeletedChatCompletion:
    await ctx.chat_completions.delete(await ctx.chat_completions.get(completion_id, owner))
    return DeletedChatCompletion(id=completion_id, object="chat.completion.deleted", deleted=True)


@router.get("/chat/completions/{completion_id}/messages", response_model=ItemList,
            summary="A stored chat completion's messages (OpenAI)", responses=_BAD_OR_NOT_FOUND)
async def list_chat_completion_messages(completion_id: CompletionId, owner: Owner, ctx: Context,
                                        limit: Limit = 20, order: Order = "asc",
                                        after: After = None) -> ItemList:
    stored = await ctx.chat_completions.get(completion_id, owner)
    return item_page(stored.messages, order, after, limit, f"chat completion '{completion_id}'")
