"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

They submit ordinary Carpool jobs (same queue, same workers) and read the job's token stream:
to the end for a plain answer, chunk by chunk for `stream: true`. A client that goes away before
its completion ends has its job canceled, so no worker keeps generating for nobody.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from functools import partial
from typing import Annotated, Any

import redis.exceptions
from fastapi import APIRouter, Depends, Path, Request, Response
from fastapi.responses import JSONResponse

from api.auth import caller_owner
from api.context import AppContext, get_context
from api.errors import OPENAI_TAG, JobFailedError, NotFoundError, openai_error_body
from api.job_service import AcceptedJob, GenerationRequest, sampling_of
from api.openai_chunks import ChunkWriter, openai_finish_reason, usage_dict
from api.openai_logprobs import LogprobsFormatter, token_text_of
from api.openai_schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ModelList,
    ModelObject,
    OpenAIError,
)
from api.sse import EventStreamResponse, sse_comment
from protocol import FinishReason, ModelCard, StreamEntry

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=[OPENAI_TAG], dependencies=[Depends(caller_owner)])

Owner = Annotated[str, Depends(caller_owner)]
Context = Annotated[AppContext, Depends(get_context)]

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": OpenAIError, "description": what} for code, what in (
        (400, "Invalid request (the message names the field)."), (401, "Missing or wrong API key."),
        (413, "Body over the size limit."),
        (429, "Queue full (see Retry-After)."), (500, "The job failed."),
        (503, "Redis unreachable or no model registered yet (see Retry-After)."))
}
_STREAM_DOC = {"content": {"text/event-stream": {}},
               "description": "With `stream: true`: chunks as `data:` lines, then `data: [DONE]`."}


@router.get("/models", response_model=ModelList, summary="Models the workers serve")
async def list_models(ctx: Context) -> ModelList:
    return ModelList(data=[_model_object(card) for card in await ctx.models.cards()])


@router.get("/models/{model}", response_model=ModelObject, summary="One served model",
            responses={404: {"model": OpenAIError}})
async def get_model(model: Annotated[str, Path()], ctx: Context) -> ModelObject:
    for card in await ctx.models.cards():
        if card.name == model:
            return _model_object(card)
    raise NotFoundError(f"The model '{model}' does not exist", param="model", code="model_not_found")


@router.post("/completions", response_model=Completion, summary="Text completion (OpenAI)",
             responses={**_ERRORS, 200: _STREAM_DOC})
async def create_completion(body: CompletionRequest, request: Request, owner: Owner,
                            ctx: Context) -> Response:
    accepted = await ctx.jobs.submit(GenerationRequest(
        owner=owner, model=body.model, prompt=body.prompt, max_tokens=body.max_tokens,
        **_sampling(body)))
    return await _answer(ctx, request, accepted, is_chat=False, include_usage=body.include_usage,
                         stream=body.stream)


@router.post("/chat/completions", response_model=ChatCompletion, summary="Chat completion (OpenAI)",
             responses={**_ERRORS, 200: _STREAM_DOC})
async def create_chat_completion(body: ChatCompletionRequest, request: Request, owner: Owner,
                                 ctx: Context) -> Response:
    max_tokens, max_tokens_param = body.requested_max_tokens
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.content}
                for m in body.messages]
    accepted = await ctx.jobs.submit(GenerationRequest(
        owner=owner, model=body.model, messages=messages, max_tokens=max_tokens,
        input_param="messages", max_tokens_param=max_tokens_param,
        logprobs_param="top_logprobs", **_sampling(body)))
    return await _answer(ctx, request, accepted, is_chat=True, include_usage=body.include_usage,
                         stream=body.stream)


