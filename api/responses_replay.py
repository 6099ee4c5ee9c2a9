"""A background response's events, streamed from its job's stream: live while the job runs, replayed
once it ended, numbered alike every time, so a client that lost its stream resumes after the last
`sequence_number` it got (GET /v1/responses/{id}?stream=true&starting_after=N), as OpenAI's.

The same numbering whatever the reading: the job's stream is read token by token (a run of
tokens written as one entry comes out as its tokens), each token's text is what it releases,
tool calls are parsed one token at a time and named from the job's id (api/tool_parsers.py), so
the events a token brings do not depend on when they are read. The stream's last event carries
the stored response, settled by it if no read had (api/responses_background.py), as GET answers.
Leaving does not cancel the job: a background response runs whoever watches.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from api.context import AppContext
from api.errors import InvalidRequestError, NotFoundError
from api.openai_chunks import ChunkWriter
from api.openai_stream import chunk_payloads
from api.responses_background import settle
from api.responses_events import ResponseEvents
from api.responses_jobs import JobReading, job_reading, message_id_of
from api.responses_schemas import ResponsesRequest
from api.responses_store import StoredResponse
from api.sse import SSE_KEEPALIVE, typed_event
from protocol import JobState
from protocol.redis_errors import REDIS_UNREACHABLE

log = logging.getLogger(__name__)


async def replay_of(ctx: AppContext, stored: StoredResponse) -> tuple[JobReading, bool]:
    """How to stream a stored response's events, and its request's logprobs wish: a 400 for a
    response made without background (its events were its request's answer), a 404 once its job
    is gone."""
    if not stored.response.get("background") or stored.request is None:
        raise InvalidRequestError("Only a response made with background: true can be streamed "
                                  "here; this one was answered to its request",
                                  param="stream", location="query")
    job_id = stored.response["id"].removeprefix("resp_")
    fields = await ctx.aio.hgetall(ctx.keys.state(job_id))
    if not fields:
        raise NotFoundError(f"The job of response '{stored.response['id']}' is gone: its events "
                            "cannot be streamed (GET it without stream)",
                            param="response_id", code="response_not_found")
    body = ResponsesRequest.model_validate(stored.request)
    return await job_reading(ctx, body, JobState.from_fields(fields)), body.wants_logprobs


async def response_events(ctx: AppContext, stored: StoredResponse, reading: JobReading,
                          with_logprobs: bool, starting_after: int | None) -> AsyncIterator[bytes]:
    """The response's events after `starting_after` (None: all), to its end."""
    job_id = reading.jobs[0].job_id
    events = ResponseEvents(reading.base, message_id_of(job_id), with_logprobs)
    writer = ChunkWriter(is_chat=True, response_id=reading.base["id"],
                         created=reading.base["created_at"], model=reading.base["model"],
                         include_usage=True)
    after = -1 if starting_after is None else starting_after

    def wanted(batch: list[dict[str, Any]]) -> list[bytes]:
        return [typed_event(event) for event in batch if event["sequence_number"] > after]

    for line in wanted(events.start()):
        yield line
    async for payload in chunk_payloads(ctx, reading.jobs, writer, reading.formatters, None,
                                        reading.parser):
        if payload is None:
            yield SSE_KEEPALIVE
            continue
        for line in wanted(events.chunk(payload)):
            yield line
    closing, response = events.end()
    try:  # the stored object, as GET answers it (a fresh read: another may have settled it)
        response = (await settle(ctx, await ctx.responses.get(
            reading.base["id"], stored.owner))).response
    except NotFoundError:
        pass  # deleted meanwhile: the events' own
    except REDIS_UNREACHABLE as exc:
        log.warning("could not settle response %s: %s", reading.base["id"], exc)
    for line in wanted([*closing[:-1], {**closing[-1], "response": response}]):
        yield line
