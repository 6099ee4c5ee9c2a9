"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

They submit ordinary Carpool jobs (same queue, same workers) and read the job's token stream:
to the end for a plain answer, chunk by chunk for `stream: true`. A client that goes away before
its completion ends has its job canceled, so no worker keeps generating for nobody.
"""

from __future__ import annotations

import dataclasses
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
    InvalidRequestError,
    JobFailedError,
    NotFoundError,
    openai_error_body,
)
from api.idempotency_key import REPLAYED_HEADER, idempotency_key_of
from api.job_service import AcceptedJob, GenerationRequest, choice_sampling, sampling_of
from api.openai_choices import (
    ChoiceJob,
    ChoiceResult,
    cancel_jobs,
    merged_events,
    summed_usage,
)
from api.openai_chunks import ChunkWriter, openai_finish_reason, usage_dict
from api.openai_logprobs import LogprobsFormatter, token_text_of, vllm_prompt_logprobs
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
from api.tool_calls import ToolCalling, plain_messages, template_messages, template_tools, tool_calling_of
from api.tool_parsers import StreamingToolParser, ToolParser, chat_message, get_parser, tool_finish_reason
from api.webhook_urls import webhook_url_of
from protocol import FinishReason, ModelCard, SamplingParams, StreamEntry

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
    _check_counts(ctx, body.n, len(body.prompt))
    common = _common(body, owner, request)
    requests = [GenerationRequest(
        **common, prompt=prompt if isinstance(prompt, str) else None,
        prompt_token_ids=prompt if isinstance(prompt, list) else None,
        max_tokens=body.max_tokens, sampling=choice_sampling(common_sampling, choice))
        # echo with logprobs: the prompt's tokens get theirs too (as OpenAI's legacy API did).
        for prompt in body.prompt for choice, common_sampling in _choices(
            body, prompt_logprobs=_most(body.prompt_logprobs, body.logprobs if body.echo else None))]
    accepted = await ctx.jobs.submit_many(requests)
    echoes = [(job.prompt_text or "") if body.echo else "" for job in accepted]
    return await _answer(ctx, request, body, accepted, is_chat=False, echoes=echoes)


@router.post("/chat/completions", response_model=ChatCompletion, summary="Chat completion (OpenAI)",
             responses={**_ERRORS, 200: _STREAM_DOC})
async def create_chat_completion(body: ChatCompletionRequest, request: Request, owner: Owner,
                                 ctx: Context) -> Response:
    _check_counts(ctx, body.n, 1)
    max_tokens, max_tokens_param = body.requested_max_tokens
    calling = tool_calling_of(body.tools, body.tool_choice, body.parallel_tool_calls)
    given = [{**m.model_dump(), "role": "system" if m.role == "developer" else m.role}
             for m in body.messages]
    messages = plain_messages(given, calling)
    # A template that renders tools itself gets them (the job service decides, knowing the model).
    tools = template_tools(calling) if calling.parses_calls else None
    tool_messages = template_messages(given) if calling.parses_calls else None
    requests = [GenerationRequest(
        **_common(body, owner, request), messages=messages, max_tokens=max_tokens, input_param="messages",
        max_tokens_param=max_tokens_param, logprobs_param="top_logprobs",
        sampling=choice_sampling(sampling, choice), template_tools=tools,
        template_messages=tool_messages)
        for choice, sampling in _choices(body, body.prompt_logprobs, calling)]
    accepted = await ctx.jobs.submit_many(requests)
    parser = get_parser(ctx.settings.tool_parser) if calling.parses_calls else None
    echo = _chat_echo(messages) if body.echo else ""
    return await _answer(ctx, request, body, accepted, is_chat=True,
                         echoes=[echo] * len(accepted), tool_parser=parser)


def _chat_echo(messages: list[dict[str, Any]]) -> str:
    """vLLM's chat `echo`: the last message's content goes before each reply when that message
    is the assistant's own (a reply to continue); any other last message echoes nothing."""
    last = messages[-1]
    return (last.get("content") or "") if last["role"] == "assistant" else ""


