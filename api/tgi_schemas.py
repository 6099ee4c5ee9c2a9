"""Request and response bodies of Hugging Face Text Generation Inference's own API (`/generate`,
`/generate_stream`, `POST /`, `/info`), as TGI 2.x documents them, for clients written against
TGI: huggingface_hub's `InferenceClient.text_generation`, the `text-generation` package,
LangChain's and LlamaIndex's TGI integrations.

Every parameter takes null for "not given", as those clients send every parameter they know.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from api.fields import MAX_PENALTY, NonEmptyText, Seed, StopStrings, Text

DEFAULT_MAX_NEW_TOKENS = 100  # TGI's default when the field is left out (null: the context's room)

Positive = Annotated[float, Field(strict=True, gt=0.0)]
Flag = Annotated[bool, Field(strict=True)]


class Grammar(BaseModel):
    """TGI's grammar: a JSON schema, or a regular expression, the text must match."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["json", "json_object", "regex", "json_schema"] = Field(
        description="json (or json_object): `value` is a JSON schema; json_schema: `value` is "
                    "{'name': optional, 'schema': a JSON schema}; regex: `value` is a pattern.")
    value: Any = Field(description="The JSON schema (an object or its JSON text), TGI's "
                                   "{'name', 'schema'} around one, or the regex.")


class GenerateParameters(BaseModel):
    """TGI's generation parameters; null is "not given" for each."""

    model_config = ConfigDict(extra="forbid")
    max_new_tokens: Annotated[int, Field(strict=True, ge=1)] | None = Field(
        DEFAULT_MAX_NEW_TOKENS,
        description="Most tokens to generate (default 100; null: as many as the context leaves).")
    do_sample: Flag | None = Field(
        None, description="Sample; without it (and with no temperature, top_k or top_p) the "
                          "most likely token is taken at every step.")
    temperature: Positive | None = Field(None, description="Sampling temperature, above 0.")
    top_p: Annotated[float, Field(strict=True, gt=0.0, le=1.0)] | None = Field(
        None, description="Nucleus sampling mass, in (0, 1].")
    top_k: Annotated[int, Field(strict=True, gt=0)] | None = Field(
        None, description="Keep the k most likely tokens.")
    typical_p: Annotated[float, Field(strict=True, gt=0.0, le=1.0)] | None = Field(
        None, description="Typical decoding: keep the tokens whose surprise is nearest the "
                          "entropy, up to this probability mass; 1.0 is off.")
    repetition_penalty: Positive | None = Field(
        None, description="Repetition penalty over prompt and output; 1.0 is none.")
    frequency_penalty: Annotated[float, Field(strict=True, ge=-MAX_PENALTY, le=MAX_PENALTY)] | None = Field(
        None, description="Subtracted from a token's logit per time it occurred in the output.")
    seed: Seed = None
    stop: StopStrings = []
    truncate: Annotated[int, Field(strict=True, ge=1)] | None = Field(
        None, description="Keep only the prompt's last `truncate` tokens.")
    return_full_text: Flag | None = Field(
        None, description="Put the prompt before the generated text.")
    details: Flag | None = Field(
        None, description="Answer the tokens, their logprobs and the finish reason too.")
    decoder_input_details: Flag | None = Field(
        None, description="With details: the prompt's tokens and their logprobs (`prefill`); "
                          "not with streaming.")
    top_n_tokens: Annotated[int, Field(strict=True, ge=0)] | None = Field(
        None, description="The n most likely tokens at each step (`top_tokens`).")
    best_of: Annotated[int, Field(strict=True, ge=1)] | None = Field(
        None, description="Sample this many sequences and answer the one of highest logprob "
                          "(with sampling, without a seed, not streamed).")
    grammar: Grammar | None = Field(None, description="A JSON schema or regex the text must match.")
    watermark: Flag | None = Field(None, description="Not served: only false or null.")
    adapter_id: str | None = Field(None, description="Not served (no LoRA adapters): only null.")


