"""Webhook deliveries the dispatcher gave up on: GET /v1/webhooks/dead-letters (the caller's)."""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, Field

from api.auth import caller_owner
from api.context import AppContext, get_context
from api.job_schemas import ErrorDetail
from protocol.webhook_events import DeadLetter

router = APIRouter(prefix="/v1/webhooks", tags=["webhooks"], dependencies=[Depends(caller_owner)])

Owner = Annotated[str, Depends(caller_owner)]
Context = Annotated[AppContext, Depends(get_context)]
# Dead letters scanned per request at most (the stream is capped near 10,000, all owners').
SCAN_LIMIT = 1000


class DeadLetterView(BaseModel):
    webhook_id: str = Field(description="The webhook-id header every attempt carried.")
    type: str = Field(description="The event type, e.g. job.completed.")
    url: str = Field(description="Where it was to be delivered.")
    data: dict[str, Any] = Field(description="The event's data (as POSTed).")
    attempts: int = Field(description="Deliveries tried.")
    status_code: int | None = Field(description="The last answer's HTTP status; null: none "
                                                "(timeout, connection refused, URL refused).")
    error: str = Field(description="Why the last attempt failed.")
    created_at: float = Field(description="When the event happened (seconds since the epoch).")
    dead_at: float = Field(description="When it was given up on.")


class DeadLetterList(BaseModel):
    object: str = Field(default="list", description="Always 'list'.")
    data: list[DeadLetterView] = Field(description="Newest first.")


@router.get("/dead-letters", response_model=DeadLetterList,
            summary="Your webhook events that could not be delivered",
            responses={401: {"model": ErrorDetail, "description": "Missing or wrong API key."},
                       503: {"model": ErrorDetail, "description": "Redis is unreachable."}})
async def dead_letters(owner: Owner, ctx: Context,
                       limit: Annotated[int, Query(ge=1, le=100, description="Most to list.")] = 20,
                       ) -> DeadLetterList:
    entries = await ctx.aio.xrevrange(ctx.keys.webhook_dead_letters(), count=SCAN_LIMIT)
    views: list[DeadLetterView] = []
    for _entry_id, fields in entries or []:
        if not fields:
            continue
        letter = DeadLetter.from_fields(fields)
        if letter.owner != owner:
            continue
        views.append(DeadLetterView(
            webhook_id=letter.webhook_id, type=letter.type, url=letter.url,
            data=json.loads(letter.data), attempts=letter.attempts,
            status_code=letter.status_code or None, error=letter.error, created_at=letter.at,
            dead_at=letter.dead_at))
        if len(views) == limit:
            break
    return DeadLetterList(data=views)
