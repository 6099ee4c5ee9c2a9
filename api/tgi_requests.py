"""A Text Generation Inference request (api/tgi_schemas.py) turned into Carpool GenerationRequests:
one job, or `best_of` of them. TGI's rules where they differ from OpenAI's: it samples only when
asked (do_sample, or a temperature, top_k, top_p or typical_p other than the neutral ones), takes the
model's generation defaults for nothing, and keeps best_of and the prompt's logprobs out of
streams."""

from __future__ import annotations

import secrets
from typing import Any

from api.errors import InvalidRequestError
from api.job_service import GenerationRequest, choice_sampling
from api.settings import ApiSettings
from api.structured_output import grammar_constraint
from api.tgi_schemas import GenerateParameters, GenerateRequest
from protocol import SamplingParams
from protocol.generation import MAX_SEED


def generation_requests(body: GenerateRequest, settings: ApiSettings, *, streaming: bool,
                        **common: Any) -> list[GenerationRequest]:
    """One request per sequence (best_of of them); `common`: owner, deadlines, idempotency key."""
    params = body.parameters
    _refuse_unserved(params)
    best_of = params.best_of or 1
    _check_best_of(params, best_of, settings, streaming)
    if params.decoder_input_details and streaming:
        raise InvalidRequestError("'parameters.decoder_input_details' is not served with "
                                  "streaming: use /generate", param="parameters.decoder_input_details")
    top_n = params.top_n_tokens or 0
    if top_n > settings.max_logprobs:
        raise InvalidRequestError(f"Invalid value for 'parameters.top_n_tokens': at most "
                                  f"{settings.max_logprobs} (got {top_n})",
                                  param="parameters.top_n_tokens")
    # The tokens' logprobs are worked out only where the answer shows them (or picks by them).
    wants_logprobs = streaming or bool(params.details) or best_of > 1 or top_n > 0
    constraint = (grammar_constraint(params.grammar.type, params.grammar.value,
                                     "parameters.grammar.value")
                  if params.grammar is not None else None)
    sampling = SamplingParams(
        temperature=(params.temperature or 1.0) if _samples(params) else 0.0,
        top_p=params.top_p or 1.0, top_k=params.top_k or 0, typical_p=params.typical_p or 1.0,
        seed=_seed(params),
        # TGI's text keeps the stop sequence that ended it.
        stop=tuple(params.stop), include_stop_str_in_output=bool(params.stop),
        repetition_penalty=params.repetition_penalty or 1.0,
        frequency_penalty=params.frequency_penalty or 0.0,
        logprobs=top_n if wants_logprobs else None,
        prompt_logprobs=0 if params.details and params.decoder_input_details else None,
        truncate_prompt_tokens=params.truncate, structured_output=constraint)
    return [GenerationRequest(
        **common, model=body.model, prompt=body.inputs, max_tokens=params.max_new_tokens,
        sampling=choice_sampling(sampling, choice), input_param="inputs",
        max_tokens_param="parameters.max_new_tokens", logprobs_param="parameters.top_n_tokens",
        explicit_fields=None)  # TGI applies no generation_config.json sampling defaults
        for choice in range(best_of)]


def _seed(params: GenerateParameters) -> int | None:
    """The seed given; for a sampled request without one, a fresh random seed, as TGI's router
    draws one, so that `details.seed` names what the answer was drawn with and the same request
    with that seed draws it again. A greedy request has none to report."""
    if params.seed is not None or not _samples(params):
        return params.seed
    return secrets.randbelow(MAX_SEED + 1)


def _samples(params: GenerateParameters) -> bool:
    """TGI samples when asked to, or when a parameter only sampling honours is set (its
    `has_warpers`)."""
    return bool(params.do_sample) or any(
        value is not None and value != neutral for value, neutral in (
            (params.temperature, 1.0), (params.top_p, 1.0), (params.typical_p, 1.0),
            (params.top_k, None)))


def _refuse_unserved(params: GenerateParameters) -> None:
    if params.watermark:
        raise InvalidRequestError("'parameters.watermark' is not served: leave it out or false",
                                  param="parameters.watermark")
    if params.adapter_id is not None:
        raise InvalidRequestError("'parameters.adapter_id': no LoRA adapters are served; leave it "
                                  "out", param="parameters.adapter_id")


def _check_best_of(params: GenerateParameters, best_of: int, settings: ApiSettings,
                   streaming: bool) -> None:
    if best_of == 1:
        return
    param = "parameters.best_of"
    if best_of > settings.max_n:
        raise InvalidRequestError(f"Invalid value for '{param}': at most {settings.max_n} "
                                  f"(got {best_of})", param=param)
    if streaming:
        raise InvalidRequestError(f"'{param}' above 1 is not served with streaming: use /generate",
                                  param=param)
    if not _samples(params):
        raise InvalidRequestError(f"'{param}' above 1 needs sampling: set do_sample (or a "
                                  "temperature, top_k, top_p or typical_p), else every sequence is the same",
                                  param=param)
