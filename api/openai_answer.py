"""The non-streamed OpenAI answer of finished choice jobs: results read from their streams, then
the chat.completion / text_completion body (choices, logprobs, usage). Shared by the OpenAI
routes (a client waiting) and the Batch API (a line's response body)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import aclosing
from typing import Any

from api.context import AppContext
from api.errors import NotFoundError
from api.openai_choices import (
    ChoiceJob,
    ChoiceResult,
    cancel_jobs,
    expired_message,
    merged_events,
    summed_usage,
    unended_job,
)
from api.openai_chunks import openai_finish_reason, usage_dict
from api.openai_logprobs import LogprobsFormatter, token_text_of, vllm_prompt_logprobs
from api.openai_schemas import ChatCompletionRequest, CompletionRequest
from api.tool_parsers import ToolParser, chat_message
from protocol import SamplingParams, StreamEntry


async def logprobs_formatters(ctx: AppContext, model: str, sampling: SamplingParams,
                              jobs: list[ChoiceJob], is_chat: bool,
                              ids_as_tokens: bool = False) -> dict[int, LogprobsFormatter]:
    """One formatter per choice (each keeps its own running text offset, past its echo); none
    when the request asked for no logprobs. `ids_as_tokens`: return_tokens_as_token_ids."""
    if sampling.logprobs is None:
        return {}
    token_text = token_text_of(await ctx.jobs.model_tokenizer(model))
    return {job.index: LogprobsFormatter(is_chat, token_text, sampling.logprobs,
                                         text_offset=len(job.echo), ids_as_tokens=ids_as_tokens)
            for job in jobs}


async def wait_for_results(ctx: AppContext, jobs: list[ChoiceJob],
                           has_left: Callable[[], Awaitable[bool]] | None = None,
                           ) -> list[ChoiceResult] | None:
    """Every choice's text, token entries and final entry, in index order; None after canceling
    them all for a client that left (`has_left`, checked at every event)."""
    pieces: dict[int, list[StreamEntry]] = {job.index: [] for job in jobs}
    done: dict[int, ChoiceResult] = {}
    # aclosing: leaving early stops the followers now, not when the generator is collected.
    async with aclosing(merged_events(ctx, jobs)) as events:
        async for job, event in events:
            if has_left is not None and await has_left():
                await cancel_jobs(ctx, [j for j in jobs if j.index not in done])
                return None
            if event is None:
                continue
            if event.is_done:
                tokens = pieces[job.index]
                done[job.index] = ChoiceResult(job, "".join(entry.text for entry in tokens),
                                               event.entry, tuple(tokens))
            elif not job.prompt_only:  # (the token run to score a prompt is never shown)
                pieces[job.index].append(event.entry)
    missing = unended_job(jobs, set(done))
    if missing is not None:  # nothing to show
        raise NotFoundError(expired_message(missing.job_id), code="job_expired")
    return [done[job.index] for job in jobs]


async def answer_body(ctx: AppContext, body: CompletionRequest | ChatCompletionRequest,
                      results: list[ChoiceResult], *, is_chat: bool, response_id: str,
                      created: int, model: str, sampling: SamplingParams,
                      formatters: dict[int, LogprobsFormatter],
                      tool_parser: ToolParser | None = None,
                      service_tier: str | None = None) -> dict[str, Any]:
    """The whole answer of choices that all finished (none failed); `service_tier`: the tier it
    names (None: none, as when the request named none)."""
    # vLLM's prompt_logprobs field (never streamed: the schema refuses it with stream), written
    # with each job's first token.
    vllm_prompt: dict[int, list[dict[str, dict[str, Any]] | None] | None] = {}
    if body.prompt_logprobs is not None:
        token_text = token_text_of(await ctx.jobs.model_tokenizer(model))
        for result in results:
            job = result.job
            if not is_chat or job.index == 0:  # chat's is one per response, as vLLM's
                vllm_prompt[job.index] = vllm_prompt_logprobs(
                    await ctx.jobs.prompt_logprobs(job.job_id), body.prompt_logprobs, token_text)
    choices: list[dict[str, Any]] = []
    for result in results:
        reason = openai_finish_reason(result.done.finish_reason)
        formatter = formatters.get(result.job.index)
        logprobs = None
        if formatter is not None:
            # The prompt's part first: the completion's text offsets continue after it.
            prompt = (await prompt_logprobs_of(ctx, formatter, result.job)
                      if sampling.prompt_logprobs is not None else None)
            logprobs = formatter.format(result.tokens)
            if prompt is not None:
                logprobs = {name: prompt[name] + logprobs[name] for name in logprobs}
        if is_chat:
            message, reason = chat_message(tool_parser, result.text, reason, result.job.job_id)
            if result.job.echo:  # vLLM's chat echo: the continued assistant message reads whole
                message["content"] = result.job.echo + (message.get("content") or "")
            choices.append({"index": result.job.index, "logprobs": logprobs,
                            "finish_reason": reason, "message": message})
        else:
            choices.append({"index": result.job.index, "text": result.job.echo + result.text,
                            "logprobs": logprobs, "finish_reason": reason})
            if result.job.index in vllm_prompt:
                choices[-1]["prompt_logprobs"] = vllm_prompt[result.job.index]
            if body.return_token_ids:  # vLLM's: the completion's choice carries both
                choices[-1]["prompt_token_ids"] = prompt_ids_of(result.job)
        if body.return_token_ids:
            choices[-1]["token_ids"] = [entry.token_id for entry in result.tokens]
    answer: dict[str, Any] = {
        "id": response_id, "object": "chat.completion" if is_chat else "text_completion",
        "created": created, "model": model, "choices": choices,
        "usage": usage_dict(*summed_usage(results))}
    if is_chat and vllm_prompt:
        answer["prompt_logprobs"] = vllm_prompt[0]
    if is_chat and body.return_token_ids:  # vLLM's: one per chat response (its choices share it)
        answer["prompt_token_ids"] = prompt_ids_of(results[0].job)
    if service_tier is not None:
        answer["service_tier"] = service_tier
    return answer


def prompt_ids_of(job: ChoiceJob) -> list[int]:
    """The choice's prompt token ids, as the model saw them: with return_token_ids the API
    decided them (api/job_service.py), so the job was queued with exactly those."""
    return list(job.prompt_token_ids or ())


async def prompt_logprobs_of(ctx: AppContext, formatter: LogprobsFormatter,
                             job: ChoiceJob) -> dict[str, Any] | None:
    """The choice's prompt part of `echo` with logprobs; None when the job wrote none (it ended
    before its first token)."""
    prompt = await ctx.jobs.prompt_logprobs(job.job_id)
    return formatter.format_prompt(prompt) if prompt is not None else None
