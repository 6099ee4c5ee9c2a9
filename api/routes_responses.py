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

import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Annotated, Any

import redis.exceptions
from fastapi import APIRouter, Depends, Path, Query, Request, Response
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from api.auth import caller_owner
from api.context import AppContext, get_context
from api.deadline_headers import deadlines_of
from api.errors import OPENAI_TAG, InvalidRequestError
from api.idempotency_key import idempotency_key_of
from api.job_service import GenerationRequest
from api.openai_answer import answer_body, logprobs_formatters, wait_for_results
from api.openai_choices import ChoiceJob, cancel_jobs, choice_jobs, job_headers, raise_if_failed
from api.openai_chunks import ChunkWriter
from api.openai_logprobs import LogprobsFormatter
from api.openai_requests import chat_requests, common_fields
from api.openai_schemas import ChatCompletionRequest, OpenAIError
from api.openai_stream import chunk_payloads
from api.responses_conversation import chat_messages, output_messages, with_ids
from api.responses_events import ResponseEvents, response_of, sse_event
from api.responses_schemas import DeletedResponse, InputItemList, ResponseObject, ResponsesRequest
from api.responses_store import StoredResponse
from api.sse import EventStreamResponse, sse_comment
from api.tool_parsers import ToolParser, get_parser
from api.webhook_urls import webhook_url_of

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=[OPENAI_TAG], dependencies=[Depends(caller_owner)])

Owner = Annotated[str, Depends(caller_owner)]
Context = Annotated[AppContext, Depends(get_context)]
ResponseId = Annotated[str, Path(description="The response's id (resp_...).")]

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": OpenAIError, "description": what} for code, what in (
        (400, "Invalid request (the message names the field)."), (401, "Missing or wrong API key."),
        (404, "No such model, or no stored response of that previous_response_id."),
        (413, "Body over the size limit."), (429, "Queue full (see Retry-After)."),
        (500, "The job failed."), (503, "Redis unreachable or no model registered yet."))
}
_STREAM_DOC = {"content": {"text/event-stream": {}},
               "description": "With `stream: true`: the Responses events, from response.created to "
                              "response.completed (or .incomplete / .failed)."}
_NOT_FOUND: dict[int | str, dict[str, Any]] = {
    401: _ERRORS[401],
    404: {"model": OpenAIError, "description": "No stored response of that id (or another key's)."}}
_LIST_ERRORS: dict[int | str, dict[str, Any]] = {
    **_NOT_FOUND, 400: {"model": OpenAIError, "description": "A bad limit, order or after."}}
# Chat-request names in errors, as the Responses request calls them.
_RENAMES = (("response_format.json_schema", "text.format"), ("response_format", "text.format"),
            (".function.", "."), ("'messages'", "'input'"))


@router.post("/responses", response_model=ResponseObject, summary="Create a response (OpenAI)",
             responses={**_ERRORS, 200: _STREAM_DOC})
