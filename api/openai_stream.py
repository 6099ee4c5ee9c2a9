"""The chunks of one streamed OpenAI answer (chat or plain completion), as payload dicts: every
choice's stream read side by side (api/openai_choices.py), its text through the tool-call parser
when tools are in play, logprobs with the text they belong to, each choice's finish and the usage.
/v1/completions and /v1/chat/completions send them as `data:` lines; /v1/responses turns the
chat's into its own events (api/responses_events.py)."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from api.context import AppContext
from api.errors import openai_error_body
from api.openai_answer import prompt_ids_of, prompt_logprobs_of
from api.openai_choices import (
    ChoiceJob,
    ChoiceResult,
    cancel_jobs,
    expired_message,
    merged_events,
    summed_usage,
    unended_job,
)
from api.openai_chunks import ChunkWriter, openai_finish_reason, usage_dict
from api.openai_logprobs import LogprobsFormatter
from api.tool_parsers import CallIds, StreamingToolParser, ToolParser, tool_finish_reason
from protocol import FinishReason, StreamEntry
from protocol.redis_errors import REDIS_UNREACHABLE

log = logging.getLogger(__name__)


async def chunk_payloads(ctx: AppContext, jobs: list[ChoiceJob], writer: ChunkWriter,
                         formatters: dict[int, LogprobsFormatter],
                         prompt_logprobs: int | None,
                         tool_parser: ToolParser | None = None,
                         ) -> AsyncIterator[dict[str, Any] | None]:
    """The answer's chunks in order; None when a keep-alive is due (nothing came for a while)."""
    num_tokens = {job.index: 0 for job in jobs}
    # With tools, each choice's text goes through a streaming parser: content and tool_calls deltas.
    call_streams: dict[int, StreamingToolParser] = (
        {job.index: tool_parser.stream(CallIds(job.job_id)) for job in jobs}
        if tool_parser is not None else {})
    # Tokens whose text is held back (a possible stop string, a split character) send their
    # logprobs and ids with their choice's next chunk that carries text, or with its finish chunk.
    unsent: dict[int, list[StreamEntry]] = {job.index: [] for job in jobs}
    keeps_tokens = {job.index for job in jobs
                    if job.index in formatters or writer.return_token_ids}
    # A completion's prompt ids go on its choice's first chunk (chat's on its opening chunk).
    prompt_ids_due = ({job.index for job in jobs}
                      if writer.return_token_ids and not writer.is_chat else set())

    def prompt_ids(job: ChoiceJob) -> list[int] | None:
        if job.index not in prompt_ids_due:
            return None
        prompt_ids_due.discard(job.index)
        return prompt_ids_of(job)

    def take_unsent(job: ChoiceJob) -> dict[str, Any]:
        """The unsent tokens' logprobs and ids, as the next chunk of the choice carries them."""
        entries, unsent[job.index] = unsent[job.index], []
        formatter = formatters.get(job.index)
        return {"logprobs": formatter.format(entries) if formatter is not None and entries
                else None, "token_ids": [entry.token_id for entry in entries]}

    # stream_interval: each choice's text and token count since its last text chunk; its first
    # text goes at once (then interval tokens a chunk), the rest with its finish.
    pending_text = {job.index: "" for job in jobs}
    pending_tokens = {job.index: 0 for job in jobs}
    first_sent: set[int] = set()

    def text_due(job: ChoiceJob, text: str) -> str:
        """The text to send now for a token bringing `text` ("": none yet)."""
        if writer.stream_interval == 1:
            return text
        pending_text[job.index] += text
        pending_tokens[job.index] += 1
        due = pending_text[job.index]
        if not due or (job.index in first_sent
                       and pending_tokens[job.index] < writer.stream_interval):
            return ""  # (a first token whose text the worker holds back does not count as sent)
        first_sent.add(job.index)
        pending_text[job.index], pending_tokens[job.index] = "", 0
        return due

    def usage_so_far(job: ChoiceJob) -> dict[str, Any]:
        return usage_dict(job.prompt_tokens, num_tokens[job.index])

    def text_chunks(job: ChoiceJob, text: str) -> list[dict[str, Any]]:
        """The chunks that send `text` of the choice (none for ""), with the logprobs and ids of
        its tokens not sent yet."""
        if not text:  # text held back (a possible stop string, an interval) arrives later
            return []
        if job.index in call_streams:
            return [writer.delta(delta, job.index, usage_so_far(job), **take_unsent(job))
                    for delta in call_streams[job.index].feed(text)]
        return [writer.text(text, job.index, usage_so_far(job), **take_unsent(job),
                            prompt_token_ids=prompt_ids(job))]

    # echo with logprobs: a choice's echo chunk carries its prompt's logprobs, which the worker
    # writes with the first token, so it goes out when the choice's first entry arrives.
    echo_waits = {job.index for job in jobs if job.echo and job.index in formatters
                  and prompt_logprobs is not None}

    def openings() -> list[dict[str, Any]]:
        chunks = []
        for job in jobs:
            opening = writer.opening(job.index, usage_so_far(job),
                                     prompt_ids_of(job) if writer.return_token_ids else None)
            if opening is not None:
                chunks.append(opening)
            if job.echo and job.index not in echo_waits:
                chunks.append(writer.echo(job.echo, job.index, usage_so_far(job),
                                          prompt_token_ids=prompt_ids(job)))
        return chunks

    # The openings (chat's role chunks, echoes) go out with the first entry any choice brings,
    # as vLLM's do: a client that times its first chunk (vLLM's and others' benchmarks take it
    # as the first token) then measures the prefill, not the submission.
    opened = False
    last_sent = time.monotonic()
    results: list[ChoiceResult] = []
    try:
        async with aclosing(merged_events(ctx, jobs)) as events:
            async for job, event in events:
                if event is None:
                    if time.monotonic() - last_sent >= ctx.settings.sse_keepalive_s:
                        last_sent = time.monotonic()
                        yield None
                    continue
                last_sent = time.monotonic()
                if not opened:
                    opened = True
                    for chunk in openings():
                        yield chunk
                entry = event.entry
                if job.index in echo_waits:
                    echo_waits.discard(job.index)
                    yield writer.echo(job.echo, job.index, usage_so_far(job),
                                      await prompt_logprobs_of(ctx, formatters[job.index], job),
                                      prompt_ids(job))
                if not event.is_done:
                    num_tokens[job.index] += 1
                    if job.prompt_only:
                        continue  # the one token that brought the prompt's logprobs: not shown
                    if job.index in keeps_tokens:
                        unsent[job.index].append(entry)
                    text = text_due(job, entry.text)
                    for chunk in text_chunks(job, text):
                        yield chunk
                    continue
                for chunk in text_chunks(job, pending_text[job.index]):  # the interval's rest
                    yield chunk
                if entry.finish_reason is FinishReason.ERROR:
                    # The openai client raises APIError on a data line that carries "error".
                    yield openai_error_body(f"The job failed: {entry.error or 'no reason given'}",
                                            "server_error", None, "job_failed")
                    await cancel_jobs(ctx, [j for j in jobs if j is not job
                                            and j.index not in {r.job.index for r in results}])
                    break
                results.append(ChoiceResult(job, "", entry))
                reason_name = None
                call_stream = call_streams.get(job.index)
                if call_stream is not None:
                    for delta in call_stream.finish():  # (its tokens go with the finish chunk)
                        yield writer.delta(delta, job.index, usage_so_far(job), token_ids=[])
                    reason_name = tool_finish_reason(openai_finish_reason(entry.finish_reason),
                                                     call_stream.called)
                yield writer.finish(entry.finish_reason, job.index,
                                    usage_dict(entry.prompt_tokens, entry.completion_tokens),
                                    reason_name=reason_name, **take_unsent(job),
                                    prompt_token_ids=prompt_ids(job))
            else:
                gone = unended_job(jobs, {result.job.index for result in results})
                if gone is not None:
                    # Said as the answer without `stream` says it, not a stream that stops short
                    # as if it were whole.
                    yield openai_error_body(expired_message(gone.job_id),
                                            "invalid_request_error", None, "job_expired")
                elif writer.include_usage:
                    yield writer.usage(*summed_usage(results))
    except REDIS_UNREACHABLE as exc:
        # Headers are long sent: say it in the stream, as OpenAI does for mid-stream failures.
        job_ids = ", ".join(job.job_id for job in jobs)
        log.warning("Redis lost while streaming jobs %s: %s", job_ids, exc)
        yield openai_error_body("Redis became unreachable while streaming; the jobs go on: "
                                "follow them at /v1/jobs/<job id>/stream (job ids "
                                f"{job_ids})", "server_error", None, "service_unavailable")
