"""A Responses request as the one chat completion job that runs it, and the response object that
job's end answers with: shared by POST /v1/responses and the Batch API's /v1/responses lines.

The request's input (after `instructions`, and after the stored chat that previous_response_id
names) becomes chat messages (api/responses_conversation.py) and its fields the chat request's,
so the chat route's checks, the job service and the chat answer apply unchanged; their errors
are renamed into the Responses request's own field names.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from api.context import AppContext
from api.conversation_turns import add_turn
from api.errors import InvalidRequestError
from api.job_service import AcceptedJob, GenerationRequest
from api.openai_answer import answer_body, logprobs_formatters, wait_for_results
from api.openai_choices import ChoiceJob, ChoiceResult
from api.openai_logprobs import LogprobsFormatter
from api.openai_requests import chat_requests, common_fields
from api.openai_schemas import ChatCompletionRequest
from api.responses_conversation import chat_messages, output_messages, with_ids
from api.responses_events import response_of
from api.responses_schemas import VLLM_RESPONSES_EXTRAS, ResponsesRequest
from api.responses_store import StoredResponse
from api.tool_parsers import ToolParser, get_parser
from protocol import JobState, SamplingParams

# Chat-request names in errors, as the Responses request calls them.
_RENAMES = (("response_format.json_schema", "text.format"), ("response_format", "text.format"),
            (".function.", "."), ("'messages'", "'input'"))


@dataclass(frozen=True, slots=True)
class SubmittedResponse:
    """A Responses request queued as its chat completion job."""

    chat_body: ChatCompletionRequest
    parses_calls: bool  # its tools' calls are parsed out of the text
    accepted: list[AcceptedJob]
    history: list[dict[str, Any]]  # the stored chat it continues (previous_response_id)
    given: list[dict[str, Any]]  # its input, as chat messages


async def submit_response(ctx: AppContext, body: ResponsesRequest, owner: str,
                          history: list[dict[str, Any]], **extra: Any) -> SubmittedResponse:
    """Queue the job that runs `body` after `history` (the chat previous_response_id names);
    `extra`: common_fields' (deadlines, the idempotency key, the webhook, a priority other than
    the body's). A 400 in the Responses request's names for what the chat's checks refuse."""
    given = chat_messages(body.input)
    try:
        chat_body = chat_body_of(body, given, history)
        chat = chat_requests(chat_body, ctx.settings, common_fields(chat_body, owner, **extra))
        accepted = await ctx.jobs.submit_many([_named_as_responses(r) for r in chat.requests])
    except InvalidRequestError as exc:
        raise _in_responses_terms(exc) from None
    return SubmittedResponse(chat_body, chat.calling.parses_calls, accepted, history, given)


async def input_tokens(ctx: AppContext, body: ResponsesRequest, owner: str,
                       history: list[dict[str, Any]], given: list[dict[str, Any]]) -> int:
    """The prompt tokens of the job `body` would be queued as (after `history`, with `given` as
    its input): what its usage would report as input_tokens."""
    try:
        chat_body = chat_body_of(body, given, history)
        chat = chat_requests(chat_body, ctx.settings, common_fields(chat_body, owner))
        return await ctx.jobs.prompt_tokens(_named_as_responses(chat.requests[0]))
    except InvalidRequestError as exc:
        raise _in_responses_terms(exc) from None


@dataclass(frozen=True, slots=True)
class JobReading:
    """What reading a response's job after its request (a batch line, a background response)
    takes, rebuilt from the request as chat_requests made it: its sampling and tool parsing, the
    choice that follows the job, its logprobs formatters, and the response as created."""

    sampling: SamplingParams
    parser: ToolParser | None
    jobs: list[ChoiceJob]
    formatters: dict[int, LogprobsFormatter]
    base: dict[str, Any]


