"""The choices of one OpenAI request, one job each (n per prompt), followed as one answer.

The jobs were queued together (JobService.submit_many); here their streams are read side by
side and merged: chunk by chunk for `stream: true` (each chunk names its choice's index), or to
the end of the last one. A client that leaves has every one of its jobs canceled.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from api.context import AppContext
from api.errors import JobFailedError
from api.idempotency_key import REPLAYED_HEADER
from api.job_service import AcceptedJob
from api.job_stream import StreamEvent
from api.stream_outages import follow_through_outages
from protocol import FinishReason, StreamEntry
from protocol.redis_errors import REDIS_UNAVAILABLE

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ChoiceJob:
    index: int  # prompt_number * n + choice number, as OpenAI and vLLM number choices
    prompt_number: int
    job_id: str
    echo: str = ""  # put before the choice's text (`echo`: the prompt; on chat the last assistant message)
    prompt_tokens: int = 0  # the API's count (0: unknown), for usage before the job ends
    # Submitted by this request (not an Idempotency-Key replay): when (monotonic) it had no
    # token yet for sure (AcceptedJob.fresh_since); None for a replay.
    fresh_since: float | None = None
    # The choice is its echo alone (CompletionRequest.scores_prompt): its tokens are not shown.
    prompt_only: bool = False
    # The token ids its job was queued with (None: a text or a chat the worker tokenizes); with
    # return_token_ids they were decided by the API, so they are what the model saw.
    prompt_token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class ChoiceResult:
    job: ChoiceJob
    text: str  # generated text only (without the echo)
    done: StreamEntry
    tokens: tuple[StreamEntry, ...] = ()  # its token entries (their logprobs, when asked)


def choice_jobs(accepted: list[AcceptedJob], n: int, echoes: list[str],
                prompt_only: bool = False) -> list[ChoiceJob]:
    """The accepted jobs of one request as its choices, numbered as submitted (n per prompt);
    `echoes`: per job, the text its choice starts with."""
    return [ChoiceJob(index=index, prompt_number=index // n, job_id=job.spec.job_id, echo=echo,
                      prompt_tokens=job.prompt_tokens or 0, fresh_since=job.fresh_since,
                      prompt_only=prompt_only, prompt_token_ids=_ids_of(job))
            for index, (job, echo) in enumerate(zip(accepted, echoes, strict=True))]


def _ids_of(job: AcceptedJob) -> tuple[int, ...] | None:
    ids = job.spec.prompt_token_ids
    return tuple(ids) if ids is not None else None


def job_headers(accepted: list[AcceptedJob]) -> dict[str, str]:
    """The answer's headers naming its jobs (and saying when an Idempotency-Key replayed them)."""
    headers = {"X-Carpool-Job-Id": accepted[0].spec.job_id}
    if len(accepted) > 1:
        headers["X-Carpool-Job-Ids"] = ",".join(job.spec.job_id for job in accepted)
    if accepted[0].is_replay:
        headers[REPLAYED_HEADER] = "true"
    return headers


class _End:
    """A follower's stream ended (after its final entry, or because the job expired)."""


async def merged_events(
        ctx: AppContext, jobs: list[ChoiceJob],
) -> AsyncGenerator[tuple[ChoiceJob, StreamEvent | None], None]:
    """Every job's stream events as they come, tagged with their job; (job, None) when a wait
    brought nothing (time for a keep-alive). Ends when every stream has ended."""
    queue: asyncio.Queue[tuple[ChoiceJob, StreamEvent | None | _End | Exception]] = asyncio.Queue()

    async def follow(job: ChoiceJob) -> None:
        try:
            async for event in follow_through_outages(ctx.stream(job.job_id),
                                                      ctx.settings.stream_outage_s, ctx.recovery,
                                                      fresh_since=job.fresh_since,
                                                      tick_s=ctx.settings.sse_keepalive_s):
                await queue.put((job, event))
            await queue.put((job, _End()))
        except Exception as exc:  # handed to the reader, which raises it in the route's task
            await queue.put((job, exc))

    tasks = [asyncio.create_task(follow(job)) for job in jobs]
    remaining = len(tasks)
    try:
        while remaining:
            job, item = await queue.get()
            if isinstance(item, _End):
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield job, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def unended_job(jobs: list[ChoiceJob], ended: set[int]) -> ChoiceJob | None:
    """The first of `jobs` whose stream ended without its final entry (`ended`: the indexes of
    those that had one): its keys went first (a retention shorter than the job, or a Redis that
    lost its data), so no final entry will come."""
    return next((job for job in jobs if job.index not in ended), None)


def expired_message(job_id: str) -> str:
    """What every route says of such a job, streamed or not."""
    return f"Job '{job_id}' expired before it ended"


async def cancel_jobs(ctx: AppContext, jobs: list[ChoiceJob]) -> None:
    """Cancel the jobs of a client that left (or of a request one of whose choices failed)."""
    for job in jobs:
        try:
            status = await ctx.jobs.cancel_unowned(job.job_id)
            log.info("client left before job %s ended: canceled (status now %s)", job.job_id,
                     status.value if status else "gone")
        except REDIS_UNAVAILABLE as exc:
            log.warning("could not cancel abandoned job %s: %s", job.job_id, exc)


async def raise_if_failed(ctx: AppContext, results: list[ChoiceResult],
                          headers: dict[str, str]) -> None:
    """A 500 naming the reason when a choice's job failed, its sibling choices canceled first."""
    failed = next((r for r in results if r.done.finish_reason is FinishReason.ERROR), None)
    if failed is not None:
        await cancel_jobs(ctx, [r.job for r in results if r is not failed])
        raise JobFailedError(f"The job failed: {failed.done.error or 'no reason given'}",
                             code="job_failed", headers=headers)


def summed_usage(results: list[ChoiceResult]) -> tuple[int, int, int]:
    """(prompt_tokens, completion_tokens, cached_tokens) of a whole answer: each prompt counted
    once however many choices it has (as OpenAI and vLLM count), every choice's completion.
    A prompt's cached tokens are those its first choice found."""
    firsts: dict[int, StreamEntry] = {}
    for result in sorted(results, key=lambda r: r.job.index):
        firsts.setdefault(result.job.prompt_number, result.done)
    return (sum(done.prompt_tokens for done in firsts.values()),
            sum(result.done.completion_tokens for result in results),
            sum(done.cached_tokens for done in firsts.values()))
