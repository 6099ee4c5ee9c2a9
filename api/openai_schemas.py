"""Request and response bodies of the OpenAI-compatible routes, in OpenAI's own field names.

Unknown parameters are refused (as OpenAI does). Known ones this server cannot honour are refused
with a message saying so, unless ignoring them cannot change the result (`user`,
`safety_identifier`, ...): a silently different completion would be worse than a clear 400.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from api.chat_template import RESERVED_TEMPLATE_VARIABLES
from api.errors import InvalidRequestError
from api.fields import (
    LOGPROBS_DISTRIBUTION,
    AllowedTokenIds,
    BadWords,
    CompletionMaxTokens,
    IncludeReasoning,
    MaxTokens,
    Metadata,
    MinTokens,
    NonEmptyText,
    ParallelToolCalls,
    Temperature,
    Text,
    TopP,
    TruncatePromptTokens,
    TypicalP,
    WebhookUrl,
)
from api.nullable_fields import NullMeansLeftOut
from api.sampling_fields import SharedSamplingFields
from api.serving_fields import ServingFields
from api.structured_output import StructuredOutputParams
from protocol import Priority


def vllm_priority(value: Any) -> Any:
    """vLLM's priority is an int, lower first (0 by default): its sign picks the tier."""
    if isinstance(value, int) and not isinstance(value, bool):
        return Priority.HIGH if value < 0 else Priority.NORMAL if value == 0 else Priority.LOW
    return value


def _unsupported(what: str) -> ValueError:
    # The error handler prefixes "Invalid value for '<field>': ", so `what` names only the limit.
    return ValueError(what)


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _prompts(value: Any) -> Any:
    """OpenAI's four prompt forms (text, texts, token ids, lists of token ids) as one list of
    prompts, each text or token ids; whether ids are in the vocabulary is the job service's check."""
    if isinstance(value, str):
        value = [value]
    elif isinstance(value, list) and value and all(_is_token_id(v) for v in value):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ValueError("give text, a list of texts, a list of token ids or a list of such lists")
    for number, prompt in enumerate(value):
        where = "" if len(value) == 1 else f"prompt {number}: "
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"{where}the prompt is empty")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as exc:  # JSON may carry a lone surrogate ("\\ud800")
                raise ValueError(f"{where}the prompt is not a valid unicode string (it holds an "
                                 "unpaired surrogate)") from exc
        elif isinstance(prompt, list):
            if not prompt:
                raise ValueError(f"{where}the list of token ids is empty")
            bad = next((v for v in prompt if not _is_token_id(v) or v < 0), None)
            if bad is not None or not all(_is_token_id(v) for v in prompt):
                raise ValueError(f"{where}token ids must be non-negative ints (got {bad!r})")
        else:
            raise ValueError(f"{where}a prompt is text or a list of token ids "
                             f"(got {type(prompt).__name__})")
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
    continuous_usage_stats: bool = Field(
        False, strict=True, description="vLLM's: usage so far on every chunk (with include_usage).")


# stream_interval's bound: past this a stream is a whole answer sent late (use stream: false).
MAX_STREAM_INTERVAL = 1024


