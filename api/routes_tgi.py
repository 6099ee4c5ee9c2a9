"""Hugging Face Text Generation Inference's own routes: `POST /generate`, `POST /generate_stream`,
`POST /` (either, by its `stream` field) and `GET /info`, for clients written against TGI
(huggingface_hub's `InferenceClient(base_url).text_generation`, the `text-generation` package).

They submit ordinary Carpool jobs, as the OpenAI routes do, and answer in TGI's shapes, errors
included (`{"error", "error_type"}`, 422 for a bad request). A client that leaves has its jobs
canceled.
"""

from __future__ import annotations

from functools import partial
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse

from api.auth import caller_owner
from api.context import AppContext, get_context
from api.deadline_headers import deadlines_of
from api.errors import TGI_TAG, InvalidRequestError
from api.idempotency_key import idempotency_key_of
from api.openai_answer import wait_for_results
from api.openai_choices import ChoiceJob, cancel_jobs, choice_jobs, job_headers, raise_if_failed
from api.settings import ApiSettings
from api.sse import EventStreamResponse
from api.tgi_answer import TokenViews, generate_response, stream_events
from api.tgi_requests import generation_requests
from api.tgi_schemas import GenerateRequest, GenerateResponse, Info, TGIError
from api.version import package_version
from protocol.generation import MAX_STOP_STRINGS

router = APIRouter(tags=[TGI_TAG], dependencies=[Depends(caller_owner)])

Owner = Annotated[str, Depends(caller_owner)]
Context = Annotated[AppContext, Depends(get_context)]

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": TGIError, "description": description} for status, description in (
        (401, "Missing or wrong API key."), (404, "No model of that name is served."),
        (413, "Body over the size limit."), (422, "Invalid request (the message names the field)."),
        (424, "The job failed."), (429, "Queue full (see Retry-After)."),
        (503, "Redis unreachable or no model registered yet (see Retry-After)."))}
_STREAM = {"content": {"text/event-stream": {}},
           "description": "`data:` events, one a token (StreamResponse: index, token, top_tokens, "
                          "generated_text, details); the last has `generated_text` and `details`; "
                          "a failure is an event with `error` and `error_type`."}


@router.post("/generate", response_model=GenerateResponse, summary="Generate (TGI)",
             responses=_ERRORS)
async def generate(body: GenerateRequest, request: Request, owner: Owner, ctx: Context) -> Response:
    if body.stream:
        raise InvalidRequestError("'stream': true is served by /generate_stream (or POST /)",
                                  param="stream")
    return await _whole(ctx, request, body, owner, as_list=False)


@router.post("/generate_stream", summary="Generate, token by token as Server-Sent Events (TGI)",
             responses={**_ERRORS, 200: _STREAM})
async def generate_stream(body: GenerateRequest, request: Request, owner: Owner,
                          ctx: Context) -> Response:
    return await _streamed(ctx, request, body, owner)


@router.post("/", summary="Generate, streamed with `stream: true` (TGI's compatible route)",
             responses={**_ERRORS, 200: {
                 "content": {"application/json": {"schema": {
                     "type": "array", "items": {"$ref": "#/components/schemas/GenerateResponse"}}}},
                 "description": "A list of one GenerateResponse; with `stream: true` the events "
                                "of /generate_stream."}})
async def compat_generate(body: GenerateRequest, request: Request, owner: Owner,
                          ctx: Context) -> Response:
    if body.stream:
        return await _streamed(ctx, request, body, owner)
    return await _whole(ctx, request, body, owner, as_list=True)


@router.get("/info", response_model=Info, summary="The served model and limits (TGI)",
            responses={401: _ERRORS[401], 503: _ERRORS[503]})
async def info(ctx: Context) -> Info:
    card = await ctx.models.resolve(None)
    settings: ApiSettings = ctx.settings
    return Info(model_id=card.name, model_pipeline_tag="text-generation",
                max_concurrent_requests=settings.max_queue_depth, max_best_of=settings.max_n,
                max_stop_sequences=MAX_STOP_STRINGS, max_input_tokens=card.max_model_len - 1,
                max_total_tokens=card.max_model_len, validation_workers=1,
                max_client_batch_size=1, router="carpool", version=package_version(),
                model_sha=None, sha=None, docker_label=None)


async def _submit(ctx: AppContext, request: Request, body: GenerateRequest, owner: str,
                  streaming: bool) -> tuple[list[ChoiceJob], dict[str, str], TokenViews,
                                            list[int | None]]:
    requests = generation_requests(body, ctx.settings, streaming=streaming, owner=owner,
                                   **deadlines_of(request.headers),
                                   idempotency_key=idempotency_key_of(request.headers))
    accepted = await ctx.jobs.submit_many(requests)
    jobs = choice_jobs(accepted, len(accepted), [""] * len(accepted))
    views = TokenViews(await ctx.jobs.model_tokenizer(accepted[0].spec.model))
    return jobs, job_headers(accepted), views, [job.spec.sampling.seed for job in accepted]


async def _whole(ctx: AppContext, request: Request, body: GenerateRequest, owner: str,
                 as_list: bool) -> Response:
    jobs, headers, views, seeds = await _submit(ctx, request, body, owner, streaming=False)
    results = await wait_for_results(ctx, jobs, has_left=request.is_disconnected)
    if results is None:
        return Response(status_code=499, headers=headers)  # the client left; nobody reads this
    await raise_if_failed(ctx, results, headers)
    answer = await generate_response(ctx, body.parameters, results, views, seeds, body.inputs)
    return JSONResponse([answer] if as_list else answer, headers=headers)


async def _streamed(ctx: AppContext, request: Request, body: GenerateRequest,
                    owner: str) -> Response:
    jobs, headers, views, seeds = await _submit(ctx, request, body, owner, streaming=True)
    return EventStreamResponse(
        stream_events(ctx, jobs[0], body.parameters, views, seeds[0], body.inputs),
        headers=headers, on_abandon=partial(cancel_jobs, ctx, jobs))
