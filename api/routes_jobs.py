"""The jobs API: submit a job, read its status, follow its tokens (SSE, resumable), cancel it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Path, Query, Request, Response
from fastapi.responses import JSONResponse

from api.auth import caller_owner
from api.context import AppContext, get_context
from api.errors import InvalidRequestError
from api.idempotency_key import REPLAYED_HEADER, idempotency_key_of
from api.job_listing import JobListing
from api.job_schemas import (
    ErrorDetail,
    JobAccepted,
    JobCanceled,
    JobCreate,
    JobList,
    JobSummary,
    JobTimings,
    JobView,
    PromptTokenLogprob,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from api.job_service import GenerationRequest, choice_sampling, sampling_of
from api.job_stream import JobStream, StreamEvent
from api.openai_logprobs import token_text_of, vllm_prompt_logprobs
from api.sse import EventStreamResponse, sse_comment, sse_event
from api.stream_outages import follow_through_outages
from protocol import JobState, JobStatus, StreamEntry
from protocol.redis_errors import REDIS_UNREACHABLE
from protocol.stream_ids import STREAM_START, entry_id_key, is_entry_id

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], dependencies=[Depends(caller_owner)])

Owner = Annotated[str, Depends(caller_owner)]
Context = Annotated[AppContext, Depends(get_context)]
JobId = Annotated[str, Path(min_length=1, max_length=128, description="The job's id.")]
MAX_WAIT_S = 300.0  # GET /v1/jobs/{id}?wait=: the longest a request may hold its connection

_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorDetail, "description": "Missing or wrong API key."},
    404: {"model": ErrorDetail, "description": "No such job, or another key's job; on submit: "
                                               "no model of that name was ever served here."},
    503: {"model": ErrorDetail, "description": "Redis is unreachable (see Retry-After)."},
}
# The same, spelled out for the stream route: given a model, FastAPI documents an error under the
# route's own media type (text/event-stream), but errors are always JSON.
_STREAM_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"description": error["description"], "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/ErrorDetail"}}}}
    for code, error in _ERRORS.items()
}


# How recent a step notification must be for a stream request to skip its state read: a request
# in the first moments of an outage gets its stream opened and then ended, as a stream opened
# just before it (its client reconnects, and is answered 503).
_HEARD_WITHIN_S = 0.1


@router.post("", status_code=202, response_model=JobAccepted, summary="Submit a generation job",
             responses={**_ERRORS, 422: {"description": "Invalid field (the message names it)."},
                        413: {"model": ErrorDetail, "description": "Body over the size limit."},
                        429: {"model": ErrorDetail, "description": "Queue full (see Retry-After)."}})
async def create_job(body: JobCreate, request: Request, response: Response, owner: Owner,
                     ctx: Context) -> JobAccepted:
    if body.n > ctx.settings.max_n:
        raise InvalidRequestError(f"'n' must be at most {ctx.settings.max_n} (got {body.n})",
                                  param="n")
    sampling = sampling_of(body)
    batch = await ctx.jobs.submit_many([GenerationRequest(
        owner=owner, model=body.model, prompt=body.prompt,
        messages=[m.model_dump() for m in body.messages] if body.messages else None,
        max_tokens=body.max_tokens, sampling=choice_sampling(sampling, choice),
        priority=body.priority, queue_timeout_s=body.queue_timeout_s, deadline_s=body.deadline_s,
        retention_s=body.retention_s, idempotency_key=idempotency_key_of(request.headers),
        input_param="prompt" if body.prompt is not None else "messages",
        webhook_url=body.webhook_url, cache_salt=body.cache_salt,
    ) for choice in range(body.n)])
    accepted = batch[0]
    spec = accepted.spec
    status_url = str(request.url_for("get_job", job_id=spec.job_id))
    response.headers["Location"] = status_url
    status = JobStatus.QUEUED
    if accepted.is_replay:
        response.headers[REPLAYED_HEADER] = "true"
        status = (await ctx.jobs.state(spec.job_id, owner)).status
    return JobAccepted(job_id=spec.job_id, status=status, model=spec.model,
                       priority=spec.priority, prompt_tokens=accepted.prompt_tokens,
                       max_tokens=spec.sampling.max_tokens, status_url=status_url,
                       stream_url=str(request.url_for("stream_job", job_id=spec.job_id)),
                       job_ids=[job.spec.job_id for job in batch] if body.n > 1 else None)


@router.get("", response_model=JobList, summary="Your jobs, newest first",
            responses={**_ERRORS, 422: {"description": "Invalid query parameter."}})
async def list_jobs(
        request: Request, owner: Owner, ctx: Context,
        limit: Annotated[int, Query(ge=1, le=100, description="Jobs per page.")] = 20,
        after: Annotated[str | None, Query(
            min_length=1, max_length=128,
            description="The `next_after` of the previous page.")] = None,
        status: Annotated[JobStatus | None, Query(description="Only jobs of this status.")] = None,
) -> JobList:
    page = await JobListing(ctx.aio, ctx.keys).page(owner, limit, after, status)
    return JobList(data=[JobSummary(
        job_id=state.job_id, status=state.status, model=state.model, created_at=state.created_at,
        finished_at=state.finished_at or None, finish_reason=state.finish_reason,
        completion_tokens=state.completion_tokens,
        status_url=str(request.url_for("get_job", job_id=state.job_id)))
        for state in page.jobs],
        has_more=page.has_more, next_after=page.last_scanned if page.has_more else None)


@router.get("/{job_id}", response_model=JobView, summary="A job's status and text so far",
            responses={**_ERRORS, 422: {"description": "Invalid query parameter."}})
async def get_job(
        job_id: JobId, request: Request, owner: Owner, ctx: Context,
        wait: Annotated[float, Query(
            ge=0, le=MAX_WAIT_S,
            description=f"Seconds (at most {MAX_WAIT_S:g}) to wait for the job to end before "
                        "answering, as rq's and arq's job.result(timeout): the answer is the job "
                        "as it is then, ended or not; 0 answers at once.")] = 0,
) -> JobView:
    seen_at = time.monotonic()  # (before the read: what it shows held from then on)
    state = await ctx.jobs.state(job_id, owner)
    if wait > 0 and not state.status.is_final:
        await _until_ended(ctx.stream(job_id, state), state, seen_at, wait, request)
        state = await ctx.jobs.state(job_id, owner)
    stream = ctx.stream(job_id, state)
    logprobs = None
    if state.status.is_final and (state.text or not state.completion_tokens) and state.logprobs < 0:
        text, num_tokens = state.text, state.completion_tokens
    else:
        tokens = [e.entry for e in await stream.read_all() if e.entry.kind == StreamEntry.TOKEN]
        text, num_tokens = "".join(t.text for t in tokens), len(tokens)
        if state.logprobs >= 0:
            logprobs = [_token_logprob(t) for t in tokens if t.logprobs is not None]
    view = _job_view(state, text, num_tokens, str(request.url_for("stream_job", job_id=job_id)),
                     logprobs)
    if state.prompt_logprobs_asked >= 0:  # one HGET, for the jobs that asked only
        prompt = await ctx.jobs.prompt_logprobs(job_id)
        if prompt is not None:
            token_text = token_text_of(await ctx.jobs.model_tokenizer(state.model))
            formatted = vllm_prompt_logprobs(prompt, state.prompt_logprobs_asked, token_text)
            view.prompt_logprobs = [None if entry is None else
                                    {key: PromptTokenLogprob(**value) for key, value in entry.items()}
                                    for entry in formatted or []]
    return view


async def _until_ended(stream: JobStream, state: JobState, seen_at: float, wait_s: float,
                       request: Request) -> None:
    """Until the job's stream has its final entry, `wait_s` have passed, or the client left;
    reading only what follows the stream's last entry now. `state` was read after `seen_at`
    (monotonic)."""
    last = await stream.last_event()
    if last is not None and last.is_done:
        return
    after = last.entry_id if last is not None else STREAM_START
    fresh_since = seen_at if last is None and not state.first_token_at else None
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(wait_s), \
                aclosing(stream.follow(after, fresh_since)) as events:
            async for event in events:  # (follow ends after the final entry)
                if event is None and await request.is_disconnected():
                    return


@router.get(
    "/{job_id}/stream", summary="Follow a job's tokens (Server-Sent Events)",
    response_class=EventStreamResponse, status_code=200,
    responses={**_STREAM_ERRORS, 200: {"content": {"text/event-stream": {}}, "description": (
        "One `token` event per token (`id` = its stream entry id; data: index, token_id, text, "
        "and logprob and top_logprobs when the job asked for logprobs), "
        "then one `done` event (data: finish_reason, usage, error). Comment lines keep an idle "
        "connection alive. Reconnect with `Last-Event-ID` to get exactly the events after it.")},
        204: {"description": "The Last-Event-ID given is the job's final event: nothing follows."}},
)
async def stream_job(
    job_id: JobId, owner: Owner, ctx: Context,
    last_event_id: Annotated[str | None, Header(
        description="Resume after this event id (what EventSource sends on reconnect).")] = None,
    after: Annotated[str | None, Query(
        description="Same as Last-Event-ID, for clients that cannot set headers.")] = None,
) -> Response:
    seen_at = time.monotonic()  # (before the read: what it shows held from then on)
    resume_from = last_event_id or after or STREAM_START
    # [redis-cost] A job this process just submitted, followed from the start: no state read
    # (it exists, it is the caller's, and it had nothing generated at its submission), as long
    # as Redis was heard serving just now: were it down, the read says 503 before any byte.
    fresh_since = (ctx.jobs.submitted_here(job_id, owner)
                   if resume_from == STREAM_START and ctx.redis_heard_within(_HEARD_WITHIN_S)
                   else None)
    state = None
    if fresh_since is None:
        state = await ctx.jobs.state(job_id, owner)  # 404 before any byte of the stream is sent
    if not is_entry_id(resume_from):
        name, location = ("Last-Event-ID", "header") if last_event_id else ("after", "query")
        raise InvalidRequestError(
            f"'{name}' must be an event id of this stream such as '0-3' (got {resume_from!r})",
            # FastAPI's own errors name a header as it is sent: last-event-id.
            param="last-event-id" if last_event_id else "after", location=location)
    stream = ctx.stream(job_id, state)
    if resume_from != STREAM_START:  # (from the start, some event always follows)
        last = await stream.last_event()
        if last is not None and last.is_done \
                and entry_id_key(last.entry_id) <= entry_id_key(resume_from):
            return Response(status_code=204)  # tells EventSource to stop reconnecting
    if state is not None and not state.status.is_final and not state.first_token_at:
        # Nothing generated yet (the first token writes first_token_at with it): the hub need
        # not read the stream first.
        fresh_since = seen_at
    return EventStreamResponse(_job_events(ctx, stream, resume_from, fresh_since),
                               headers={"X-Carpool-Job-Id": job_id})


@router.delete("/{job_id}", response_model=JobCanceled, summary="Cancel a job",
               responses={**_ERRORS, 202: {"model": JobCanceled, "description": (
                   "The job is running: its worker stops it at its next step.")}})
async def cancel_job(job_id: JobId, owner: Owner, ctx: Context) -> JSONResponse:
    status = await ctx.jobs.cancel(job_id, owner)
    pending = not status.is_final
    body = JobCanceled(job_id=job_id, status=status,
                       canceled=status is JobStatus.CANCELED or pending)
    return JSONResponse(body.model_dump(mode="json"), status_code=202 if pending else 200)


async def _job_events(ctx: AppContext, stream: JobStream, after: str,
                      fresh_since: float | None) -> AsyncIterator[bytes]:
    keepalive_s = ctx.settings.sse_keepalive_s
    last_sent = time.monotonic()
    try:
        async for event in follow_through_outages(stream, ctx.settings.stream_outage_s,
                                                  ctx.recovery, after, fresh_since, keepalive_s):
            if event is None:
                if time.monotonic() - last_sent >= keepalive_s:
                    last_sent = time.monotonic()
                    yield sse_comment()
                continue
            last_sent = time.monotonic()
            yield _sse_for(event)
    except REDIS_UNREACHABLE as exc:
        # Redis stayed out past CARPOOL_STREAM_OUTAGE_S. Ending the response makes an
        # EventSource reconnect with Last-Event-ID: nothing is lost.
        log.warning("Redis lost while streaming job %s: %s", stream.job_id, exc)


def _sse_for(event: StreamEvent) -> bytes:
    entry = event.entry
    if entry.kind == StreamEntry.TOKEN:
        data: dict[str, Any] = {"index": entry.index, "token_id": entry.token_id, "text": entry.text}
        if entry.logprobs is not None:
            data["logprob"] = entry.logprobs.logprob
            data["top_logprobs"] = [{"token_id": token_id, "logprob": logprob}
                                    for token_id, logprob in entry.logprobs.top]
    else:
        data = {
            "finish_reason": entry.finish_reason.value if entry.finish_reason else None,
            "usage": {"prompt_tokens": entry.prompt_tokens,
                      "completion_tokens": entry.completion_tokens,
                      "total_tokens": entry.prompt_tokens + entry.completion_tokens},
            "error": entry.error or None,
        }
    return sse_event(json.dumps(data, ensure_ascii=False), event=entry.kind,
                     event_id=event.entry_id)


def _token_logprob(entry: StreamEntry) -> TokenLogprob:
    assert entry.logprobs is not None
    return TokenLogprob(index=entry.index, token_id=entry.token_id, logprob=entry.logprobs.logprob,
                        top_logprobs=[TopLogprob(token_id=token_id, logprob=logprob)
                                      for token_id, logprob in entry.logprobs.top])


def _job_view(state: JobState, text: str, num_tokens: int, stream_url: str,
              logprobs: list[TokenLogprob] | None = None) -> JobView:
    def at(value: float) -> float | None:
        return value or None

    def since_created(value: float) -> float | None:
        return round(value - state.created_at, 6) if value and state.created_at else None

    usage = None
    if state.status.is_final:
        usage = Usage(prompt_tokens=state.prompt_tokens, completion_tokens=state.completion_tokens,
                      total_tokens=state.prompt_tokens + state.completion_tokens)
    return JobView(
        job_id=state.job_id, status=state.status, model=state.model, text=text,
        num_tokens=num_tokens, finish_reason=state.finish_reason, error=state.error or None,
        usage=usage, num_preemptions=state.num_preemptions, worker=state.worker or None,
        timings=JobTimings(
            created_at=at(state.created_at), started_at=at(state.started_at),
            first_token_at=at(state.first_token_at), finished_at=at(state.finished_at),
            queued_s=since_created(state.started_at),
            time_to_first_token_s=since_created(state.first_token_at),
            e2e_s=since_created(state.finished_at),
            queue_deadline_at=at(state.queue_deadline_at), deadline_at=at(state.deadline_at)),
        stream_url=stream_url,
        logprobs=logprobs,
        prompt_logprobs=None,  # get_job fills them in for a job that asked
    )