def _sampling(body: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
    # Chat's logprobs is a flag (top_logprobs the count): the sampler wants the count.
    return {"sampling": sampling_of(body, logprobs=body.num_logprobs), "priority": body.priority}


def _model_object(card: ModelCard) -> ModelObject:
    return ModelObject(id=card.name, created=int(card.created_at), max_model_len=card.max_model_len)


async def _answer(ctx: AppContext, request: Request, accepted: AcceptedJob, *, is_chat: bool,
                  include_usage: bool, stream: bool) -> Response:
    spec = accepted.spec
    writer = ChunkWriter(is_chat=is_chat,
                         response_id=("chatcmpl-" if is_chat else "cmpl-") + spec.job_id,
                         created=int(spec.created_at), model=spec.model, include_usage=include_usage)
    headers = {"X-Carpool-Job-Id": spec.job_id}
    formatter = None
    if spec.sampling.logprobs is not None:
        formatter = LogprobsFormatter(is_chat, token_text_of(await ctx.jobs.tokenizer(spec.model)),
                                      spec.sampling.logprobs)
    if stream:
        return EventStreamResponse(_stream_chunks(ctx, spec.job_id, writer, formatter),
                                   headers=headers,
                                   on_abandon=partial(_cancel_abandoned, ctx, spec.job_id))
    tokens, done = await _wait_for_result(ctx, request, spec.job_id)
    text = "".join(entry.text for entry in tokens)
    logprobs = formatter.format(tokens) if formatter is not None else None
    if done is None:
        return Response(status_code=499, headers=headers)  # the client left; nobody reads this
    if done.finish_reason is FinishReason.ERROR:
        raise JobFailedError(f"The job failed: {done.error or 'no reason given'}",
                             code="job_failed", headers=headers)
    usage = usage_dict(done.prompt_tokens, done.completion_tokens)
    reason = openai_finish_reason(done.finish_reason)
    if is_chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "logprobs": logprobs, "finish_reason": reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}
    body = {"id": writer.response_id, "object": "chat.completion" if is_chat else "text_completion",
            "created": writer.created, "model": writer.model, "choices": [choice], "usage": usage}
    return JSONResponse(body, headers=headers)


async def _wait_for_result(ctx: AppContext, request: Request,
                           job_id: str) -> tuple[list[StreamEntry], StreamEntry | None]:
    """The job's token entries and final entry; (tokens, None) after canceling it for a client
    that left."""
    tokens: list[StreamEntry] = []
    async for event in ctx.stream(job_id).follow():
        if await request.is_disconnected():
            await _cancel_abandoned(ctx, job_id)
            return tokens, None
        if event is None:
            continue
        if event.is_done:
            return tokens, event.entry
        tokens.append(event.entry)
    # The job's keys expired while we waited (retention shorter than the job): nothing to show.
    raise NotFoundError(f"Job '{job_id}' expired before it ended", code="job_expired")


async def _stream_chunks(ctx: AppContext, job_id: str, writer: ChunkWriter,
                         formatter: LogprobsFormatter | None) -> AsyncIterator[bytes]:
    # Tokens whose text is held back (a possible stop string, a split character) send their
    # logprobs with the next chunk that carries text, or with the finish chunk.
    unsent: list[StreamEntry] = []

    def logprobs() -> dict[str, Any] | None:
        if formatter is None:
            return None
        formatted = formatter.format(unsent)
        unsent.clear()
        return formatted

    opening = writer.opening()
    if opening is not None:
        yield _data(opening)
    last_sent = time.monotonic()
    try:
        async for event in ctx.stream(job_id).follow():
            if event is None:
                if time.monotonic() - last_sent >= ctx.settings.sse_keepalive_s:
                    last_sent = time.monotonic()
                    yield sse_comment()
                continue
            last_sent = time.monotonic()
            entry = event.entry
            if not event.is_done:
                if formatter is not None:
                    unsent.append(entry)
                if entry.text:  # text held back (a possible stop string) arrives later
                    yield _data(writer.text(entry.text, logprobs()))
                continue
            if entry.finish_reason is FinishReason.ERROR:
                # The openai client raises APIError on a data line that carries "error".
                yield _data(openai_error_body(f"The job failed: {entry.error or 'no reason given'}",
                                              "server_error", None, "job_failed"))
            else:
                yield _data(writer.finish(entry.finish_reason, logprobs() if unsent else None))
                if writer.include_usage:
                    yield _data(writer.usage(entry.prompt_tokens, entry.completion_tokens))
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
        # Headers are long sent: say it in the stream, as OpenAI does for mid-stream failures.
        log.warning("Redis lost while streaming job %s: %s", job_id, exc)
        yield _data(openai_error_body("Redis became unreachable while streaming; the job goes on: "
                                      f"follow it at /v1/jobs/{job_id}/stream", "server_error",
                                      None, "service_unavailable"))
    yield b"data: [DONE]\n\n"


async def _cancel_abandoned(ctx: AppContext, job_id: str) -> None:
    try:
        status = await ctx.jobs.cancel_unowned(job_id)
        log.info("client left before job %s ended: canceled (status now %s)", job_id,
                 status.value if status else "gone")
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
        log.warning("could not cancel abandoned job %s: %s", job_id, exc)


def _data(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()