async def job_reading(ctx: AppContext, body: ResponsesRequest, state: JobState) -> JobReading:
    """How to read the job `state` describes (as its caller read it) as `body`'s response. The
    chat rebuilt is the request's own input: its sampling and tools do not depend on the chat it
    continued."""
    chat_body = chat_body_of(body, chat_messages(body.input), [])
    chat = chat_requests(chat_body, ctx.settings, common_fields(chat_body, ""))
    sampling = chat.requests[0].sampling
    jobs = [ChoiceJob(index=0, prompt_number=0, job_id=state.job_id, echo="",
                      prompt_tokens=state.prompt_tokens)]
    formatters = await logprobs_formatters(ctx, state.model, sampling, jobs, True)
    parser = get_parser(ctx.settings.tool_parser) if chat.calling.parses_calls else None
    base = response_base(body, state.job_id, int(state.created_at), state.model, sampling)
    return JobReading(sampling, parser, jobs, formatters, base)


async def ended_response(ctx: AppContext, body: ResponsesRequest, state: JobState,
                         history: list[dict[str, Any]],
                         given: list[dict[str, Any]]) -> dict[str, Any]:
    """The response object of a job that ended without failing (`state`: its state, as its
    caller read it), answered later than its request (a batch line, a background response)."""
    reading = await job_reading(ctx, body, state)
    results = await wait_for_results(ctx, reading.jobs)  # ended: its stream ends at once
    assert results is not None  # (None only for a client that left)
    return await whole_response(ctx, body, chat_body_of(body, given, history), results,
                                reading.base, reading.sampling, reading.formatters,
                                reading.parser)


def response_base(body: ResponsesRequest, job_id: str, created: int, model: str,
                  sampling: SamplingParams) -> dict[str, Any]:
    """The response object as created (in progress, no output yet)."""
    base: dict[str, Any] = {
        "id": "resp_" + job_id, "object": "response", "created_at": created, "completed_at": None,
        "status": "in_progress", "background": bool(body.background), "error": None,
        "incomplete_details": None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {}, "model": model, "output": [],
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id, "store": body.store,
        "temperature": sampling.temperature, "text": body.text or {"format": {"type": "text"}},
        "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
        "top_logprobs": body.top_logprobs, "top_p": sampling.top_p,
        "truncation": body.truncation or "disabled", "usage": None, "user": body.user}
    if body.tier_served is not None:
        base["service_tier"] = body.tier_served
    if body.conversation is not None:
        base["conversation"] = {"id": body.conversation}
    return base


def message_id_of(job_id: str) -> str:
    return "msg_" + job_id


async def whole_response(ctx: AppContext, body: ResponsesRequest, chat_body: ChatCompletionRequest,
                         results: list[ChoiceResult], base: dict[str, Any],
                         sampling: SamplingParams, formatters: dict[int, LogprobsFormatter],
                         parser: ToolParser | None) -> dict[str, Any]:
    """The finished response object of a job that ended (and did not fail)."""
    answer = await answer_body(ctx, chat_body, results, is_chat=True, response_id=base["id"],
                               created=base["created_at"], model=base["model"],
                               sampling=sampling, formatters=formatters, tool_parser=parser)
    return response_of(base, answer, message_id_of(results[0].job.job_id), body.wants_logprobs)


async def keep_response(ctx: AppContext, owner: str, body: ResponsesRequest,
                        history: list[dict[str, Any]], given: list[dict[str, Any]],
                        response: dict[str, Any]) -> None:
    """Store the response (with `store`, the default): itself, its input items, and the chat a
    response naming it as previous_response_id continues (without this one's instructions); and
    add its turn to the conversation it names, if any."""
    input_items = with_ids(body.input)
    if body.store:
        conversation = history + given + output_messages(response["output"])
        await ctx.responses.save(StoredResponse(owner, response, input_items, conversation))
    await add_turn(ctx, body.conversation, input_items, response)


def chat_body_of(body: ResponsesRequest, given: list[dict[str, Any]],
                 history: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request the Responses request means: its instructions, the chat it continues,
    its input (`given`, as chat messages); only the fields it sets are set, so the model's
    generation defaults fill in the same others."""
    instructions = [{"role": "system", "content": body.instructions}] if body.instructions else []
    messages = instructions + history + given
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
    for name in VLLM_RESPONSES_EXTRAS:
        if name in body.model_fields_set:
            fields[name] = getattr(body, name)
    effort = (body.reasoning or {}).get("effort")
    if effort is not None:
        fields["chat_template_kwargs"] = {**(body.chat_template_kwargs or {}),
                                          "reasoning_effort": effort}
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