async def create_response(body: ResponsesRequest, request: Request, owner: Owner,
                          ctx: Context) -> Response:
    history = ((await ctx.responses.get(body.previous_response_id, owner, "previous_response_id"))
               .conversation if body.previous_response_id else [])
    instructions = [{"role": "system", "content": body.instructions}] if body.instructions else []
    given = chat_messages(body.input)
    try:
        chat_body = _chat_body(body, instructions + history + given)
        chat = chat_requests(chat_body, ctx.settings, common_fields(
            chat_body, owner, **deadlines_of(request.headers),
            idempotency_key=idempotency_key_of(request.headers),
            **webhook_url_of(None, request.headers)))
        accepted = await ctx.jobs.submit_many([_named_as_responses(r) for r in chat.requests])
    except InvalidRequestError as exc:
        raise _in_responses_terms(exc) from None
    first = accepted[0].spec
    jobs = choice_jobs(accepted, 1, [""])
    headers = job_headers(accepted)
    parser = get_parser(ctx.settings.tool_parser) if chat.calling.parses_calls else None
    formatters = await logprobs_formatters(ctx, first.model, first.sampling, jobs, True)
    response_id = "resp_" + first.job_id
    created = int(first.created_at)
    base: dict[str, Any] = {
        "id": response_id, "object": "response", "created_at": created, "completed_at": None,
        "status": "in_progress", "background": False, "error": None, "incomplete_details": None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {}, "model": first.model, "output": [],
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id, "store": body.store,
        "temperature": first.sampling.temperature, "text": body.text or {"format": {"type": "text"}},
        "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
        "top_logprobs": body.top_logprobs, "top_p": first.sampling.top_p,
        "truncation": body.truncation or "disabled", "usage": None, "user": body.user}
    if body.tier_served is not None:
        base["service_tier"] = body.tier_served
    message_id = "msg_" + first.job_id

    async def keep(response: dict[str, Any]) -> None:
        if body.store:
            conversation = history + given + output_messages(response["output"])
            await ctx.responses.save(StoredResponse(owner, response, with_ids(body.input),
                                                    conversation))

    if body.stream:
        events = ResponseEvents(base, message_id, body.wants_logprobs)
        writer = ChunkWriter(is_chat=True, response_id=response_id, created=created,
                             model=first.model, include_usage=True)
        return EventStreamResponse(_stream(ctx, jobs, writer, formatters, parser, events, keep),
                                   headers=headers, on_abandon=partial(cancel_jobs, ctx, jobs))
    results = await wait_for_results(ctx, jobs, has_left=request.is_disconnected)
    if results is None:
        return Response(status_code=499, headers=headers)  # the client left; nobody reads this
    await raise_if_failed(ctx, results, headers)
    answer = await answer_body(ctx, chat_body, results, is_chat=True, response_id=response_id,
                               created=created, model=first.model,
                               sampling=first.sampling, formatters=formatters, tool_parser=parser)
    response = response_of(base, answer, message_id, body.wants_logprobs)
    await keep(response)
    return JSONResponse(response, headers=headers)


@router.get("/responses/{response_id}", response_model=ResponseObject,
            summary="A stored response (OpenAI)", responses=_NOT_FOUND)
async def get_response(response_id: ResponseId, owner: Owner, ctx: Context) -> JSONResponse:
    return JSONResponse((await ctx.responses.get(response_id, owner)).response)


@router.delete("/responses/{response_id}", response_model=DeletedResponse,
               summary="Delete a stored response (OpenAI)", responses=_NOT_FOUND)
async def delete_response(response_id: ResponseId, owner: Owner, ctx: Context) -> DeletedResponse:
    await ctx.responses.delete(response_id, owner)
    return DeletedResponse(id=response_id, object="response", deleted=True)


@router.get("/responses/{response_id}/input_items", response_model=InputItemList,
            summary="A stored response's input items (OpenAI)", responses=_LIST_ERRORS)
async def list_input_items(
        response_id: ResponseId, owner: Owner, ctx: Context,
        limit: Annotated[int, Query(ge=1, le=100, description="Items per page.")] = 20,
        order: Annotated[str, Query(pattern="^(asc|desc)$",
                                    description="desc (newest first, OpenAI's default) or asc.")]
        = "desc",
        after: Annotated[str | None, Query(description="List the items after this item id.")]
        = None) -> InputItemList:
    items = (await ctx.responses.get(response_id, owner)).input_items
    if order == "desc":
        items = items[::-1]
    if after is not None:
        position = next((i for i, item in enumerate(items) if item["id"] == after), None)
        if position is None:
            raise InvalidRequestError(f"'after' names no input item of response '{response_id}' "
                                      f"(got {after!r})", param="after", location="query")
        items = items[position + 1:]
    page = items[:limit]
    return InputItemList(object="list", data=page, first_id=page[0]["id"] if page else None,
                         last_id=page[-1]["id"] if page else None, has_more=len(items) > limit)


async def _stream(ctx: AppContext, jobs: list[ChoiceJob], writer: ChunkWriter,
                  formatters: dict[int, LogprobsFormatter], parser: ToolParser | None,
                  events: ResponseEvents,
                  keep: Callable[[dict[str, Any]], Awaitable[None]]) -> AsyncIterator[bytes]:
    for event in events.start():
        yield sse_event(event)
    async for payload in chunk_payloads(ctx, jobs, writer, formatters, None, parser):
        if payload is None:
            yield sse_comment()
            continue
        for event in events.chunk(payload):
            yield sse_event(event)
    closing, response = events.end()
    try:
        await keep(response)
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
        log.warning("could not store response %s: %s", response["id"], exc)
    for event in closing:
        yield sse_event(event)


