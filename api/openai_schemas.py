"""Request and response bodies of the OpenAI-compatible routes, in OpenAI's own field names.

Unknown parameters are refused (as OpenAI does). Known ones this server cannot honour are refused
with a message saying so, unless ignoring them cannot change the result (`user`, `store`, ...):
a silently different completion would be worse than a clear 400.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from api.fields import (
    IgnoreEos,
    MaxTokens,
    NonEmptyText,
    Seed,
    StopStrings,
    Temperature,
    Text,
    TopK,
    TopP,
)
from api.structured_output import StructuredOutputParams
from protocol import Priority


def _unsupported(what: str) -> ValueError:
    # The error handler prefixes "Invalid value for '<field>': ", so `what` names only the limit.
    return ValueError(what)


def _single_prompt(value: Any) -> Any:
    # OpenAI also takes a batch of prompts or token ids; one job is one prompt of text here.
    if isinstance(value, list):
        if len(value) == 1 and isinstance(value[0], str):
            return value[0]
        if value and all(isinstance(v, int) for v in value):
            raise ValueError("prompts given as token ids are not supported; send text")
        raise ValueError(f"a list of {len(value)} prompts is not supported; send one prompt per "
                         "request")
    if value == "":
        raise ValueError("the prompt is empty")
    return value


class TextContentPart(BaseModel):
    """One part of a message's content given as a list (the only kind a text model reads)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text"] = Field(description="Always 'text'.")
    text: str = Field(description="The text.")


def _text_content(value: Any) -> Any:
    # Content may be a list of parts; only text parts mean anything to a text model.
    if isinstance(value, list):
        if not value:
            raise ValueError("content given as a list needs at least one text part")
        texts = []
        for part in value:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text":
                raise ValueError(f"only text content parts are supported (got {kind!r})")
            if not isinstance(part.get("text"), str):
                raise ValueError("a text content part needs a string 'text'")
            texts.append(part["text"])
        return "".join(texts)
    return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")  # e.g. include_obfuscation: no effect on content

    include_usage: bool = Field(False, strict=True,
                                description="Send a last chunk with usage and no choices.")


class _CommonParams(StructuredOutputParams):
    """Parameters shared by /v1/completions and /v1/chat/completions.

    Every number and flag is strict, as in api/fields.py: lax pydantic would take `"store": 0.0`
    for false and `"top_logprobs": 0.0` for 0, accepting what the published schema says is invalid.
    """

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="A model from GET /v1/models; default: the first.")
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    n: int = Field(1, strict=True, description="Number of choices; only 1 is supported.")
    stream: bool = Field(False, strict=True,
                         description="Answer with Server-Sent Events, ending `data: [DONE]`.")
    stream_options: StreamOptions | None = Field(None, description="With stream: include_usage.")
    stop: StopStrings = []
    seed: Seed = None
    presence_penalty: float = Field(0.0, strict=True, description="Only 0 (no penalty) is supported.")
    frequency_penalty: float = Field(0.0, strict=True,
                                     description="Only 0 (no penalty) is supported.")
    logit_bias: dict[str, float] | None = Field(None, description="Not supported (must be empty).")
    user: str | None = Field(None, description="Accepted and ignored.")
    # Extensions (vLLM users know top_k and ignore_eos; pass them in extra_body).
    top_k: TopK = 0
    ignore_eos: IgnoreEos = False
    priority: Priority = Field(Priority.NORMAL, description="Carpool queue: high, normal or low.")

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int) -> int:
        if value != 1:
            raise _unsupported(f"only n = 1 is accepted, one choice per request; got {value}")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float) -> float:
        if value != 0:
            raise _unsupported(f"only 0 is accepted (no penalty); got {value}")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise _unsupported("only an empty logit_bias is accepted")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_CommonParams):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 32, "temperature": 0.7},
    ]})

    prompt: Annotated[NonEmptyText, BeforeValidator(_single_prompt), Field(
        description="The text to continue (one prompt).")]
    max_tokens: MaxTokens = 16
    suffix: str | None = Field(None, description="Not supported (insertion).")
    echo: bool = Field(False, strict=True, description="Only false is supported.")
    logprobs: int | None = Field(None, strict=True, description="Not supported.")
    best_of: int | None = Field(None, strict=True, description="Only 1 is supported.")

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise _unsupported("a suffix (text insertion) is not accepted")
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise _unsupported("only echo = false is accepted")
        return value

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: int | None) -> int | None:
        if value is not None:
            raise _unsupported("log probabilities are not available")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_one(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise _unsupported(f"only best_of = 1 is accepted; got {value}")
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"] = Field(
        description="developer is treated as system.")
    # The documented input is what _text_content takes, so the OpenAPI spec admits exactly that.
    content: Annotated[Text, BeforeValidator(
        _text_content, json_schema_input_type=Text | Annotated[list[TextContentPart], Field(min_length=1)]),
        Field(description="Text, or a list of text parts.")]
    name: str | None = Field(None, description="Accepted and ignored.")