class _CommonParams(NullMeansLeftOut, StructuredOutputParams, SharedSamplingFields):
    """Parameters shared by /v1/completions and /v1/chat/completions.

    Every number and flag is strict, as in api/fields.py: lax pydantic would take `"store": 0.0`
    for false and `"top_logprobs": 0.0` for 0, accepting what the published schema says is invalid.
    """

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="A model from GET /v1/models; default: the first.")
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    n: int = Field(1, strict=True, ge=1,
                   description="Choices per prompt, each its own job (at most the server's max_n).")
    stream: bool = Field(False, strict=True,
                         description="Answer with Server-Sent Events, ending `data: [DONE]`.")
    stream_options: StreamOptions | None = Field(None, description="With stream: include_usage.")
    user: str | None = Field(None, description="Accepted and ignored.")
    # Extensions, as vLLM has them (the openai client passes them in extra_body).
    typical_p: TypicalP = 1.0
    allowed_token_ids: AllowedTokenIds = None
    bad_words: BadWords = []
    min_tokens: MinTokens = 0
    truncate_prompt_tokens: TruncatePromptTokens = None
    prompt_logprobs: int | None = Field(
        None, strict=True, ge=0,
        description="vLLM's: each prompt token's log-probability given the ones before it and the "
                    "this many most likely there (raw model distribution; capped by the server's "
                    "max_logprobs), as a `prompt_logprobs` list (first entry null). Not with stream.")
    truncation_side: Literal["left", "right"] | None = Field(
        None, description="vLLM's: which end truncate_prompt_tokens cuts: left keeps the prompt's "
                          "last k tokens (the default, as vLLM's for generation), right its first k.")
    return_token_ids: bool | None = Field(
        None, strict=True,
        description="vLLM's: also the token ids: the prompt's as the model saw them "
                    "(`prompt_token_ids`) and each choice's generated ones (`token_ids`); "
                    "streamed, each chunk's new ids, the prompt's on the first chunk.")
    return_tokens_as_token_ids: bool | None = Field(
        None, strict=True,
        description="vLLM's: logprobs name tokens as 'token_id:<id>' instead of their text (a "
                    "token that is part of a character stays distinct).")
    stream_interval: int | None = Field(
        None, strict=True, ge=1, le=MAX_STREAM_INTERVAL,
        description="vLLM's: with stream, the tokens each chunk gathers: a choice's first token "
                    "and its end go out at once, the rest every this many tokens. Ignored "
                    "without stream.")
    spaces_between_special_tokens: bool = Field(
        True, strict=True,
        description="vLLM's: accepted; no effect here: the served tokenizers are fast (Rust) "
                    "ones, which write special tokens as their text without added spaces.")
    # vLLM's beam-search fields, which clients written for vLLM send at their defaults.
    use_beam_search: bool = Field(False, strict=True,
                                  description="vLLM's: only false; beam search is not served.")
    length_penalty: float = Field(
        1.0, strict=True, allow_inf_nan=False,
        description="vLLM's: accepted; it weighs beam search's candidates only, so it changes "
                    "nothing here (as in vLLM without use_beam_search).")
    priority: Annotated[Priority, BeforeValidator(
        vllm_priority, json_schema_input_type=Priority | int)] = Field(
        Priority.NORMAL,
        description="Carpool queue: high, normal, low or batch (idle seats); or vLLM's integer "
                    "(lower is served first): below 0 high, 0 normal, above 0 low.")
    webhook_url: WebhookUrl = None  # or the X-Carpool-Webhook-Url header
    if TYPE_CHECKING:  # each route has its own default (vLLM's: completions true, chat false)
        add_special_tokens: bool

    @field_validator("use_beam_search")
    @classmethod
    def _no_beam_search(cls, value: bool) -> bool:
        if value:
            raise _unsupported("beam search is not served; leave it out or send false")
        return value

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs_not_streamed(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("stream"):
            raise _unsupported("prompt_logprobs are not available with stream: true (as in vLLM)")
        return value

    def prompt_ids_param(self) -> str | None:
        """The field that needs the prompt's token ids decided by the API rather than the worker
        (None: none does): the worker tokenizes as the route's add_special_tokens default says
        and truncates on the left, and return_token_ids shows the ids, which must be exactly
        those the model runs."""
        if self.return_token_ids:
            return "return_token_ids"
        usual = type(self).model_fields["add_special_tokens"].default
        if self.add_special_tokens != usual:
            return "add_special_tokens"
        if self.truncation_side == "right" and self.truncate_prompt_tokens is not None:
            return "truncation_side"
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options
                                           and self.stream_options.continuous_usage_stats)


