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
from contextlib import aclosing
from functools import partial
from typing import Annotated, Any

import redis.exceptions
from fastapi import APIRouter, Depends, Path, Request, Response
from fastapi.responses import JSONResponse

from api.auth import caller_owner
from api.context import AppContext, get_context
from api.deadline_headers import deadlines_of
from api.errors import (
    OPENAI_TAG,
    JobFailedError,
    NotFoundError,
    openai_error_body,
)
from api.idempotency_key import REPLAYED_HEADER, idempotency_key_of
from api.job_service import AcceptedJob
from api.openai_answer import answer_body, logprobs_formatters, prompt_logprobs_of, wait_for_results
from api.openai_choices import (
    ChoiceJob,
    ChoiceResult,
    cancel_jobs,
    merged_events,
    summed_usage,
)
from api.openai_chunks import ChunkWriter, openai_finish_reason, usage_dict
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
)
from api.sampling_defaults import served_defaults
from api.sse import EventStreamResponse, sse_comment
from api.tool_parsers import StreamingToolParser, ToolParser, get_parser, tool_finish_reason
from api.webhook_urls import webhook_url_of
from protocol import FinishReason, ModelCard, StreamEntry

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=[OPENAI_TAG], dependencies=[Depends(caller_owner)])

Owner = Annotated[str, Depends(caller_owner)]
Context = Annotated[AppContext, Depends(get_context)]

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": OpenAIError, "description": what} for code, what in (
        (400, "Invalid request (the message names the field)."), (401, "Missing or wrong API key."),
        (404, "No model of that name was ever served here."),
        (413, "Body over the size limit."),
        (429, "Queue full (see Retry-After)."), (500, "The job failed."),
        (503, "Redis unreachable or no model registered yet (see Retry-After)."))
}
_STREAM_DOC = {"content": {"text/event-stream": {}},
               "description": "With `stream: true`: chunks as `data:` lines, then `data: [DONE]`."}


@router.get("/models", response_model=ModelList, summary="Models live workers serve now")
async def list_models(ctx: Context) -> ModelList:
    return ModelList(data=[_model_object(card) for card in await ctx.models.live_cards()])


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
    return await _answer(ctx, request, body, accepted, is_chat=True,
                         echoes=[echo] * len(accepted), tool_parser=parser)


def _common(body: CompletionRequest | ChatCompletionRequest, owner: str,
            request: Request) -> dict[str, Any]:
    return common_fields(body, owner, **deadlines_of(request.headers),
                         idempotency_key=idempotency_key_of(request.headers),
                         **webhook_url_of(body.webhook_url, request.headers))


def _model_object(card: ModelCard) -> ModelObject:
    return ModelObject(id=card.name, created=int(card.created_at), max_model_len=card.max_model_len,
                       generation_defaults=served_defaults(card.generation_defaults))


async def _answer(ctx: AppContext, request: Request,
                  body: CompletionRequest | ChatCompletionRequest, accepted: list[AcceptedJob], *,
                  is_chat: bool, echoes: list[str], tool_parser: ToolParser | None = None,
                  prompt_only: bool = False) -> Response:
    """`echoes`: per accepted job, the text its choice starts with ("" for none); `prompt_only`:
    each choice is that alone (CompletionRequest.scores_prompt)."""
    first = accepted[0].spec
    jobs = [ChoiceJob(index=index, prompt_number=index // body.n, job_id=job.spec.job_id,
                      echo=echo, prompt_tokens=job.prompt_tokens or 0, is_new=not job.is_replay,
                      prompt_only=prompt_only)
            for index, (job, echo) in enumerate(zip(accepted, echoes, strict=True))]
    writer = ChunkWriter(is_chat=is_chat,
                         response_id=("chatcmpl-" if is_chat else "cmpl-") + first.job_id,
                         created=int(first.created_at), model=first.model,
                         include_usage=body.include_usage, continuous_usage=body.continuous_usage)
    headers = {"X-Carpool-Job-Id": first.job_id}
    if len(jobs) > 1:
        headers["X-Carpool-Job-Ids"] = ",".join(job.job_id for job in jobs)
    if accepted[0].is_replay:
        headers[REPLAYED_HEADER] = "true"
    formatters = await logprobs_formatters(ctx, first.model, first.sampling, jobs, is_chat)
    if body.stream:
        return EventStreamResponse(_stream_chunks(ctx, jobs, writer, formatters,
                                                  first.sampling.prompt_logprobs, tool_parser),
                                   headers=headers,
                                   on_abandon=partial(cancel_jobs, ctx, jobs))
    results = await wait_for_results(ctx, jobs, has_left=request.is_disconnected)
    if results is None:
        return Response(status_code=499, headers=headers)  # the client left; nobody reads this
    failed = next((r for r in results if r.done.finish_reason is FinishReason.ERROR), None)
    if failed is not None:
        await cancel_jobs(ctx, [r.job for r in results if r is not failed])
        raise JobFailedError(f"The job failed: {failed.done.error or 'no reason given'}",
                             code="job_failed", headers=headers)
    answer = await answer_body(ctx, body, results, is_chat=is_chat,
                               response_id=writer.response_id, created=writer.created,
                               model=writer.model, sampling=first.sampling,
                               formatters=formatters, tool_parser=tool_parser)
    return JSONResponse(answer, headers=headers)