class ChatCompletionRequest(_CommonParams):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"model": "smollm2", "messages": [{"role": "user", "content": "What is 2+2?"}],
         "max_tokens": 64, "stream": True, "stream_options": {"include_usage": True}},
    ]})

    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far.")
    max_tokens: MaxTokens | None = Field(
        None, description="Most tokens to generate; default: what the context leaves.")
    max_completion_tokens: MaxTokens | None = Field(None, description="Newer name of max_tokens.")
    logprobs: bool | None = Field(None, strict=True, description="Only false is supported.")
    top_logprobs: int | None = Field(None, strict=True, description="Not supported.")
    tools: list[dict[str, Any]] | None = Field(None, description="Not supported (must be empty).")
    tool_choice: str | dict[str, Any] | None = Field(None, description="Only 'none'.")
    parallel_tool_calls: bool | None = Field(None, strict=True,
                                             description="Accepted and ignored (no tools).")
    store: bool | None = Field(None, strict=True, description="Accepted and ignored.")
    metadata: dict[str, str] | None = Field(None, description="Accepted and ignored.")

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: bool | None) -> bool | None:
        if value:
            raise _unsupported("log probabilities are not available")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, value: int | None) -> int | None:
        if value:
            raise _unsupported("log probabilities are not available")
        return value

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        if value:
            raise _unsupported("tool calling is not available")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _no_tool_choice(cls, value: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if value is not None and value != "none":
            raise _unsupported("tool calling is not available; only 'none' is accepted")
        return value

    @property
    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


# Responses (documented at /docs; streaming chunks have the same fields as in OpenAI's API).
class CompletionUsage(BaseModel):
    prompt_tokens: int = Field(description="Tokens of the prompt (after the chat template).")
    completion_tokens: int = Field(description="Tokens generated.")
    total_tokens: int = Field(description="The two together.")


class CompletionChoice(BaseModel):
    index: int = Field(0, description="Always 0 (one choice).")
    text: str = Field(description="The generated text.")
    logprobs: None = Field(None, description="Always null.")
    finish_reason: str | None = Field(description="stop, length, or abort (canceled).")


class Completion(BaseModel):
    id: str = Field(description="cmpl-<job id>; the job id is also in the X-Carpool-Job-Id header.")
    object: Literal["text_completion"] = Field("text_completion", description="The kind of object.")
    created: int = Field(description="Submission time, seconds since the epoch.")
    model: str = Field(description="The model that ran it.")
    choices: list[CompletionChoice] = Field(description="One choice.")
    usage: CompletionUsage = Field(description="Token counts.")


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = Field("assistant", description="Always assistant.")
    content: str = Field(description="The generated text.")


class ChatChoice(BaseModel):
    index: int = Field(0, description="Always 0 (one choice).")
    message: AssistantMessage = Field(description="The model's answer.")
    logprobs: None = Field(None, description="Always null.")
    finish_reason: str | None = Field(description="stop, length, or abort (canceled).")


class ChatCompletion(BaseModel):
    id: str = Field(description="chatcmpl-<job id>; the job id is also in X-Carpool-Job-Id.")
    object: Literal["chat.completion"] = Field("chat.completion", description="The kind of object.")
    created: int = Field(description="Submission time, seconds since the epoch.")
    model: str = Field(description="The model that ran it.")
    choices: list[ChatChoice] = Field(description="One choice.")
    usage: CompletionUsage = Field(description="Token counts.")


class ModelObject(BaseModel):
    id: str = Field(description="The name to pass as `model`.")
    object: Literal["model"] = Field(default="model", description="The kind of object.")
    created: int = Field(description="When a worker registered it, seconds since the epoch.")
    owned_by: str = Field(default="carpool", description="Always carpool.")
    max_model_len: int = Field(description="Context length in tokens (as vLLM reports it).")


class ModelList(BaseModel):
    object: Literal["list"] = Field(default="list", description="The kind of object.")
    data: list[ModelObject] = Field(description="Models the workers serve, the default first.")


class OpenAIErrorBody(BaseModel):
    message: str = Field(description="What went wrong, naming the field and the limit.")
    type: str = Field(description="invalid_request_error, rate_limit_error or server_error.")
    param: str | None = Field(description="The request field at fault, if one is.")
    code: str | None = Field(description="A stable code, e.g. invalid_value, model_not_found.")


class OpenAIError(BaseModel):
    error: OpenAIErrorBody = Field(description="OpenAI's error shape.")
