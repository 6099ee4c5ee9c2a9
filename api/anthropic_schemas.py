"""Request and response bodies of Anthropic's Messages API (`POST /v1/messages`,
`POST /v1/messages/count_tokens`), as vLLM and SGLang serve it, for the official `anthropic`
client and tools built on it. Content blocks stay plain dicts here: api/anthropic_requests.py
checks each kind, naming the block that is wrong."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from api.fields import NonEmptyText, Seed, StopStrings, TopK

Blocks = list[dict[str, Any]]


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"] = Field(description="user or assistant (system goes in "
                                                           "`system`).")
    content: str | Annotated[Blocks, Field(min_length=1)] = Field(
        description="Text, or content blocks: text, tool_use (assistant), tool_result (user).")


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: NonEmptyText = Field(description="The tool's name.")
    description: str | None = Field(None, description="What it does, for the model.")
    input_schema: dict[str, Any] = Field(description="The JSON schema of its input.")
    type: Literal["custom"] | None = Field(None, description="custom (the only kind served).")
    cache_control: dict[str, Any] | None = Field(None, description="Accepted and ignored.")


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["auto", "any", "tool", "none"] = Field(
        description="auto (the model decides), any (some tool), tool (the one named), none.")
    name: str | None = Field(None, description="With type tool: the tool to call.")
    disable_parallel_tool_use: bool | None = Field(
        None, strict=True, description="At most one tool call.")


class ConversationRequest(BaseModel):
    """What /v1/messages and /v1/messages/count_tokens both take: the conversation and its tools."""

    model_config = ConfigDict(extra="forbid")
    model: NonEmptyText = Field(description="A model from GET /v1/models.")
    messages: Annotated[list[AnthropicMessage], Field(min_length=1)] = Field(
        description="The conversation; a last assistant message is continued (prefill).")
    system: str | Blocks | None = Field(None, description="The system prompt: text or text "
                                                          "blocks.")
    tools: list[AnthropicTool] | None = Field(None, description="Tools the model may call.")
    tool_choice: ToolChoice | None = Field(None, description="Whether and which tool to call.")
    thinking: dict[str, Any] | None = Field(
        None, description="Only {'type': 'disabled'}: extended thinking is not served.")


class MessagesRequest(ConversationRequest):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"model": "smollm2", "max_tokens": 64,
         "messages": [{"role": "user", "content": "What is 2+2?"}]}]})
    max_tokens: Annotated[int, Field(strict=True, ge=1)] = Field(
        description="Most tokens to generate.")
    stop_sequences: StopStrings = []
    stream: bool | None = Field(None, strict=True, description="Stream the message's events.")
    temperature: Annotated[float, Field(strict=True, ge=0.0, le=1.0)] | None = Field(
        None, description="0 to 1 (Anthropic's range); default: the model's generation default.")
    top_p: Annotated[float, Field(strict=True, gt=0.0, le=1.0)] | None = Field(
        None, description="Nucleus sampling mass.")
    top_k: TopK | None = Field(None, description="Keep only the k most likely tokens.")
    metadata: dict[str, Any] | None = Field(None, description="Accepted (user_id) and ignored.")
    service_tier: str | None = Field(None, description="Accepted and ignored.")
    output_config: dict[str, Any] | None = Field(
        None, description="Structured output: {'format': {'type': 'json_schema', 'schema': {...}}} "
                          "(the messages.parse helper's); 'effort' is accepted and ignored.")
    output_format: dict[str, Any] | None = Field(
        None, description="The earlier name of output_config.format.")
    seed: Seed = None


class CountTokensRequest(ConversationRequest):
    """/v1/messages' request without what only generation takes."""


class InputTokens(BaseModel):
    input_tokens: int = Field(description="The prompt tokens /v1/messages would run on.")


class Usage(BaseModel):
    input_tokens: int = Field(description="Prompt tokens not read from the prefix cache.")
    output_tokens: int = Field(description="Tokens generated.")
    cache_creation_input_tokens: int = Field(description="Always 0 (no cache writes to bill).")
    cache_read_input_tokens: int = Field(description="Prompt tokens the prefix cache held.")


class Message(BaseModel):
    id: str = Field(description="msg_ and the job id.")
    type: Literal["message"] = Field(description="message.")
    role: Literal["assistant"] = Field(description="assistant.")
    model: str = Field(description="The model that answered.")
    content: Blocks = Field(description="text and tool_use blocks.")
    stop_reason: str | None = Field(description="end_turn, max_tokens, stop_sequence or tool_use.")
    stop_sequence: str | None = Field(description="The stop sequence that ended it, if one did.")
    usage: Usage = Field(description="Token counts.")


class AnthropicErrorDetail(BaseModel):
    type: str = Field(description="invalid_request_error, authentication_error, not_found_error, "
                                  "request_too_large, rate_limit_error, api_error, "
                                  "overloaded_error.")
    message: str = Field(description="What went wrong, naming the field to fix.")


class AnthropicError(BaseModel):
    type: Literal["error"] = Field(description="error.")
    error: AnthropicErrorDetail = Field(description="The error.")
