"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

They submit ordinary Carpool jobs (same queue, same workers) and read the job's token stream:
to the end for a plain answer, chunk by chunk for `stream: true`. A client that goes away before
its completion ends has its job canceled, so no worker keeps generating for nobody.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Request, Response
from fastapi.responses import JSONResponse

from api.auth import caller_owner
from api.context import AppContext, get_context
from api.deadline_headers import deadlines_of
from api.errors import OPENAI_TAG, JobFailedError, NotFoundError
from api.idempotency_key import idempotency_key_of
from api.job_service import AcceptedJob
from api.openai_answer import answer_body, logprobs_formatters, wait_for_results
from api.openai_choices import (
    ChoiceJob,
    ChoiceResult,
    cancel_jobs,
    choice_jobs,
    job_headers,
    raise_if_failed,
)
from api.openai_chunks import ChunkWriter
from api.openai_logprobs import LogprobsFormatter
from api.openai_requests import chat_requests, common_fields, completion_requests
from api.openai_schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ModelList,
    ModelObject,
    OpenAIError,
    openai_error_docs,
)
from api.openai_stream import chunk_payloads
from api.sampling_defaults import served_defaults
from api.sse import SSE_KEEPALIVE, EventStreamResponse
from api.tool_parsers import ToolParser, get_parser
from api.webhook_urls import webhook_url_of
from protocol import ModelCard
from protocol.timestamps import rfc3339_utc

router = APIRouter(prefix="/v1", tags=[OPENAI_TAG], dependencies=[Depends(caller_owner)])

Owner = Annotated[str, Depends(caller_owner)]
Context = Annotated[AppContext, Depends(get_context)]

_ERRORS = openai_error_docs(
    (400, "Invalid request (the message names the field)."), (401, "Missing or wrong API key."),
    (404, "No model of that name was ever served here."), (413, "Body over the size limit."),
    (429, "Queue full (see Retry-After)."), (500, "The job failed."),
    (503, "Redis unreachable or no model registered yet (see Retry-After)."))
_STREAM_DOC = {"content": {"text/event-stream": {}},
               "description": "With `stream: true`: chunks as `data:` lines, then `data: [DONE]`."}


@router.get("/models", response_model=ModelList, summary="Models live workers serve now")
async def list_models(ctx: Context) -> ModelList:
    models = [_model_object(card) for card in await ctx.models.live_cards()]
    return ModelList(data=models, first_id=models[0].id if models else None,
                     last_id=models[-1].id if models else None)


@router.get("/models/{model}", response_model=ModelObject, summary="One served model",
            responses={404: {"model": OpenAIError}})
async def get_model(model: Annotated[str, Path()], ctx: Context) -> ModelObject:
    for card in await ctx.models.live_cards():
        if card.name == model:
            return _model_object(card)
    raise NotFoundError(f"The model '{model}' does not exist", param="model", code="model_not_found")


@router.post("/completions", response_model=Completion, summary="Text completion (OpenAI)",
             responses={**_ERRORS, 200: _STREAM_DOC})
async def create_completion(body: CompletionRequest, request: Request, owner: Owner,
                            ctx: Context) -> Response:
    requests = completion_requests(body, ctx.settings, _common(body, owner, request))
    accepted = await ctx.jobs.submit_many(requests)
    echoes = [(job.prompt_text or "") if body.echo else "" for job in accepted]
    return await _answer(ctx, request, body, accepted, is_chat=False, echoes=echoes,
                         prompt_only=body.scores_prompt)


@router.post("/chat/completions", response_model=ChatCompletion, summary="Chat completion (OpenAI)",
             responses={**_ERRORS, 200: _STREAM_DOC})
async def create_chat_completion(body: ChatCompletionRequest, request: Request, owner: Owner,
                                 ctx: Context) -> Response:
    chat = chat_requests(body, ctx.settings, _common(body, owner, request))
    accepted = await ctx.jobs.submit_many(chat.requests)
    parser = get_parser(ctx.settings.tool_parser) if chat.calling.parses_calls else None
    echo = chat.echo if body.echo else ""
    keep = None
    if body.store:
        # The messages as sent (their content parts too), read again from the body already taken.
        messages = (await request.json())["messages"]
        keep = partial(ctx.chat_completions.keep, owner, metadata=body.metadata, messages=messages)
    return await _answer(ctx, request, body, accepted, is_chat=True,
                         echoes=[echo] * len(accepted), tool_parser=parser, keep=keep)


