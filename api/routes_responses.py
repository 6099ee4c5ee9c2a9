"""OpenAI's Responses API: POST /v1/responses (whole or streamed), and the stored responses' GET,
DELETE and input_items.

A response is a chat completion underneath: its input (after `instructions`, and after the chat
of the response named by previous_response_id) becomes chat messages, its fields the chat
request's (api/responses_conversation.py), and the one job that runs it is submitted, followed
and canceled as the chat route's are. Only the shapes differ: the answer is a response object,
the stream the Responses events (api/responses_events.py). With `store` (the default) the
response is kept for the server's result retention (api/responses_store.py).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query, Request, Response
from fastapi.responses import JSONResponse

from api.auth import caller_owner
from api.context import AppContext, get_context
from api.deadline_headers import deadlines_of
from api.errors import OPENAI_TAG, InvalidRequestError, validated
from api.idempotency_key import idempotency_key_of
from api.item_pages import After, ItemList, Limit, Order, item_page
from api.openai_answer import logprobs_formatters, wait_for_results
from api.openai_choices import ChoiceJob, cancel_jobs, choice_jobs, job_headers, raise_if_failed
from api.openai_chunks import ChunkWriter
from api.openai_logprobs import LogprobsFormatter
from api.openai_schemas import openai_error_docs
from api.openai_stream import chunk_payloads
from api.responses_background import cancel, history_of, pending, settle
from api.responses_conversation import chat_messages, with_ids
from api.responses_events import ResponseEvents
from api.responses_jobs import (
    input_tokens,
    keep_response,
    message_id_of,
    response_base,
    submit_response,
    whole_response,
)
from api.responses_replay import replay_of, response_events
from api.responses_schemas import (
    DeletedResponse,
    InputTokens,
    InputTokensRequest,
    ResponseObject,
    ResponsesRequest,
)
from api.sse import SSE_KEEPALIVE, EventStreamResponse, typed_event
from api.tool_parsers import ToolParser, get_parser
from api.webhook_urls import webhook_url_of
from protocol.redis_errors import REDIS_UNAVAILABLE

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=[OPENAI_TAG], dependencies=[Depends(caller_owner)])

Owner = Annotated[str, Depends(caller_owner)]
Context = Annotated[AppContext, Depends(get_context)]
ResponseId = Annotated[str, Path(description="The response's id (resp_...).")]

_ERRORS = openai_error_docs(
    (400, "Invalid request (the message names the field)."), (401, "Missing or wrong API key."),
    (404, "No such model, or no stored response of that previous_response_id."),
    (413, "Body over the size limit."), (429, "Queue full (see Retry-After)."),
    (500, "The job failed."), (503, "Redis unreachable or no model registered yet."))
_STREAM_DOC = {"content": {"text/event-stream": {}},
               "description": "With `stream: true`: the Responses events, from response.created to "
                              "response.completed (or .incomplete / .failed)."}
_NOT_FOUND = openai_error_docs((401, "Missing or wrong API key."),
                               (404, "No stored response of that id (or another key's)."))
_GET_ERRORS = {**_NOT_FOUND, **openai_error_docs(
    (400, "stream for a response made without background, or a bad starting_after."))}
_REPLAY_DOC = {"content": {"text/event-stream": {}},
               "description": "With `stream=true`: a background response's events, numbered as "
                              "when it was created with stream."}
_COUNT_ERRORS = openai_error_docs(
    (400, "Invalid request (the message names the field)."), (401, "Missing or wrong API key."),
    (404, "No such model, conversation or stored response of that previous_response_id."),
    (413, "Body over the size limit."), (503, "Redis unreachable, or no tokenizer published yet."))
_CANCEL_ERRORS = {**_NOT_FOUND, **openai_error_docs((400, "Not a background response."))}
_LIST_ERRORS = {**_NOT_FOUND, **openai_error_docs((400, "A bad limit, order or after."))}


@router.post("/responses", response_model=ResponseObject, summary="Create a response (OpenAI)",
             responses={**_ERRORS, 200: _STREAM_DOC})
async def create_response(body: ResponsesRequest, request: Request, owner: Owner,
                          ctx: Context) -> Response:
    submitted = await submit_response(
        ctx, body, owner, await history_of(ctx, body, owner), **deadlines_of(request.headers),
        idempotency_key=idempotency_key_of(request.headers), **webhook_url_of(None, request.headers))
    first = submitted.accepted[0].spec
    headers = job_headers(submitted.accepted)
    base = response_base(body, first.job_id, int(first.created_at), first.model, first.sampling)
    if body.background:  # answered when read (api/responses_background.py), or streamed
        stored = pending(owner, body, first.job_id, base, with_ids(body.input),
                         submitted.history + submitted.given)
        await ctx.responses.save(stored)
        if body.conversation is not None:
            await ctx.conversations.add_pending(body.conversation, stored.response["id"])
        if body.stream:  # no cancel when the client leaves: it runs in the background
            reading, with_logprobs = await replay_of(ctx, stored)
            return EventStreamResponse(response_events(ctx, stored, reading, with_logprobs, None),
                                       headers=headers)
        return JSONResponse(stored.response, headers=headers)
    jobs = choice_jobs(submitted.accepted, 1, [""])
    parser = get_parser(ctx.settings.tool_parser) if submitted.parses_calls else None
    formatters = await logprobs_formatters(ctx, first.model, first.sampling, jobs, True)
    keep = partial(keep_response, ctx, owner, body, submitted.history, submitted.given)
    if body.stream:
        events = ResponseEvents(base, message_id_of(first.job_id), body.wants_logprobs)
        writer = ChunkWriter(is_chat=True, response_id=base["id"], created=base["created_at"],
                             model=first.model, include_usage=True)
        return EventStreamResponse(_stream(ctx, jobs, writer, formatters, parser, events, keep),
                                   headers=headers, on_abandon=partial(cancel_jobs, ctx, jobs))
    results = await wait_for_results(ctx, jobs, has_left=request.is_disconnected)
    if results is None:
        return Response(status_code=499, headers=headers)  # the client left; nobody reads this
    await raise_if_failed(ctx, results, headers)
    response = await whole_response(ctx, body, submitted.chat_body, results, base, first.sampling,
                                    formatters, parser)
    await keep(response)
    return JSONResponse(response, headers=headers)


@router.post("/responses/input_tokens", response_model=InputTokens,
             summary="Count a response's input tokens (OpenAI)", responses=_COUNT_ERRORS)
async def count_input_tokens(body: InputTokensRequest, owner: Owner, ctx: Context) -> InputTokens:
    fields = body.model_dump(exclude_unset=True)
    given_input = fields.pop("input", None)
    # Checked as a response request; with no input of its own, a stand-in input passes the
    # request's check and is never read (only the history and instructions count then).
    request = validated(ResponsesRequest, {
        **fields, "input": given_input if given_input is not None else "(none)"})
    history = await history_of(ctx, request, owner)
    given = chat_messages(request.input) if given_input is not None else []
    if not (history or given or request.instructions):
        raise InvalidRequestError("Nothing to count: give input, instructions, a conversation or "
                                  "a previous_response_id", param="input")
    return InputTokens(object="response.input_tokens",
                       input_tokens=await input_tokens(ctx, request, owner, history, given))


@router.get("/responses/{response_id}", response_model=ResponseObject,
            summary="A stored response, or a background one's events (OpenAI)",
            responses={**_GET_ERRORS, 200: _REPLAY_DOC})
async def get_response(
        response_id: ResponseId, owner: Owner, ctx: Context,
        stream: Annotated[bool, Query(description="A background response's events (Server-Sent "
                                                  "Events) to its end, instead of the object.")]
        = False,
        starting_after: Annotated[int | None, Query(
            ge=0, description="With stream: only the events after this sequence_number (to "
                              "resume a stream that broke off).")] = None) -> Response:
    stored = await ctx.responses.get(response_id, owner)
    if stream:
        reading, with_logprobs = await replay_of(ctx, stored)
        return EventStreamResponse(response_events(ctx, stored, reading, with_logprobs,
                                                   starting_after))
    return JSONResponse((await settle(ctx, stored)).response)


@router.post("/responses/{response_id}/cancel", response_model=ResponseObject,
             summary="Cancel a background response (OpenAI)", responses=_CANCEL_ERRORS)
async def cancel_response(response_id: ResponseId, owner: Owner, ctx: Context) -> JSONResponse:
    stored = await cancel(ctx, await ctx.responses.get(response_id, owner))
    return JSONResponse(stored.response)


@router.delete("/responses/{response_id}", response_model=DeletedResponse,
               summary="Delete a stored response (OpenAI)", responses=_NOT_FOUND)
async def delete_response(response_id: ResponseId, owner: Owner, ctx: Context) -> DeletedResponse:
    await ctx.responses.delete(response_id, owner)
    return DeletedResponse(id=response_id, object="response", deleted=True)


@router.get("/responses/{response_id}/input_items", response_model=ItemList,
            summary="A stored response's input items (OpenAI)", responses=_LIST_ERRORS)
async def list_input_items(response_id: ResponseId, owner: Owner, ctx: Context, limit: Limit = 20,
                           order: Order = "desc", after: After = None) -> ItemList:
    items = (await ctx.responses.get(response_id, owner)).input_items
    return item_page(items, order, after, limit, f"response '{response_id}'")


async def _stream(ctx: AppContext, jobs: list[ChoiceJob], writer: ChunkWriter,
                  formatters: dict[int, LogprobsFormatter], parser: ToolParser | None,
                  events: ResponseEvents,
                  keep: Callable[[dict[str, Any]], Awaitable[None]]) -> AsyncIterator[bytes]:
    for event in events.start():
        yield typed_event(event)
    async for payload in chunk_payloads(ctx, jobs, writer, formatters, None, parser):
        if payload is None:
            yield SSE_KEEPALIVE
            continue
        for event in events.chunk(payload):
            yield typed_event(event)
    closing, response = events.end()
    try:
        await keep(response)
    except REDIS_UNAVAILABLE as exc:
        log.warning("could not store response %s: %s", response["id"], exc)
    for event in closing:
        yield typed_event(event)


