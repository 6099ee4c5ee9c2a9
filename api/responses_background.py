"""Background responses (`background: true`): answered at once, queued, and polled (or streamed:
api/responses_replay.py).

The request becomes its job as any response's does (api/responses_jobs.py); the answer is the
response object at status `queued`, stored with the job's id and the request, so that it can be
answered later. Nothing runs per response while the job does: a read settles it. A read of a
response whose job is still going answers its status now (`queued`, or `in_progress` once a
worker holds it); the first read after the job ended builds the finished response from the job's
stream, as the route would have answered it, and stores that in place of the pending one (two
readers racing both build the same object: the job's stream and end time are final). A failed job's response
is `failed` with the job's error; a canceled one's `cancelled` with what it had generated. The
settled record keeps the request, from which its events can be streamed again.

Cancel (POST /v1/responses/{id}/cancel) asks the job service to cancel the job and waits briefly
for it to end, as a worker stops a running job at its next step; a job that has not ended in
that time is still answered `cancelled` (the next read settles it with its output).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from api.context import AppContext
from api.conversation_turns import add_turn, conversation_history
from api.conversations_store import Conversation
from api.errors import InvalidRequestError, NotFoundError
from api.responses_conversation import output_messages
from api.responses_jobs import ended_response
from api.responses_schemas import ResponsesRequest
from api.responses_store import StoredResponse
from protocol import JobState, JobStatus

# How long a cancel waits for its job to end before answering.
CANCEL_WAIT_S = 2.0
_CANCEL_POLL_S = 0.05

_LIVE_STATUS = {JobStatus.QUEUED: "queued", JobStatus.PREEMPTED: "in_progress",
                JobStatus.RUNNING: "in_progress"}


async def history_of(ctx: AppContext, body: ResponsesRequest, owner: str) -> list[dict[str, Any]]:
    """The chat a response continues: its conversation's items, or the stored chat
    previous_response_id names, a background one settled first ([] for neither): a 404 when
    `owner` has no such conversation or stored no response of that id (or it is past its
    retention), a 400 while that response's job is still going (its output is not known yet)."""
    if body.conversation is not None:
        conversation = await ctx.conversations.get(body.conversation, owner, param="conversation")
        await settle_pending_turns(ctx, conversation)
        return await conversation_history(ctx, conversation)
    if not body.previous_response_id:
        return []
    stored = await settle(ctx, await ctx.responses.get(body.previous_response_id, owner,
                                                       "previous_response_id"))
    if stored.is_pending:
        raise InvalidRequestError(
            f"'previous_response_id' names response '{body.previous_response_id}', which is still "
            f"{stored.response['status']}: continue it once it has completed",
            param="previous_response_id")
    return stored.conversation


async def settle_pending_turns(ctx: AppContext, conversation: Conversation) -> None:
    """Settle the conversation's background responses whose jobs ended, so that their turns join
    it before it is read (by its next turn, or its items' listing); one still running joins once
    it has ended and something reads. `conversation` is its owner's (ConversationStore.get), so
    its responses are read as theirs."""
    for response_id in await ctx.conversations.pending(conversation.id):
        try:
            stored = await settle(ctx, await ctx.responses.get(response_id, conversation.owner))
        except NotFoundError:  # deleted, or past its retention: no turn will come
            stored = None
        if stored is None or not stored.is_pending:
            await ctx.conversations.drop_pending(conversation.id, response_id)


def pending(owner: str, body: ResponsesRequest, job_id: str, response: dict[str, Any],
            input_items: list[dict[str, Any]],
            conversation: list[dict[str, Any]]) -> StoredResponse:
    """What a background response is stored as until its job is settled: its response queued,
    the chat before its output, and the request that answers it later."""
    queued = {**response, "status": "queued"}
    return StoredResponse(owner, queued, input_items, conversation, job_id,
                          body.model_dump(mode="json", exclude_unset=True))


async def settle(ctx: AppContext, stored: StoredResponse) -> StoredResponse:
    """The stored response as it stands now: a settled one as it is; a pending one with its job's
    status, or, once the job ended, finished (and stored so)."""
    if stored.job_id is None or stored.request is None:
        return stored
    fields = await ctx.aio.hgetall(ctx.keys.state(stored.job_id))
    if not fields:  # the job's records expired before the response: nothing to answer from
        return dataclasses.replace(stored, response=_failed(
            stored.response, "job_expired", "The response's job expired before it was read"))
    state = JobState.from_fields(fields)
    if not state.status.is_final:
        return dataclasses.replace(stored, response={**stored.response,
                                                     "status": _LIVE_STATUS[state.status]})
    body = ResponsesRequest.model_validate(stored.request)
    if state.status is JobStatus.FAILED:
        response = _failed(stored.response, "server_error",
                           f"The job failed: {state.error or 'no reason given'}")
    else:
        # The stored conversation is the chat before the output: history and input together.
        response = await ended_response(ctx, body, state, [], stored.conversation)
    if state.finished_at:  # the job's end, not this read's: racing readers store one object
        response["completed_at"] = int(state.finished_at)
    settled = StoredResponse(stored.owner, response, stored.input_items,
                             stored.conversation + output_messages(response["output"]),
                             request=stored.request)
    await ctx.responses.save(settled)
    await add_turn(ctx, body.conversation, stored.input_items, response)
    return settled


async def cancel(ctx: AppContext, stored: StoredResponse) -> StoredResponse:
    """Cancel a background response's job; a settled one is answered as it is."""
    if not stored.response.get("background"):
        raise InvalidRequestError("Only a response made with background: true can be cancelled",
                                  param="response_id", location="path")
    if stored.job_id is None:
        return stored
    await ctx.jobs.cancel(stored.job_id, stored.owner)
    deadline = time.monotonic() + CANCEL_WAIT_S
    while True:
        now = await settle(ctx, stored)
        if now.job_id is None or time.monotonic() >= deadline:
            break
        await asyncio.sleep(_CANCEL_POLL_S)
    if now.job_id is not None:
        return dataclasses.replace(now, response={**now.response, "status": "cancelled"})
    return now


def _failed(response: dict[str, Any], code: str, message: str) -> dict[str, Any]:
    return {**response, "status": "failed", "error": {"code": code, "message": message},
            "completed_at": int(time.time())}