def _check_counts(ctx: AppContext, n: int, num_prompts: int) -> None:
    settings = ctx.settings
    if n > settings.max_n:
        raise InvalidRequestError(f"Invalid value for 'n': at most {settings.max_n} choices per "
                                  f"prompt are accepted (got {n})", param="n")
    if num_prompts > settings.max_prompts:
        raise InvalidRequestError(f"Invalid value for 'prompt': at most {settings.max_prompts} "
                                  f"prompts per request are accepted (got {num_prompts})",
                                  param="prompt")


def _common(body: CompletionRequest | ChatCompletionRequest, owner: str,
            request: Request) -> dict[str, Any]:
    return {"owner": owner, "model": body.model, "priority": body.priority,
            "explicit_fields": frozenset(body.model_fields_set),
            **deadlines_of(request.headers), "idempotency_key": idempotency_key_of(request.headers),
            **webhook_url_of(body.webhook_url, request.headers)}


def _most(*counts: int | None) -> int | None:
    """The largest of the counts given (None: none given)."""
    given = [count for count in counts if count is not None]
    return max(given) if given else None


def _choices(body: CompletionRequest | ChatCompletionRequest, prompt_logprobs: int | None,
             calling: ToolCalling | None = None) -> list[tuple[int, SamplingParams]]:
    # Chat's logprobs is a flag (top_logprobs the count): the sampler wants the count.
    sampling = sampling_of(body, logprobs=body.num_logprobs, prompt_logprobs=prompt_logprobs)
    forced_call = calling.constraint() if calling is not None else None
    if forced_call is not None:
        if sampling.structured_output is not None:
            raise InvalidRequestError("A forced tool call ('tool_choice' required or a function) "
                                      "cannot be combined with an output constraint "
                                      "(response_format, structured_outputs, guided_*)",
                                      param="tool_choice")
        sampling = dataclasses.replace(sampling, structured_output=forced_call)
    return [(choice, sampling) for choice in range(body.n)]


def _model_object(card: ModelCard) -> ModelObject:
    return ModelObject(id=card.name, created=int(card.created_at), max_model_len=card.max_model_len,
                       generation_defaults=served_defaults(card.generation_defaults))