class CompletionRequest(_CommonParams):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 32, "temperature": 0.7},
    ]})

    prompt: Annotated[list[NonEmptyText | list[int]], BeforeValidator(
        _prompts, json_schema_input_type=NonEmptyText | list[NonEmptyText] | list[int]
        | list[list[int]]), Field(
        description="Text, a list of texts, token ids, or a list of token-id lists: n choices "
                    "for each prompt, numbered prompt * n + choice.")]
    max_tokens: CompletionMaxTokens = 16
    suffix: str | None = Field(None, description="Not supported (insertion).")
    echo: bool = Field(False, strict=True, description="Put the prompt before each completion.")
    add_special_tokens: bool = Field(
        True, strict=True,
        description="vLLM's: a text prompt is tokenized with the tokenizer's special tokens "
                    "(BOS...); false leaves them out. Token-id prompts are taken as given.")
    logprobs: int | None = Field(
        None, strict=True, ge=0,
        description="Log-probabilities of each generated token and of the `logprobs` most likely "
                    "tokens at its position (capped by the server's max_logprobs). "
                    + LOGPROBS_DISTRIBUTION)
    best_of: int | None = Field(None, strict=True, description="Only 1 is supported.")

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise _unsupported("a suffix (text insertion) is not accepted")
        return value

    @property
    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: how many alternatives per token (None: no logprobs)."""
        return self.logprobs

    @property
    def scores_prompt(self) -> bool:
        """echo with max_tokens 0 (OpenAI's legacy API, vLLM's echo_without_generation): each
        choice is its prompt alone, with the prompt's logprobs when asked. The job generates one
        token to get them; that token is counted in usage (as vLLM counts it), never shown."""
        return self.echo and self.max_tokens == 0

    @field_validator("best_of")
    @classmethod
    def _best_of_one(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise _unsupported(f"only best_of = 1 is accepted; got {value}")
        return value


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="The function called.")
    arguments: str = Field(description="Its arguments, as JSON text.")


class HistoryToolCall(BaseModel):
    """A tool call the assistant made earlier in the conversation."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(description="The call's id, which the tool message answering it names.")
    type: Literal["function"] = Field(description="Always 'function'.")
    function: ToolCallFunction = Field(description="The name and the arguments (JSON text).")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="developer is treated as system; tool carries a tool call's result.")
    # The documented input is what _text_content takes, so the OpenAPI spec admits exactly that.
    content: Annotated[Text | None, BeforeValidator(
        _text_content, json_schema_input_type=Text | Annotated[list[TextContentPart], Field(min_length=1)]
        | None), Field(description="Text, or a list of text parts (null: an assistant message "
                                   "with tool_calls).")] = None
    name: str | None = Field(None, description="Accepted and ignored.")
    tool_calls: list[HistoryToolCall] | None = Field(
        None, description="An assistant message's tool calls.")
    tool_call_id: str | None = Field(None, description="A tool message: the call it answers.")

    @model_validator(mode="after")
    def _content_where_needed(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("only tool messages carry tool_call_id")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content may be null only in an assistant message with tool_calls")
        return self


def _check_template_kwargs(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """chat_template_kwargs may add variables, not set those the request itself sets."""
    for name in value or {}:
        if name in RESERVED_TEMPLATE_VARIABLES:
            raise _unsupported(f"'{name}' is set by the request itself (messages, tools, "
                               "add_generation_prompt...), not by chat_template_kwargs")
    return value


# vLLM's chat_template_kwargs, on chat, /tokenize and Responses.
TemplateKwargs = Annotated[dict[str, Any] | None, AfterValidator(_check_template_kwargs)]


class ChatRenderingParams(BaseModel):
    """vLLM's fields for how a chat becomes the prompt (chat completions and /tokenize)."""

    add_generation_prompt: bool = Field(
        True, strict=True, description="vLLM's: end the prompt with the assistant's turn opened.")
    continue_final_message: bool = Field(
        False, strict=True,
        description="vLLM's: end the prompt inside the last message, which the model continues "
                    "(an assistant's answer begun: prefill); no new turn is opened.")

    chat_template_kwargs: TemplateKwargs = Field(
        None, description="vLLM's: more variables for the model's chat template (e.g. Qwen3's "
                          "enable_thinking); those the template does not read are ignored.")

    def rendering(self) -> tuple[bool, bool]:
        """(add_generation_prompt, continue_final_message). Continuing the last message leaves
        no turn to open: add_generation_prompt is false then unless the client said true, which
        vLLM refuses too."""
        if not self.continue_final_message:
            return self.add_generation_prompt, False
        if self.add_generation_prompt and "add_generation_prompt" in self.model_fields_set:
            raise InvalidRequestError(
                "'continue_final_message' ends the prompt inside the last message, so "
                "'add_generation_prompt' (a new assistant turn after it) must be false",
                param="continue_final_message")
        return False, True


class PredictedContent(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["content"] = Field(description="Always content.")
    content: Text | list[TextContentPart] = Field(description="The text the answer is expected "
                                                              "to resemble, or its text parts.")


def not_served(what: str) -> Any:
    """A validator refusing any value but null, with `what` saying why and what to send."""
    def refuse(value: Any) -> Any:
        if value is not None:
            raise _unsupported(what)
        return value
    return BeforeValidator(refuse)


class ChatCompletionRequest(_CommonParams, ChatRenderingParams, ServingFields):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"model": "smollm2", "messages": [{"role": "user", "content": "What is 2+2?"}],
         "max_tokens": 64, "stream": True, "stream_options": {"include_usage": True}},
    ]})

    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far.")
    max_tokens: MaxTokens | None = Field(
        None, description="Most tokens to generate; default: what the context leaves.")
    max_completion_tokens: MaxTokens | None = Field(None, description="Newer name of max_tokens.")
    logprobs: bool | None = Field(
        None, strict=True,
        description="Return the log-probability of each generated token. " + LOGPROBS_DISTRIBUTION)
    top_logprobs: int | None = Field(
        None, strict=True, ge=0,
        description="With logprobs: also the this many most likely tokens at each position "
                    "(capped by the server's max_logprobs).")
    echo: bool = Field(
        False, strict=True,
        description="vLLM's extension: when the last message is the assistant's, put its content "
                    "before the reply (a continued message reads whole).")
    add_special_tokens: bool = Field(
        False, strict=True,
        description="vLLM's: also add the tokenizer's special tokens (BOS...) to the rendered "
                    "chat; default false, as the chat template writes them itself.")
    include_reasoning: IncludeReasoning = True
    tools: list[dict[str, Any]] | None = Field(
        None, description="Functions the model may call: {'type': 'function', 'function': {'name', "
                          "'description', 'parameters' (a JSON schema)}}.")
    tool_choice: str | dict[str, Any] | None = Field(
        None, description="none, auto (default with tools), required, or {'type': 'function', "
                          "'function': {'name': ...}}; required and named are enforced by a grammar.")
    parallel_tool_calls: ParallelToolCalls = None
    store: bool | None = Field(
        None, strict=True,
        description="true: keep the completion (its answer, metadata and messages) for the "
                    "server's result retention, for GET /v1/chat/completions and its routes. "
                    "Default false, as OpenAI's.")
    metadata: Annotated[Metadata, Field(
        description="Up to 16 key-value pairs (keys up to 64 characters, values up to 512) kept "
                    "with a stored completion (store: true), which listings filter by.")] = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = (
        Field(None, description="Goes to the chat template as reasoning_effort (read by templates "
                                "that think, e.g. gpt-oss's; ignored by the others), as "
                                "chat_template_kwargs would pass it."))
    verbosity: Literal["low", "medium", "high"] | None = Field(
        None, description="Accepted and ignored: the served models have no verbosity control.")
    prediction: PredictedContent | None = Field(
        None, description="OpenAI's Predicted Outputs: accepted; the answer is the model's own "
                          "either way (a prediction only lets a server answer sooner).")
    modalities: list[Literal["text", "audio"]] | None = Field(
        None, description="Only ['text']: the served models write text.")
    audio: Annotated[dict[str, Any] | None, not_served(
        "audio output is not available: the served models write text")] = Field(
        None, description="Not available (only null): the served models write text.")
    web_search_options: Annotated[dict[str, Any] | None, not_served(
        "web search is a hosted tool this server does not have")] = Field(
        None, description="Not available (only null): web search is not hosted here.")
    functions: Annotated[list[dict[str, Any]] | None, not_served(
        "OpenAI's deprecated form of tools, not served: send tools=[{'type': 'function', "
        "'function': {...}}]")] = Field(None, description="Not served (only null): send tools.")
    function_call: Annotated[str | dict[str, Any] | None, not_served(
        "OpenAI's deprecated form of tool_choice, not served: send tools and tool_choice")] = Field(
        None, description="Not served (only null): send tool_choice.")

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and "audio" in value:
            raise _unsupported("audio output is not available: the served models write text "
                               "(send ['text'] or leave it out)")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise _unsupported("top_logprobs needs logprobs set to true")
        return value

    @property
    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: how many alternatives per token (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_kwargs(self) -> dict[str, Any] | None:
        """chat_template_kwargs with reasoning_effort among them; the two naming different
        efforts is a 400."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        given = (self.chat_template_kwargs or {}).get("reasoning_effort")
        if given is not None and given != self.reasoning_effort:
            raise InvalidRequestError(
                f"'reasoning_effort' is {self.reasoning_effort!r} but chat_template_kwargs' "
                f"reasoning_effort is {given!r}: send one of them", param="reasoning_effort")
        return {**(self.chat_template_kwargs or {}), "reasoning_effort": self.reasoning_effort}

    @property
    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


# Responses (documented at /docs; streaming chunks have the same fields as in OpenAI's API).
class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Prompt tokens found in a worker's prefix cache.")


class CompletionUsage(BaseModel):
    prompt_tokens: int = Field(description="Tokens of the prompt (after the chat template); "
                                           "each prompt counted once, whatever n.")
    completion_tokens: int = Field(description="Tokens generated, over all choices.")
    total_tokens: int = Field(description="The two together.")
    prompt_tokens_details: PromptTokensDetails | None = Field(
        None, description="cached_tokens: of prompt_tokens, those the prefix cache held.")


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(description="Each generated token, decoded alone.")
    token_logprobs: list[float] = Field(description="The log-probability of each.")
    top_logprobs: list[dict[str, float]] = Field(
        description="Per position: the most likely tokens (and the one generated) to their logprob.")
    text_offset: list[int] = Field(description="Where each token starts in the text.")


class CompletionChoice(BaseModel):
    index: int = Field(0, description="prompt number * n + choice number.")
    text: str = Field(description="The generated text (after the prompt, with echo).")
    logprobs: CompletionLogprobs | None = Field(None, description="When asked (logprobs).")
    finish_reason: str | None = Field(description="stop, length, or abort (canceled).")
    prompt_token_ids: list[int] | None = Field(
        None, description="With return_token_ids: the prompt's token ids, as the model saw them.")
    token_ids: list[int] | None = Field(
        None, description="With return_token_ids: the generated token ids (not the echo's).")


class Completion(BaseModel):
    id: str = Field(description="cmpl-<job id>; the job id is also in the X-Carpool-Job-Id header.")
    object: Literal["text_completion"] = Field("text_completion", description="The kind of object.")
    created: int = Field(description="Submission time, seconds since the epoch.")
    model: str = Field(description="The model that ran it.")
    choices: list[CompletionChoice] = Field(description="n choices per prompt.")
    usage: CompletionUsage = Field(description="Token counts.")


class ToolCall(BaseModel):
    id: str = Field(description="call_<random>.")
    type: Literal["function"] = Field("function", description="Always 'function'.")
    function: ToolCallFunction = Field(description="The name and the arguments (JSON text).")


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = Field("assistant", description="Always assistant.")
    content: str | None = Field(description="The generated text (with tool calls: the text outside "
                                             "them, or null).")
    tool_calls: list[ToolCall] | None = Field(None, description="The calls the model made.")


class ChatTopLogprob(BaseModel):
    token: str = Field(description="The token, decoded alone.")
    logprob: float = Field(description="Its log-probability.")
    bytes: list[int] | None = Field(description="The token's UTF-8 bytes.")


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(description="The most likely tokens at its position.")


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = Field(description="One entry per generated token.")


class ChatChoice(BaseModel):
    index: int = Field(0, description="The choice's number, 0 to n - 1.")
    message: AssistantMessage = Field(description="The model's answer.")
    logprobs: ChatLogprobs | None = Field(None, description="When asked (logprobs: true).")
    finish_reason: str | None = Field(description="stop, length, tool_calls, or abort (canceled).")
    token_ids: list[int] | None = Field(
        None, description="With return_token_ids: the generated token ids.")


class ChatCompletion(BaseModel):
    id: str = Field(description="chatcmpl-<job id>; the job id is also in X-Carpool-Job-Id.")
    object: Literal["chat.completion"] = Field("chat.completion", description="The kind of object.")
    created: int = Field(description="Submission time, seconds since the epoch.")
    model: str = Field(description="The model that ran it.")
    choices: list[ChatChoice] = Field(description="n choices.")
    usage: CompletionUsage = Field(description="Token counts.")
    prompt_token_ids: list[int] | None = Field(
        None, description="With return_token_ids: the prompt's token ids (after the chat "
                          "template), as the model saw them.")
    service_tier: str | None = Field(
        None, description="default, flex or priority: only when the request named a service_tier.")


class ModelObject(BaseModel):
    id: str = Field(description="The name to pass as `model`.")
    object: Literal["model"] = Field(default="model", description="The kind of object.")
    created: int = Field(description="When a worker registered it, seconds since the epoch.")
    owned_by: str = Field(default="carpool", description="Always carpool.")
    max_model_len: int = Field(description="Context length in tokens (as vLLM reports it).")
    generation_defaults: dict[str, Any] = Field(
        default_factory=dict,
        description="Sampling defaults from the model's generation_config.json, applied to the "
                    "fields a request leaves out (as vLLM's --generation-config auto).")
    # Anthropic's model object, on the same route (its client lists /v1/models too).
    type: Literal["model"] = Field(default="model", description="Anthropic's: the kind of object.")
    display_name: str = Field(description="Anthropic's: the model's name for people (its id).")
    created_at: str = Field(description="Anthropic's: `created` as an RFC 3339 time.")


class ModelList(BaseModel):
    object: Literal["list"] = Field(default="list", description="The kind of object.")
    data: list[ModelObject] = Field(description="Models the workers serve, the default first.")
    # Anthropic's page, on the same route: every model is on it.
    has_more: bool = Field(default=False, description="Anthropic's: always false (one page).")
    first_id: str | None = Field(default=None, description="Anthropic's: the first model's id.")
    last_id: str | None = Field(default=None, description="Anthropic's: the last model's id.")


class OpenAIErrorBody(BaseModel):
    message: str = Field(description="What went wrong, naming the field and the limit.")
    type: str = Field(description="invalid_request_error, rate_limit_error or server_error.")
    param: str | None = Field(description="The request field at fault, if one is.")
    code: str | None = Field(description="A stable code, e.g. invalid_value, model_not_found.")


class OpenAIError(BaseModel):
    error: OpenAIErrorBody = Field(description="OpenAI's error shape.")


def openai_error_docs(*cases: tuple[int, str]) -> dict[int | str, dict[str, Any]]:
    """A route's documented failures, (status, when), each answered in OpenAI's error shape (the
    API fuzz suite holds every route to what it documents)."""
    return {status: {"model": OpenAIError, "description": when} for status, when in cases}