def _chat_body(body: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request the Responses request means; only the fields it sets are set, so the
    model's generation defaults fill in the same others."""
    fields: dict[str, Any] = {"model": body.model, "messages": messages, "stream": body.stream,
                              "priority": body.queue_priority()}
    if body.stream:
        fields["stream_options"] = {"include_usage": True}
    if body.max_output_tokens is not None:
        fields["max_tokens"] = body.max_output_tokens
    for name in ("temperature", "top_p", "parallel_tool_calls"):
        if getattr(body, name) is not None:
            fields[name] = getattr(body, name)
    if body.tools is not None:
        fields["tools"] = [_chat_tool(tool, number) for number, tool in enumerate(body.tools)]
    if body.tool_choice is not None:
        fields["tool_choice"] = _chat_tool_choice(body.tool_choice)
    text_format = (body.text or {}).get("format")
    if text_format is not None:
        fields["response_format"] = _response_format(text_format)
    if body.wants_logprobs:
        fields["logprobs"] = True
        fields["top_logprobs"] = body.top_logprobs or 0
    effort = (body.reasoning or {}).get("effort")
    if effort is not None:
        fields["chat_template_kwargs"] = {"reasoning_effort": effort}
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        raise InvalidRequestError(f"'input' does not make a valid chat ({where}: {error['msg']})",
                                  param="input") from None


def _chat_tool(tool: Any, number: int) -> dict[str, Any]:
    """A Responses function tool ({type, name, description, parameters, strict}) in the chat
    shape; `strict` needs nothing: arguments always follow the schema's named properties when a
    call is forced (protocol/closed_objects.py)."""
    where = f"tools[{number}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise InvalidRequestError(f"'{where}.type' must be 'function': only function tools are "
                                  f"supported (got {kind!r})", param=f"{where}.type")
    unknown = sorted(set(tool) - {"type", "name", "description", "parameters", "strict"})
    if unknown:
        raise InvalidRequestError(f"'{where}' has unknown keys: {', '.join(unknown)}", param=where)
    return {"type": "function", "function": {
        name: tool[name] for name in ("name", "description", "parameters") if name in tool}}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise InvalidRequestError("'tool_choice' as an object must be {'type': 'function', 'name': "
                                  "...} (the only kind of tool served)", param="tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(text_format: Any) -> dict[str, Any]:
    """text.format in the chat's response_format shape (its checks then apply)."""
    if not isinstance(text_format, dict):
        raise InvalidRequestError("'text.format' must be an object with a 'type'", param="text.format")
    if text_format.get("type") != "json_schema":
        return text_format
    if not isinstance(text_format.get("schema"), dict):  # required here, unlike on chat
        raise InvalidRequestError("'text.format.schema' must be the JSON schema (an object) the "
                                  "output follows", param="text.format.schema")
    schema = {name: text_format[name] for name in ("name", "schema", "strict", "description")
              if name in text_format}
    return {"type": "json_schema", "json_schema": schema}


def _named_as_responses(request: GenerationRequest) -> GenerationRequest:
    """The job service's errors name the client's fields; a max_output_tokens given is not
    capped by the model's default max_tokens, as a chat's max_tokens given is not."""
    explicit = request.explicit_fields
    if explicit is not None and "max_tokens" in explicit:
        explicit = explicit | {"max_output_tokens"}
    return dataclasses.replace(request, input_param="input", max_tokens_param="max_output_tokens",
                               explicit_fields=explicit)


def _in_responses_terms(exc: InvalidRequestError) -> InvalidRequestError:
    message, param = exc.message, exc.param
    for chat_name, name in _RENAMES:
        message = message.replace(chat_name, name)
        param = param.replace(chat_name, name) if param else param
    if param == "messages":
        param = "input"
    return InvalidRequestError(message, param=param, code=exc.code or "invalid_value",
                               location=exc.location)