async def _answer(ctx: AppContext, request: Request,
                  body: CompletionRequest | ChatCompletionRequest, accepted: list[AcceptedJob], *,
                  is_chat: bool, echoes: list[str], tool_parser: ToolParser | None = None) -> Response:
    """`echoes`: per accepted job, the text its choice starts with ("" for none)."""
    first = accepted[0].spec
    jobs = [ChoiceJob(index=index, prompt_number=index // body.n, job_id=job.spec.job_id,
                      echo=echo, prompt_tokens=job.prompt_tokens or 0)
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
    formatters: dict[int, LogprobsFormatter] = {}
    if first.sampling.logprobs is not None:
        token_text = token_text_of(await ctx.jobs.model_tokenizer(first.model))
        # One per choice: each keeps its own running text offset (past its echo).
        formatters = {job.index: LogprobsFormatter(is_chat, token_text, first.sampling.logprobs,
                                                   text_offset=len(job.echo)) for job in jobs}
    if body.stream:
        return EventStreamResponse(_stream_chunks(ctx, jobs, writer, formatters,
                                                  first.sampling.prompt_logprobs, tool_parser),
                                   headers=headers,
                                   on_abandon=partial(cancel_jobs, ctx, jobs))
    results = await _wait_for_results(ctx, request, jobs)
    if results is None:
        return Response(status_code=499, headers=headers)  # the client left; nobody reads this
    failed = next((r for r in results if r.done.finish_reason is FinishReason.ERROR), None)
    if failed is not None:
        await cancel_jobs(ctx, [r.job for r in results if r is not failed])
        raise JobFailedError(f"The job failed: {failed.done.error or 'no reason given'}",
                             code="job_failed", headers=headers)
    # vLLM's prompt_logprobs field (never streamed: the schema refuses it with stream), written
    # with each job's first token.
    vllm_prompt: dict[int, list[dict[str, dict[str, Any]] | None] | None] = {}
    if body.prompt_logprobs is not None:
        token_text = token_text_of(await ctx.jobs.model_tokenizer(first.model))
        for job in jobs:
            if not is_chat or job.index == 0:  # chat's is one per response, as vLLM's
                vllm_prompt[job.index] = vllm_prompt_logprobs(
                    await ctx.jobs.prompt_logprobs(job.job_id), body.prompt_logprobs, token_text)
    choices: list[dict[str, Any]] = []
    for result in results:
        reason = openai_finish_reason(result.done.finish_reason)
        formatter = formatters.get(result.job.index)
        logprobs = None
        if formatter is not None:
            # The prompt's part first: the completion's text offsets continue after it.
            prompt = (await _prompt_logprobs(ctx, formatter, result.job)
                      if first.sampling.prompt_logprobs is not None else None)
            logprobs = formatter.format(result.tokens)
            if prompt is not None:
                logprobs = {name: prompt[name] + logprobs[name] for name in logprobs}
        if is_chat:
            message, reason = chat_message(tool_parser, result.text, reason)
            if result.job.echo:  # vLLM's chat echo: the continued assistant message reads whole
                message["content"] = result.job.echo + (message.get("content") or "")
            choices.append({"index": result.job.index, "logprobs": logprobs,
                            "finish_reason": reason, "message": message})
        else:
            choices.append({"index": result.job.index, "text": result.job.echo + result.text,
                            "logprobs": logprobs, "finish_reason": reason})
            if result.job.index in vllm_prompt:
                choices[-1]["prompt_logprobs"] = vllm_prompt[result.job.index]
    answer: dict[str, Any] = {"id": writer.response_id, "object": "chat.completion" if is_chat else "text_completion",
              "created": writer.created, "model": writer.model, "choices": choices,
              "usage": usage_dict(*summed_usage(results))}
    if is_chat and vllm_prompt:
        answer["prompt_logprobs"] = vllm_prompt[0]
    return JSONResponse(answer, headers=headers)


async def _prompt_logprobs(ctx: AppContext, formatter: LogprobsFormatter,
                           job: ChoiceJob) -> dict[str, Any] | None:
    """The choice's prompt part of `echo` with logprobs; None when the job wrote none (it ended
    before its first token)."""
    prompt = await ctx.jobs.prompt_logprobs(job.job_id)
    return formatter.format_prompt(prompt) if prompt is not None else None


async def _wait_for_results(ctx: AppContext, request: Request,
                            jobs: list[ChoiceJob]) -> list[ChoiceResult] | None:
    """Every choice's text, token entries and final entry, in index order; None after canceling
    them all for a client that left."""
    pieces: dict[int, list[StreamEntry]] = {job.index: [] for job in jobs}
    done: dict[int, ChoiceResult] = {}
    # aclosing: leaving early stops the followers now, not when the generator is collected.
    async with aclosing(merged_events(ctx, jobs)) as events:
        async for job, event in events:
            if await request.is_disconnected():
                await cancel_jobs(ctx, [j for j in jobs if j.index not in done])
                return None
            if event is None:
                continue
            if event.is_done:
                tokens = pieces[job.index]
                done[job.index] = ChoiceResult(job, "".join(entry.text for entry in tokens),
                                               event.entry, tuple(tokens))
            else:
                pieces[job.index].append(event.entry)
    if len(done) < len(jobs):
        # A job's keys expired while we waited (retention shorter than the job): nothing to show.
        missing = next(job.job_id for job in jobs if job.index not in done)
        raise NotFoundError(f"Job '{missing}' expired before it ended", code="job_expired")
    return [done[job.index] for job in jobs]


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
                                            await _prompt_logprobs(ctx, formatters[job.index], job)))
                if not event.is_done:
                    num_tokens[job.index] += 1
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
