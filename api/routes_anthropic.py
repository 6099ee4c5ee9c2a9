"""Anthropic's Messages API: POST /v1/messages (whole or streamed) and
POST /v1/messages/count_tokens, for the official `anthropic` client and tools built on it (keys
as `x-api-key` or a bearer token).

A message is a chat completion underneath, as a Responses API response is: the request becomes
the chat request it means (api/anthropic_requests.py), whose job is submitted, followed and
canceled as the chat route's; only the shapes differ (api/anthropic_answer.py), errors included
(`{"type": "error", "error": {"type", "message"}}`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import partial
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse

from api.anthropic_answer import MessageEvents, message_of
from api.anthropic_requests import chat_body_of
from api.anthropic_schemas import AnthropicError, CountTokensRequest, InputTokens, Message, MessagesRequest
from api.auth import caller_owner
from api.context import AppContext, get_context
from api.deadline_headers import deadlines_of
from api.errors import ANTHROPIC_TAG
from api.idempotency_key import idempotency_key_of
from api.openai_answer import answer_body, wait_for_results
from api.openai_choices import ChoiceJob, cancel_jobs, choice_jobs, job_headers, raise_if_failed
from api.openai_chunks import ChunkWriter
from api.openai_requests import chat_requests, common_fields
from api.openai_stream import chunk_payloads
from api.sse import EventStreamResponse, typed_event
from api.tool_parsers import ToolParser, get_parser

router = APIRouter(prefix="/v1", tags=[ANTHROPIC_TAG], dependencies=[Depends(caller_owner)])

Owner = Annotated[str, Depends(caller_owner)]
Context = Annotated[AppContext, Depends(get_context)]

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": AnthropicError, "description": description} for status, description in (
        (400, "Invalid request (the message names the field)."), (401, "Missing or wrong API key."),
        (404, "No model of that name is served."), (413, "Body over the size limit."),
        (429, "Queue full (see Retry-After)."), (500, "The job failed."),
        (503, "Redis unreachable or no model registered yet (see Retry-After)."))}
_STREAM = {"content": {"text/event-stream": {}},
           "description": "With `stream: true`: message_start, the content blocks' events, "
                          "message_delta and message_stop (`event:` and `data:` lines)."}


@router.post("/messages", response_model=Message, summary="Create a message (Anthropic)",
             responses={**_ERRORS, 200: _STREAM})
async def create_message(body: MessagesRequest, request: Request, owner: Owner,
                         ctx: Context) -> Response:
    chat_body = chat_body_of(body)
    chat = chat_requests(chat_body, ctx.settings, common_fields(
        chat_body, owner, **deadlines_of(request.headers),
        idempotency_key=idempotency_key_of(request.headers)))
    accepted = await ctx.jobs.submit_many(chat.requests)
    first = accepted[0].spec
    jobs = choice_jobs(accepted, 1, [""])
    parser = get_parser(ctx.settings.tool_parser) if chat.calling.parses_calls else None
    headers = job_headers(accepted)
    message_id = "msg_" + first.job_id
    if body.stream:
        writer = ChunkWriter(is_chat=True, response_id=message_id, created=int(first.created_at),
                             model=first.model, include_usage=True)
        events = MessageEvents(message_id, first.model, accepted[0].prompt_tokens or 0,
                               body.stop_sequences)
        return EventStreamResponse(_stream(ctx, jobs, writer, parser, events), headers=headers,
                                   on_abandon=partial(cancel_jobs, ctx, jobs))
    results = await wait_for_results(ctx, jobs, has_left=request.is_disconnected)
    if results is None:
        return Response(status_code=499, headers=headers)  # the client left; nobody reads this
    await raise_if_failed(ctx, results, headers)
    answer = await answer_body(ctx, chat_body, results, is_chat=True, response_id=message_id,
                               created=int(first.created_at), model=first.model,
                               sampling=first.sampling, formatters={}, tool_parser=parser)
    return JSONResponse(message_of(body, answer, message_id), headers=headers)


@router.post("/messages/count_tokens", response_model=InputTokens,
             summary="Count a message request's input tokens (Anthropic)", responses=_ERRORS)
async def count_tokens(body: CountTokensRequest, owner: Owner, ctx: Context) -> InputTokens:
    chat_body = chat_body_of(body)
    chat = chat_requests(chat_body, ctx.settings, common_fields(chat_body, owner))
    return InputTokens(input_tokens=await ctx.jobs.prompt_tokens(chat.requests[0]))


async def _stream(ctx: AppContext, jobs: list[ChoiceJob], writer: ChunkWriter,
                  parser: ToolParser | None, events: MessageEvents) -> AsyncIterator[bytes]:
    for event in events.opening():
        yield event
    async for payload in chunk_payloads(ctx, jobs, writer, {}, None, parser):
        if payload is None:  # a quiet while: Anthropic's keep-alive is a ping event
            yield typed_event({"type": "ping"})
            continue
        for event in events.feed(payload):
            yield event