async def _stream_chunks(ctx: AppContext, jobs: list[ChoiceJob], writer: ChunkWriter,
                         formatters: dict[int, LogprobsFormatter],
                         prompt_logprobs: int | None,
                         tool_parser: ToolParser | None = None) -> AsyncIterator[bytes]:
    num_tokens = {job.index: 0 for job in jobs}
    # With tools, each choice's text goes through a streaming parser: content and tool_calls deltas.
    call_streams: dict[int, StreamingToolParser] = (
        {job.index: tool_parser.stream() for job in jobs} if tool_parser is not None else {})
    # Tokens whose text is held back (a possible stop string, a split character) send their
    # logprobs with their choice's next chunk that carries text, or with its finish chunk.
    unsent: dict[int, list[StreamEntry]] = {job.index: [] for job in jobs}

    def logprobs(job: ChoiceJob) -> dict[str, Any] | None:
        formatter = formatters.get(job.index)
        if formatter is None or not unsent[job.index]:
            return None
        formatted = formatter.format(unsent[job.index])
        unsent[job.index].clear()
        return formatted

    def usage_so_far(job: ChoiceJob) -> dict[str, Any]:
        return usage_dict(job.prompt_tokens, num_tokens[job.index])

    # echo with logprobs: a choice's echo chunk carries its prompt's logprobs, which the worker
    # writes with the first token, so it goes out when the choice's first entry arrives.
    echo_waits = {job.index for job in jobs if job.echo and job.index in formatters
                  and prompt_logprobs is not None}

    for job in jobs:
        opening = writer.opening(job.index, usage_so_far(job))
        if opening is not None:
            yield _data(opening)
        if job.echo and job.index not in echo_waits:
            yield _data(writer.text(job.echo, job.index, usage_so_far(job)))
    last_sent = time.monotonic()
    results: list[ChoiceResult] = []
    try:
        async with aclosing(merged_events(ctx, jobs)) as events:
            async for job, event in events:
                if event is None:
                    if time.monotonic() - last_sent >= ctx.settings.sse_keepalive_s:
                        last_sent = time.monotonic()
                        yield sse_comment()
                    continue
                last_sent = time.monotonic()
                entry = event.entry
                if job.index in echo_waits:
                    echo_waits.discard(job.index)
                    yield _data(writer.text(job.echo, job.index, usage_so_far(job),
                                            await prompt_logprobs_of(ctx, formatters[job.index], job)))
                if not event.is_done:
                    num_tokens[job.index] += 1
                    if job.prompt_only:
                        continue  # the one token that brought the prompt's logprobs: not shown
                    if job.index in formatters:
                        unsent[job.index].append(entry)
                    if entry.text and job.index in call_streams:
                        for delta in call_streams[job.index].feed(entry.text):
                            yield _data(writer.delta(delta, job.index, usage_so_far(job), logprobs(job)))
                    elif entry.text:  # text held back (a possible stop string) arrives later
                        yield _data(writer.text(entry.text, job.index, usage_so_far(job),
                                                logprobs(job)))
                    continue
                if entry.finish_reason is FinishReason.ERROR:
                    # The openai client raises APIError on a data line that carries "error".
                    yield _data(openai_error_body(f"The job failed: {entry.error or 'no reason given'}",
                                                  "server_error", None, "job_failed"))
                    await cancel_jobs(ctx, [j for j in jobs if j is not job
                                            and j.index not in {r.job.index for r in results}])
                    break
                results.append(ChoiceResult(job, "", entry))
                reason_name = None
                call_stream = call_streams.get(job.index)
                if call_stream is not None:
                    for delta in call_stream.finish():
                        yield _data(writer.delta(delta, job.index, usage_so_far(job)))
                    reason_name = tool_finish_reason(openai_finish_reason(entry.finish_reason),
                                                     call_stream.called)
                yield _data(writer.finish(entry.finish_reason, job.index,
                                          usage_dict(entry.prompt_tokens, entry.completion_tokens),
                                          logprobs(job), reason_name))
            else:
                if writer.include_usage:
                    yield _data(writer.usage(*summed_usage(results)))
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
        # Headers are long sent: say it in the stream, as OpenAI does for mid-stream failures.
        job_ids = ", ".join(job.job_id for job in jobs)
        log.warning("Redis lost while streaming jobs %s: %s", job_ids, exc)
        yield _data(openai_error_body("Redis became unreachable while streaming; the jobs go on: "
                                      "follow them at /v1/jobs/<job id>/stream (job ids "
                                      f"{job_ids})", "server_error", None, "service_unavailable"))
    yield b"data: [DONE]\n\n"


def _data(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()
