"""OpenAI Files API, for Batch API input and output: upload (multipart JSONL, purpose `batch`),
retrieve, read content, list, delete. Files live in Redis with a retention TTL (FileStore)."""

from __future__ import annotations

from functools import partial
from typing import Annotated, Any

import anyio.to_thread
from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.responses import Response

from api.auth import caller_owner
from api.batch_files import UPLOAD_PURPOSES, parse_batch_input
from api.context import AppContext, get_context
from api.errors import OPENAI_TAG, InvalidRequestError, PayloadTooLargeError
from api.multipart_form import parse_form
from api.openai_schemas import openai_error_docs
from api.owner_pages import list_object

router = APIRouter(prefix="/v1", tags=[OPENAI_TAG], dependencies=[Depends(caller_owner)])

# OpenAI's error shape on every failure, documented per route (the fuzz suite holds them to it).
_ERRORS = openai_error_docs(
    (400, "Invalid request (the message names the field or the JSONL line)."),
    (401, "Missing or wrong API key."), (404, "No such file (or not yours)."),
    (413, "File over CARPOOL_MAX_FILE_BYTES."), (503, "Redis unreachable (see Retry-After)."))

Owner = Annotated[str, Depends(caller_owner)]
Context = Annotated[AppContext, Depends(get_context)]
FileId = Annotated[str, Path(max_length=200)]


@router.post("/files", summary="Upload a file (purpose 'batch': a Batch API input, JSONL)", responses=_ERRORS)
async def create_file(request: Request, owner: Owner, ctx: Context) -> dict[str, Any]:
    # Parsing a file of tens of MB takes seconds: off the event loop, so other requests go on.
    form = await anyio.to_thread.run_sync(partial(
        parse_form, request.headers.get("content-type", ""), await request.body()))
    purpose = form.get("purpose")
    if purpose is None:
        raise InvalidRequestError("Missing required parameter: 'purpose' (use 'batch')",
                                  param="purpose")
    purpose_name = purpose.value.decode("utf-8", "replace").strip()
    if purpose_name not in UPLOAD_PURPOSES:
        raise InvalidRequestError(f"Invalid value for 'purpose': this server takes "
                                  f"{', '.join(UPLOAD_PURPOSES)} files (got '{purpose_name}')",
                                  param="purpose")
    upload = form.get("file")
    if upload is None or upload.filename is None:
        raise InvalidRequestError("Missing required parameter: 'file' (a file part of the form)",
                                  param="file")
    limit = ctx.settings.max_file_bytes
    if len(upload.value) > limit:
        raise PayloadTooLargeError(f"The file is {len(upload.value)} bytes; the limit is {limit} "
                                   f"bytes (CARPOOL_MAX_FILE_BYTES): split it into smaller files")
    # 400 naming the bad line.
    await anyio.to_thread.run_sync(parse_batch_input, upload.value, ctx.settings.max_batch_lines)
    file = await ctx.files.create(owner, upload.filename or "upload.jsonl", purpose_name,
                                  upload.value.decode("utf-8"))
    return file.to_openai()


@router.get("/files", summary="List files", responses=_ERRORS)
async def list_files(owner: Owner, ctx: Context, purpose: Annotated[str | None, Query()] = None,
                     limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
                     after: Annotated[str | None, Query()] = None) -> dict[str, Any]:
    files, has_more = await ctx.files.page(owner, purpose, limit, after)
    return list_object([file.to_openai() for file in files], has_more)


@router.get("/files/{file_id}", summary="A file's metadata", responses=_ERRORS)
async def retrieve_file(file_id: FileId, owner: Owner, ctx: Context) -> dict[str, Any]:
    return (await ctx.files.get(file_id, owner)).to_openai()


@router.get("/files/{file_id}/content", summary="A file's content", responses=_ERRORS)
async def file_content(file_id: FileId, owner: Owner, ctx: Context) -> Response:
    return Response(await ctx.files.content(file_id, owner), media_type="application/jsonl")


@router.delete("/files/{file_id}", summary="Delete a file", responses=_ERRORS)
async def delete_file(file_id: FileId, owner: Owner, ctx: Context) -> dict[str, Any]:
    await ctx.files.delete(file_id, owner)
    return {"id": file_id, "object": "file", "deleted": True}
