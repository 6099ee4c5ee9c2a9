"""Text Generation Inference's answers, from a request's finished (or streaming) jobs: the
GenerateResponse of /generate (with its details, the best of best_of sequences) and the
StreamResponse events of /generate_stream, each token's own with the last one carrying the whole
text and how the generation ended, as TGI sends them."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from tokenizers import Tokenizer

from api.context import AppContext
from api.openai_choices import ChoiceJob, ChoiceResult, expired_message, merged_events
from api.openai_logprobs import token_text_of
from api.sse import SSE_KEEPALIVE
from api.tgi_schemas import GenerateParameters
from protocol import FinishReason, StreamEntry
from protocol.redis_errors import REDIS_UNREACHABLE

log = logging.getLogger(__name__)


class TokenViews:
    """Tokens as TGI writes them: id, text, logprob, and whether the token is special."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self._text = token_text_of(tokenizer)
        self.special_ids = frozenset(
            token_id for token_id, added in tokenizer.get_added_tokens_decoder().items()
            if added.special) if tokenizer is not None else frozenset()

    def token(self, entry: StreamEntry) -> dict[str, Any]:
        return {"id": entry.token_id, "text": entry.text,
                "logprob": entry.logprobs.logprob if entry.logprobs is not None else None,
                "special": entry.token_id in self.special_ids}

    def top_tokens(self, entry: StreamEntry) -> list[dict[str, Any]]:
        if entry.logprobs is None:
            return []
        return [{"id": token_id, "text": self._text(token_id), "logprob": logprob,
                 "special": token_id in self.special_ids} for token_id, logprob in entry.logprobs.top]

    def prefill_token(self, token_id: int, logprob: float | None) -> dict[str, Any]:
        return {"id": token_id, "text": self._text(token_id), "logprob": logprob}


def finish_reason(done: StreamEntry, text: str, stop: list[str]) -> str:
    """TGI's name: length, stop_sequence (the text ends with a stop string: TGI keeps it, and so
    does the job, include_stop_str_in_output) or eos_token; Carpool's own for an end TGI has no
    name for."""
    reason = done.finish_reason
    if reason is FinishReason.LENGTH:
        return "length"
    if reason is FinishReason.STOP:
        return "stop_sequence" if any(text.endswith(s) for s in stop) else "eos_token"
    return reason.value if reason is not None else "length"


def sequence_logprob(result: ChoiceResult) -> float:
    """The sum of a sequence's token logprobs: best_of keeps the highest."""
    return sum(entry.logprobs.logprob for entry in result.tokens if entry.logprobs is not None)


async def generate_response(ctx: AppContext, params: GenerateParameters, results: list[ChoiceResult],
                            views: TokenViews, seeds: list[int | None], prompt: str) -> dict[str, Any]:
    """/generate's answer: the best sequence's text (after the prompt with return_full_text) and,
    with details, its tokens, the prompt's (decoder_input_details) and the other sequences."""
    best = max(results, key=sequence_logprob)
    answer: dict[str, Any] = {"generated_text": (prompt if params.return_full_text else "") + best.text}
    if params.details:
        details = await _sequence(ctx, params, best, views, seeds[best.job.index])
        del details["generated_text"]
        if len(results) > 1:
            details["best_of_sequences"] = [
                await _sequence(ctx, params, result, views, seeds[result.job.index])
                for result in results if result is not best]
        answer["details"] = details
    return answer


async def _sequence(ctx: AppContext, params: GenerateParameters, result: ChoiceResult,
                    views: TokenViews, seed: int | None) -> dict[str, Any]:
    sequence: dict[str, Any] = {
        "generated_text": result.text, "finish_reason": finish_reason(result.done, result.text, params.stop),
        "generated_tokens": result.done.completion_tokens, "seed": seed,
        "prefill": await _prefill(ctx, result.job, views) if params.decoder_input_details else [],
        "tokens": [views.token(entry) for entry in result.tokens]}
    if params.top_n_tokens:
        sequence["top_tokens"] = [views.top_tokens(entry) for entry in result.tokens]
    return sequence


async def _prefill(ctx: AppContext, job: ChoiceJob, views: TokenViews) -> list[dict[str, Any]]:
    prompt = await ctx.jobs.prompt_logprobs(job.job_id)
    if prompt is None:
        return []
    return [views.prefill_token(token_id, entry.logprob if entry is not None else None)
            for token_id, entry in zip(prompt.token_ids, prompt.entries, strict=True)]


async def stream_events(ctx: AppContext, job: ChoiceJob, params: GenerateParameters,
                        views: TokenViews, seed: int | None, prompt: str) -> AsyncIterator[bytes]:
    """/generate_stream's `data:` events: one a token, sent once the next entry shows whether it
    is the last (which carries the whole text and the details); a failure as TGI's error event."""
    held: StreamEntry | None = None  # the latest token, not yet sent
    texts: list[str] = []
    last_sent = time.monotonic()

    def event(entry: StreamEntry, done: StreamEntry | None = None) -> bytes:
        payload: dict[str, Any] = {"index": entry.index + 1, "token": views.token(entry),
                                   "generated_text": None, "details": None}
        if params.top_n_tokens:
            payload["top_tokens"] = views.top_tokens(entry)
        if done is not None:
            payload["generated_text"] = (prompt if params.return_full_text else "") + "".join(texts)
            payload["details"] = {"finish_reason": finish_reason(done, "".join(texts), params.stop),
                                  "generated_tokens": done.completion_tokens, "seed": seed,
                                  "input_length": done.prompt_tokens}
        return _data(payload)

    try:
        async with aclosing(merged_events(ctx, [job])) as events:
            async for _, stream_event in events:
                if stream_event is None:
                    if time.monotonic() - last_sent >= ctx.settings.sse_keepalive_s:
                        last_sent = time.monotonic()
                        yield SSE_KEEPALIVE
                    continue
                last_sent = time.monotonic()
                entry = stream_event.entry
                if not stream_event.is_done:
                    if held is not None:
                        yield event(held)
                    held = entry
                    texts.append(entry.text)
                    continue
                if entry.finish_reason is FinishReason.ERROR:
                    yield _error(f"The job failed: {entry.error or 'no reason given'}", "generation")
                elif held is None:
                    yield _error(f"The generation ended ({_reason(entry)}) before its first token",
                                 "incomplete_generation")
                else:
                    yield event(held, entry)
                return
        # Its keys went before it ended (openai_choices.unended_job): no final entry will come.
        yield _error(expired_message(job.job_id), "incomplete_generation")
    except REDIS_UNREACHABLE as exc:
        log.warning("Redis lost while streaming job %s: %s", job.job_id, exc)
        yield _error("Redis became unreachable while streaming; the job goes on: follow it at "
                     f"/v1/jobs/{job.job_id}/stream", "unavailable")


def _reason(done: StreamEntry) -> str:
    return done.finish_reason.value if done.finish_reason is not None else "no reason"


def _error(message: str, error_type: str) -> bytes:
    return _data({"error": message, "error_type": error_type})


def _data(payload: dict[str, Any]) -> bytes:
    return f"data:{json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()