def _common(body: CompletionRequest | ChatCompletionRequest, owner: str,
            request: Request) -> dict[str, Any]:
    return common_fields(body, owner, **deadlines_of(request.headers),
                         idempotency_key=idempotency_key_of(request.headers),
                         **webhook_url_of(body.webhook_url, request.headers))


def _model_object(card: ModelCard) -> ModelObject:
    created = int(card.created_at)
    return ModelObject(id=card.name, created=created, max_model_len=card.max_model_len,
                       generation_defaults=served_defaults(card.generation_defaults),
                       display_name=card.name, created_at=rfc3339_utc(created))


Keep = Callable[[dict[str, Any]], Awaitable[None]]


async def _answer(ctx: AppContext, request: Request,
                  body: CompletionRequest | ChatCompletionRequest, accepted: list[AcceptedJob], *,
                  is_chat: bool, echoes: list[str], tool_parser: ToolParser | None = None,
                  prompt_only: bool = False, keep: Keep | None = None) -> Response:
    """`echoes`: per accepted job, the text its choice starts with ("" for none); `prompt_only`:
    each choice is that alone (CompletionRequest.scores_prompt); `keep`: stores the whole answer
    (`store: true`), streamed or not."""
    first = accepted[0].spec
    jobs = choice_jobs(accepted, body.n, echoes, prompt_only)
    writer = ChunkWriter(is_chat=is_chat,
                         response_id=("chatcmpl-" if is_chat else "cmpl-") + first.job_id,
                         created=int(first.created_at), model=first.model,
                         include_usage=body.include_usage, continuous_usage=body.continuous_usage,
                         service_tier=(body.tier_served if isinstance(body, ChatCompletionRequest)
                                       else None),
                         return_token_ids=bool(body.return_token_ids),
                         stream_interval=body.stream_interval or 1)
    headers = job_headers(accepted)
    ids_as_tokens = bool(body.return_tokens_as_token_ids)
    formatters = await logprobs_formatters(ctx, first.model, first.sampling, jobs, is_chat,
                                           ids_as_tokens)

    async def whole_answer(results: list[ChoiceResult],
                           formatters: dict[int, LogprobsFormatter]) -> dict[str, Any]:
        return await answer_body(
            ctx, body, results, is_chat=is_chat, response_id=writer.response_id,
            created=writer.created, model=writer.model, sampling=first.sampling,
            formatters=formatters, tool_parser=tool_parser, service_tier=writer.service_tier)

    async def keep_streamed() -> None:
        # The stream ended whole: its choices' answer, as a plain request would have got it.
        assert keep is not None
        try:
            results = await wait_for_results(ctx, jobs)
            assert results is not None  # (None only for a client that left)
            await raise_if_failed(ctx, results, headers)
        except (NotFoundError, JobFailedError):
            return  # expired meanwhile, or failed: a failed completion is not kept (as unanswered)
        # Formatters keep a running text offset: the stream used up its own.
        await keep(await whole_answer(results, await logprobs_formatters(
            ctx, first.model, first.sampling, jobs, is_chat, ids_as_tokens)))

    if body.stream:
        return EventStreamResponse(_stream_chunks(ctx, jobs, writer, formatters,
                                                  first.sampling.prompt_logprobs, tool_parser,
                                                  then=keep_streamed if keep else None),
                                   headers=headers,
                                   on_abandon=partial(cancel_jobs, ctx, jobs))
    results = await wait_for_results(ctx, jobs, has_left=request.is_disconnected)
    if results is None:
        return Response(status_code=499, headers=headers)  # the client left; nobody reads this
    await raise_if_failed(ctx, results, headers)
    answer = await whole_answer(results, formatters)
    if keep is not None:
        await keep(answer)
    return JSONResponse(answer, headers=headers)


async def _stream_chunks(ctx: AppContext, jobs: list[ChoiceJob], writer: ChunkWriter,
                         formatters: dict[int, LogprobsFormatter],
                         prompt_logprobs: int | None,
                         tool_parser: ToolParser | None = None,
                         then: Callable[[], Awaitable[None]] | None = None) -> AsyncIterator[bytes]:
    """The chunks, then (`then`, before [DONE], so that a client that saw the stream end finds
    what it did) whatever follows a stream that ended whole."""
    async for payload in chunk_payloads(ctx, jobs, writer, formatters, prompt_logprobs, tool_parser):
        yield SSE_KEEPALIVE if payload is None else _data(payload)
    if then is not None:
        await then()
    yield b"data: [DONE]\n\n"


def _data(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()
