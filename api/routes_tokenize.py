"""/tokenize and /detokenize, as vLLM's OpenAI server has them, on the API's own tokenizer
(the tokenizer.json a worker published: no torch, no worker round trip)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field, model_validator
from tokenizers import Tokenizer

from api.auth import caller_owner
from api.chat_template import ChatTemplateError, render_chat, template_kwargs_for
from api.context import AppContext, get_context
from api.errors import OPENAI_TAG, InvalidRequestError, ServiceUnavailableError
from api.fields import Text
from api.openai_schemas import ChatMessage, ChatRenderingParams, OpenAIError
from api.tool_calls import NO_TOOLS, plain_messages
from protocol import ModelCard

router = APIRouter(tags=[OPENAI_TAG], dependencies=[Depends(caller_owner)])
Context = Annotated[AppContext, Depends(get_context)]


class TokenizeRequest(ChatRenderingParams):
    """vLLM's two forms: `prompt` (completions) or `messages` (chat, through the template)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="A model from GET /v1/models; default: the first.")
    prompt: Text | None = Field(None, description="Text to tokenize.")
    messages: list[ChatMessage] | None = Field(None, min_length=1,
                                               description="A chat, rendered by its template.")
    add_special_tokens: bool | None = Field(
        None, strict=True,
        description="Add the tokenizer's special tokens (BOS...); default: true for a prompt, "
                    "false for messages (their template writes them).")

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        return self


class TokenizeResponse(BaseModel):
    count: int = Field(description="Number of tokens.")
    max_model_len: int = Field(description="The model's context length.")
    tokens: list[int] = Field(description="The token ids.")


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="A model from GET /v1/models; default: the first.")
    tokens: list[Annotated[int, Field(strict=True, ge=0)]] = Field(description="Token ids.")


class DetokenizeResponse(BaseModel):
    prompt: str = Field(description="The text of the tokens (special tokens included).")


_ERRORS: dict[int | str, dict[str, object]] = {
    400: {"model": OpenAIError, "description": "Invalid request (the message names the field)."},
    401: {"model": OpenAIError, "description": "Missing or wrong API key."},
    404: {"model": OpenAIError, "description": "No model of that name was ever served here."},
    503: {"model": OpenAIError, "description": "No model or tokenizer registered yet."},
}


@router.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS,
             summary="Tokenize a prompt or a chat (vLLM)")
async def tokenize(body: TokenizeRequest, ctx: Context) -> TokenizeResponse:
    card, tokenizer = await _tokenizer(ctx, body.model)
    if body.messages is not None:
        # Tool calls and results in the history render as a chat request renders them.
        messages = plain_messages([{**m.model_dump(), "role": "system" if m.role == "developer" else m.role}
                                   for m in body.messages], NO_TOOLS)
        try:
            add_generation_prompt, continue_final_message = body.rendering()
            text, _ = render_chat(card, messages, add_generation_prompt=add_generation_prompt,
                                  continue_final_message=continue_final_message,
                                  template_kwargs=template_kwargs_for(card, body.chat_template_kwargs))
        except ChatTemplateError as exc:
            raise InvalidRequestError(f"The model's chat template rejects these messages: {exc}",
                                      param="messages") from exc
        add_special_tokens = bool(body.add_special_tokens)
    else:
        text = body.prompt or ""
        add_special_tokens = body.add_special_tokens is not False
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
    return TokenizeResponse(count=len(ids), max_model_len=card.max_model_len, tokens=ids)


@router.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS,
             summary="Turn token ids back into text (vLLM)")
async def detokenize(body: DetokenizeRequest, ctx: Context) -> DetokenizeResponse:
    card, tokenizer = await _tokenizer(ctx, body.model)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    outside = [token_id for token_id in body.tokens if token_id >= vocab_size]
    if outside:
        raise InvalidRequestError(
            f"'tokens' holds token id {outside[0]}, outside the vocabulary of model "
            f"'{card.name}' (ids 0 to {vocab_size - 1})", param="tokens")
    return DetokenizeResponse(prompt=tokenizer.decode(body.tokens, skip_special_tokens=False))


async def _tokenizer(ctx: AppContext, model: str | None) -> tuple[ModelCard, Tokenizer]:
    card = await ctx.models.resolve(model)
    tokenizer = await ctx.jobs.tokenizer(card)
    if tokenizer is None:
        raise ServiceUnavailableError(f"No tokenizer is published for model '{card.name}'",
                                      ctx.settings.retry_after_s)
    return card, tokenizer
