"""OpenAI Batch API: create, retrieve, list and cancel batches. The routes only write and read
batch objects; the BatchRunner (api/batch_runner.py) advances them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Path, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from api.auth import caller_owner
from api.batch_files import BATCH_ENDPOINTS
from api.batch_store import BatchStatus
from api.context import AppContext, get_context
from api.errors import OPENAI_TAG, ConflictError, InvalidRequestError, NotFoundError
from api.fields import Metadata, WebhookUrl
from api.openai_schemas import openai_error_docs
from api.owner_pages import list_object
from api.webhook_urls import checked_webhook_url, webhook_url_of

router = APIRouter(prefix="/v1", tags=[OPENAI_TAG], dependencies=[Depends(caller_owner)])

# OpenAI's error shape on every failure, documented per route (the fuzz suite holds them to it).
_ERRORS = openai_error_docs(
    (400, "Invalid request (the message names the field)."), (401, "Missing or wrong API key."),
    (404, "No such batch or input file (or not yours)."),
    (409, "The batch already ended or is being cancelled."),
    (503, "Redis unreachable (see Retry-After)."))

Owner = Annotated[str, Depends(caller_owner)]
Context = Annotated[AppContext, Depends(get_context)]
BatchId = Annotated[str, Path(max_length=200)]
COMPLETION_WINDOWS = {"24h": 24 * 3600}


class BatchCreateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(description="A file uploaded with purpose 'batch'.")
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/responses"] = Field(
        description="The route every line of the input file calls.")
    completion_window: Literal["24h"] = Field(description="Only '24h', as OpenAI.")
    metadata: Metadata = None
    webhook_url: WebhookUrl = None  # Carpool's extension (or the X-Carpool-Webhook-Url header)
    output_expires_after: dict[str, Any] | None = Field(
        None, description="Accepted for compatibility; output files follow CARPOOL_FILE_RETENTION_S.")


@router.post("/batches", summary="Create a batch from an uploaded input file", responses=_ERRORS)
async def create_batch(body: BatchCreateRequest, owner: Owner, ctx: Context,
                       request: Request) -> dict[str, Any]:
    try:
        file = await ctx.files.get(body.input_file_id, owner)
    except NotFoundError as exc:
        raise NotFoundError(exc.message, param="input_file_id", code=exc.code) from exc
    if file.purpose != "batch":
        raise InvalidRequestError(f"File '{file.id}' has purpose '{file.purpose}'; a batch's input "
                                  f"file needs purpose 'batch'", param="input_file_id")
    assert body.endpoint in BATCH_ENDPOINTS
    # Where the batch's final status is POSTed: checked against the allow-list as a job's is.
    hook = webhook_url_of(body.webhook_url, request.headers)
    webhook_url = ""
    if hook:
        webhook_url = await checked_webhook_url(
            hook["webhook_url"], ctx.settings.webhook_allow_list,
            hook.get("webhook_param", "webhook_url"))
    batch = await ctx.batches.create(owner, body.endpoint, file.id, body.completion_window,
                                     COMPLETION_WINDOWS[body.completion_window], body.metadata,
                                     webhook_url)
    return batch.to_openai()


@router.get("/batches", summary="List batches, newest first", responses=_ERRORS)
async def list_batches(owner: Owner, ctx: Context,
                       after: Annotated[str | None, Query()] = None,
                       limit: Annotated[int, Query(ge=1, le=100)] = 20) -> dict[str, Any]:
    batches, has_more = await ctx.batches.page(owner, limit, after)
    return list_object([batch.to_openai() for batch in batches], has_more)


@router.get("/batches/{batch_id}", summary="A batch", responses=_ERRORS)
async def retrieve_batch(batch_id: BatchId, owner: Owner, ctx: Context) -> dict[str, Any]:
    return (await ctx.batches.get(batch_id, owner)).to_openai()


@router.post("/batches/{batch_id}/cancel", summary="Cancel a batch", responses=_ERRORS)
async def cancel_batch(batch_id: BatchId, owner: Owner, ctx: Context) -> dict[str, Any]:
    """Moves it to `cancelling`; the runner cancels its unfinished jobs, writes the files (what
    finished in the output file, the rest in the error file) and ends it `cancelled`."""
    batch = await ctx.batches.get(batch_id, owner)
    moved = await ctx.batches.transition(
        batch_id, (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS), BatchStatus.CANCELLING)
    batch = await ctx.batches.get(batch_id, owner)
    if not moved and batch.status not in (BatchStatus.CANCELLING, BatchStatus.CANCELLED):
        raise ConflictError(f"Batch '{batch_id}' is {batch.status.value}: only a validating or "
                            f"in-progress batch can be cancelled", param="batch_id",
                            code="batch_not_cancellable")
    return batch.to_openai()
