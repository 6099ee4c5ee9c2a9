"""/tokenize and /detokenize, as vLLM's OpenAI server has them, on the API's own tokenizer
(the tokenizer.json a worker published: no torch, no worker round trip).

/tokenize also takes Text Generation Inference's body (`inputs`, a generate request) and answers
it as TGI does: each token's id, text and character span, errors in TGI's shape (422). The two are
told apart by `inputs`, which vLLM's body never has."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator
from tokenizers import Tokenizer

from api.auth import caller_owner
from api.chat_template import ChatTemplateError, render_chat, template_kwargs_for
from api.context import AppContext, get_context
from api.errors import (
    OPENAI_TAG,
    TGI_BODY,
    VLLM_BODY,
    InvalidRequestError,
    ServiceUnavailableError,
    answer_in_tgi_shape,
)
from api.fields import NonEmptyText, Text
from api.openai_schemas import ChatMessage, ChatRenderingParams, OpenAIError
from api.tgi_schemas import GenerateParameters, TGIError
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


class TGITokenizeRequest(BaseModel):
    """TGI's body: a generate request, of whose parameters only `truncate` applies."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"inputs": "Hello world"}]})

    inputs: NonEmptyText = Field(description="Text to tokenize.")
    parameters: GenerateParameters = Field(
        default_factory=lambda: GenerateParameters.model_validate({}),
        description="A generate request's parameters; `truncate` keeps the last tokens only.")
    add_special_tokens: bool = Field(True, strict=True, description="Add the tokenizer's special tokens.")
    model: Text | None = Field(None, description="Carpool's: which served model (default: the first).")


class SimpleToken(BaseModel):
    """A token as TGI's /tokenize lists it."""

    id: int = Field(description="The token id.")
    text: str = Field(description="The input's characters it covers (\"\" for an added special token).")
    start: int = Field(description="Where those characters start in `inputs`.")
    stop: int = Field(description="Where they end (exclusive).")


def _body_form(payload: Any) -> str:
    return TGI_BODY if isinstance(payload, dict) and "inputs" in payload else VLLM_BODY


TokenizeBody = Annotated[Annotated[TokenizeRequest, Tag(VLLM_BODY)] | Annotated[TGITokenizeRequest, Tag(TGI_BODY)],
                         Discriminator(_body_form)]


async def _tgi_bodies_answered_in_tgi_shape(request: Request) -> None:
    # A dependency, so that it runs before FastAPI reports the body's validation errors.
    try:
        payload = await request.json()
    except ValueError:  # not JSON: the body's own validation says so
        return
    if _body_form(payload) == TGI_BODY:
        answer_in_tgi_shape(request)


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


# /tokenize answers a TGI body's errors in TGI's shape: 422 for an invalid field, and 401, 404, 503.
_TOKENIZE_ERRORS: dict[int | str, dict[str, object]] = {
    **{status: {**answer, "model": OpenAIError | TGIError} for status, answer in _ERRORS.items() if status != 400},
    400: _ERRORS[400], 422: {"model": TGIError, "description": "A TGI body's invalid field."}}


@router.post("/tokenize", response_model=TokenizeResponse | list[SimpleToken],
             responses=_TOKENIZE_ERRORS,
             dependencies=[Depends(_tgi_bodies_answered_in_tgi_shape)],
             summary="Tokenize a prompt or a chat (vLLM), or TGI's `inputs` (answered as TGI does)")
async def tokenize(body: TokenizeBody, ctx: Context) -> TokenizeResponse | list[SimpleToken]:
    card, tokenizer = await _tokenizer(ctx, body.model)
    if isinstance(body, TGITokenizeRequest):
        return _tgi_tokens(tokenizer, body)
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


def _tgi_tokens(tokenizer: Tokenizer, body: TGITokenizeRequest) -> list[SimpleToken]:
    """TGI's answer: its encoding of `inputs`, the last `truncate` tokens where that is set
    (TGI truncates from the left), each with the characters its offsets span."""
    encoding = tokenizer.encode(body.inputs, add_special_tokens=body.add_special_tokens)
    keep = body.parameters.truncate or len(encoding.ids)
    return [SimpleToken(id=token_id, text=body.inputs[start:stop], start=start, stop=stop)
            for token_id, (start, stop) in zip(encoding.ids[-keep:], encoding.offsets[-keep:], strict=True)]


async def _tokenizer(ctx: AppContext, model: str | None) -> tuple[ModelCard, Tokenizer]:
    card = await ctx.models.resolve(model)
    tokenizer = await ctx.jobs.tokenizer(card)
    if tokenizer is None:
        raise ServiceUnavailableError(f"No tokenizer is published for model '{card.name}'",
                                      ctx.settings.retry_after_s)
    return card, tokenizer
