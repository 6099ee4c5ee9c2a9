"""An OpenAI request body turned into Carpool GenerationRequests (one per choice and prompt):
what /v1/completions and /v1/chat/completions submit, and what each line of a batch submits."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from api.errors import InvalidRequestError
from api.job_service import GenerationRequest, choice_sampling, sampling_of
from api.openai_schemas import ChatCompletionRequest, CompletionRequest
from api.settings import ApiSettings
from api.tool_calls import ToolCalling, plain_messages, template_messages, template_tools, tool_calling_of
from protocol import SamplingParams


@dataclass(frozen=True, slots=True)
class ChatRequests:
    requests: list[GenerationRequest]
    calling: ToolCalling
    messages: list[dict[str, Any]]  # the plain messages the worker renders

    @property
    def echo(self) -> str:
        """vLLM's chat `echo`: the last message's content goes before each reply when that
        message is the assistant's own (a reply to continue); any other last message echoes
        nothing."""
        last = self.messages[-1]
        return (last.get("content") or "") if last["role"] == "assistant" else ""


def common_fields(body: CompletionRequest | ChatCompletionRequest, owner: str,
                  **extra: Any) -> dict[str, Any]:
    """The GenerationRequest fields every choice of `body` shares; `extra`: deadlines, the
    idempotency key, a priority other than the body's."""
    priority = body.queue_priority() if isinstance(body, ChatCompletionRequest) else body.priority
    return {"owner": owner, "model": body.model, "priority": priority,
            "explicit_fields": frozenset(body.model_fields_set), "cache_salt": body.cache_salt,
            **_tokenization(body), **extra}


def _tokenization(body: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
    """How the prompt becomes token ids (GenerationRequest's fields of the same names)."""
    return {"add_special_tokens": body.add_special_tokens,
            "truncation_side": body.truncation_side or "left",
            "prompt_ids_param": body.prompt_ids_param()}


def check_counts(settings: ApiSettings, n: int, num_prompts: int) -> None:
    if n > settings.max_n:
        raise InvalidRequestError(f"Invalid value for 'n': at most {settings.max_n} choices per "
                                  f"prompt are accepted (got {n})", param="n")
    if num_prompts > settings.max_prompts:
        raise InvalidRequestError(f"Invalid value for 'prompt': at most {settings.max_prompts} "
                                  f"prompts per request are accepted (got {num_prompts})",
                                  param="prompt")


def completion_requests(body: CompletionRequest, settings: ApiSettings,
                        common: dict[str, Any]) -> list[GenerationRequest]:
    check_counts(settings, body.n, len(body.prompt))
    if body.max_tokens == 0 and not body.echo:
        raise InvalidRequestError("Invalid value for 'max_tokens': at least 1 token is generated "
                                  "(0 is accepted with echo: true, to score the prompt); got 0",
                                  param="max_tokens")
    # Scoring the prompt (body.scores_prompt) runs one token: the prompt's logprobs come with it.
    return [GenerationRequest(
        **common, prompt=prompt if isinstance(prompt, str) else None,
        prompt_token_ids=prompt if isinstance(prompt, list) else None,
        max_tokens=max(body.max_tokens, 1), sampling=choice_sampling(common_sampling, choice))
        # echo with logprobs: the prompt's tokens get theirs too (as OpenAI's legacy API did).
        for prompt in body.prompt for choice, common_sampling in _choices(
            body, prompt_logprobs=_most(body.prompt_logprobs, body.logprobs if body.echo else None))]


def chat_requests(body: ChatCompletionRequest, settings: ApiSettings,
                  common: dict[str, Any]) -> ChatRequests:
    check_counts(settings, body.n, 1)
    max_tokens, max_tokens_param = body.requested_max_tokens
    add_generation_prompt, continue_final_message = body.rendering()
    calling = tool_calling_of(body.tools, body.tool_choice, body.parallel_tool_calls)
    given = [{**m.model_dump(), "role": "system" if m.role == "developer" else m.role}
             for m in body.messages]
    messages = plain_messages(given, calling)
    # A template that renders tools itself gets them (the job service decides, knowing the model).
    tools = template_tools(calling) if calling.parses_calls else None
    tool_messages = template_messages(given) if calling.parses_calls else None
    requests = [GenerationRequest(
        **common, messages=messages, max_tokens=max_tokens, input_param="messages",
        max_tokens_param=max_tokens_param, logprobs_param="top_logprobs",
        sampling=choice_sampling(sampling, choice), template_tools=tools,
        template_messages=tool_messages, add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        chat_template_kwargs=body.template_kwargs())
        for choice, sampling in _choices(body, body.prompt_logprobs, calling)]
    return ChatRequests(requests, calling, messages)


def _most(*counts: int | None) -> int | None:
    """The largest of the counts given (None: none given)."""
    given = [count for count in counts if count is not None]
    return max(given) if given else None


def _choices(body: CompletionRequest | ChatCompletionRequest, prompt_logprobs: int | None,
             calling: ToolCalling | None = None) -> list[tuple[int, SamplingParams]]:
    # Chat's logprobs is a flag (top_logprobs the count): the sampler wants the count.
    sampling = sampling_of(body, logprobs=body.num_logprobs, prompt_logprobs=prompt_logprobs)
    forced_call = calling.constraint() if calling is not None else None
    if forced_call is not None:
        if sampling.structured_output is not None:
            raise InvalidRequestError("A forced tool call ('tool_choice' required or a function) "
                                      "cannot be combined with an output constraint "
                                      "(response_format, structured_outputs, guided_*)",
                                      param="tool_choice")
        sampling = dataclasses.replace(sampling, structured_output=forced_call)
    return [(choice, sampling) for choice in range(body.n)]