class GenerateRequest(BaseModel):
    """`/generate`, `/generate_stream` and `POST /`."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 8}}]})
    inputs: NonEmptyText = Field(description="The prompt, as text.")
    parameters: GenerateParameters = Field(default_factory=lambda: GenerateParameters.model_validate({}),
                                           description="How to generate.")
    stream: Flag | None = Field(
        None, description="`POST /` only: stream the tokens as /generate_stream does.")
    model: Text | None = Field(
        None, description="Carpool's: which served model (default: the default model).")


class Token(BaseModel):
    id: int = Field(description="The token id.")
    text: str = Field(description="The text the token adds (\"\" while a character or a possible "
                                  "stop string is held back).")
    logprob: float | None = Field(description="Its log-probability.")
    special: bool = Field(description="Whether it is one of the tokenizer's special tokens.")


class PrefillToken(BaseModel):
    id: int = Field(description="The prompt token's id.")
    text: str = Field(description="Its text.")
    logprob: float | None = Field(description="Its log-probability given the tokens before it "
                                              "(null for the first).")


class SequenceDetails(BaseModel):
    """What details say of one generated sequence."""

    finish_reason: str = Field(description="length, stop_sequence or eos_token.")
    generated_tokens: int = Field(description="Tokens generated.")
    seed: int | None = Field(description="The seed it was sampled with: the one given, else one "
                                        "drawn for it (null when greedy without a seed).")
    prefill: list[PrefillToken] = Field(description="The prompt's tokens (decoder_input_details).")
    tokens: list[Token] = Field(description="The generated tokens.")
    top_tokens: list[list[Token]] = Field(
        default_factory=list, description="The most likely tokens at each step (top_n_tokens).")


class BestOfSequence(SequenceDetails):
    generated_text: str = Field(description="The sequence's text.")


class Details(SequenceDetails):
    best_of_sequences: list[BestOfSequence] | None = Field(
        None, description="With best_of: the other sequences.")


class GenerateResponse(BaseModel):
    generated_text: str = Field(description="The text generated (after the prompt with "
                                            "return_full_text).")
    details: Details | None = Field(None, description="With details: true.")


class StreamDetails(BaseModel):
    finish_reason: str = Field(description="length, eos_token or stop_sequence.")
    generated_tokens: int = Field(description="Tokens generated.")
    seed: int | None = Field(description="The seed it is sampled with: the one given, else one "
                                        "drawn for it (null when greedy without a seed).")
    input_length: int = Field(description="The prompt's tokens.")


class StreamResponse(BaseModel):
    index: int = Field(description="The token's position, from 1.")
    token: Token = Field(description="The token.")
    top_tokens: list[Token] = Field(default_factory=list,
                                    description="The most likely tokens there (top_n_tokens).")
    generated_text: str | None = Field(description="On the last event: the whole text.")
    details: StreamDetails | None = Field(description="On the last event: how it ended.")


class Info(BaseModel):
    model_id: str = Field(description="The default model's name.")
    model_sha: str | None = Field(None, description="Not known here: null.")
    model_pipeline_tag: str | None = Field(description="text-generation.")
    max_concurrent_requests: int = Field(description="How many requests may wait in the queue.")
    max_best_of: int = Field(description="Most best_of sequences a request may ask for.")
    max_stop_sequences: int = Field(description="Most stop strings a request may give.")
    max_input_tokens: int = Field(description="Most prompt tokens (the context less one).")
    max_total_tokens: int = Field(description="The model's context length.")
    validation_workers: int = Field(description="TGI's tokenizer threads; here 1.")
    max_client_batch_size: int = Field(description="Always 1: one prompt a request.")
    router: str = Field(description="The server: carpool.")
    version: str = Field(description="Carpool's version.")
    sha: str | None = Field(None, description="Not known here: null.")
    docker_label: str | None = Field(None, description="Not known here: null.")


class TGIError(BaseModel):
    error: str = Field(description="What went wrong, naming the field to fix.")
    error_type: str = Field(description="validation, overloaded, generation, "
                                        "incomplete_generation, authentication, not_found or "
                                        "unavailable.")
