"""Who advances a batch, and why that is crash-safe and idempotent.

Every API process runs a BatchRunner (settings.batch_runner). Each tick it walks the open batches
(Keys.batches_open) and takes each one's Redis lock (SET NX PX); the holder moves that batch one
step: validate its input file; queue the next lines (each a normal Carpool job, on the `batch`
priority tier, so workers only give it idle seats); answer the lines whose jobs ended; once every
line is answered, write the output and error files and end the batch.

The lock only spares duplicate work; correctness never rests on it, since every step can be
repeated, by the same process after a crash or by two processes at once, to the same effect:
  - a line is queued with the job service's own Idempotency-Key (`carpool-batch:<batch>:<line>`),
    so queueing it again (crash between queueing and recording it) returns the jobs it already
    has; the submission cursor only says where to look next;
  - a line's answer is written with HSETNX, its count with it in one script (BatchStore.answer):
    the first answer stays and is counted once, so each line is answered exactly once;
  - the output and error files get ids derived from the batch id and are written once;
  - a status moves only from the statuses its step expects (BatchStore.transition), so a cancel
    racing a runner, or a stale runner, never moves a batch backwards.
All of it lives in Redis (with AOF a restart resumes where it stopped); a worker killed mid-batch
only delays lines: its jobs are requeued once their leases lapse and finish on another worker.

Why here and not counters the workers bump as jobs end: a line's answer is an OpenAI response
body, built by the API's code from the job's stream (api.openai_answer), and the worker knows
nothing of batches (nor should its per-step round trip grow). The cost is a poll: one HGET per
unanswered job and tick, pipelined.

`end_batch` is the one place a batch reaches a final status (completed, failed, expired,
cancelled): the hook for a batch webhook (batch.completed / .failed / .expired / .cancelled).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from typing import Any

import anyio.to_thread

from api.batch_files import OUTPUT_PURPOSE, BatchInputLine, FileStore, parse_batch_input
from api.batch_store import ERROR, OUTPUT, BatchRecord, BatchStatus, BatchStore, LineJobs
from api.context import AppContext
from api.errors import (
    ApiError,
    InvalidRequestError,
    KeyLimitError,
    NotFoundError,
    QueueFullError,
    ServiceUnavailableError,
    openai_error_body,
    validated,
)
from api.job_service import AcceptedJob
from api.openai_answer import answer_body, logprobs_formatters, wait_for_results
from api.openai_choices import ChoiceJob
from api.openai_requests import chat_requests, common_fields, completion_requests
from api.openai_schemas import ChatCompletionRequest, CompletionRequest
from api.responses_background import history_of
from api.responses_conversation import chat_messages
from api.responses_jobs import ended_response, keep_response, submit_response
from api.responses_schemas import ResponsesRequest
from api.tool_parsers import get_parser
from api.webhook_urls import webhook_url_of
from protocol import JobState, JobStatus, Priority
from protocol.redis_errors import REDIS_REFUSES_WRITES, REDIS_UNREACHABLE, why_writes_are_refused

log = logging.getLogger(__name__)

CHAT_URL = "/v1/chat/completions"
RESPONSES_URL = "/v1/responses"
# Past any one step (a lapsed lock only lets another runner repeat work), and short, so a lock
# left by a process that died (or a Redis that restarted) mid-step holds its batch up briefly.
_LOCK_TTL_MS = 15_000
# How long a cancelled or expired batch waits for its canceled jobs to end (OpenAI's batches stay
# cancelling for up to 10 minutes); a job still unended then is answered as never run.
_WIND_DOWN_GRACE_S = 600.0


@dataclasses.dataclass(frozen=True, slots=True)
class _Queued:
    """What a line was queued as: its jobs, the text each choice starts with (echo), its n, and
    whether tool calls are parsed out of its replies."""

    accepted: list[AcceptedJob]
    echoes: list[str]
    n: int
    parses_calls: bool


class _Later(Exception):
    """The queue is full or Redis is away: queue the rest of the lines at a later tick."""


class BatchRunner:
    def __init__(self, ctx: AppContext) -> None:
        self.ctx = ctx
        self.store: BatchStore = ctx.batches
        self.files: FileStore = ctx.files
        self.settings = ctx.settings
        # Parsed input files of the batches this process advanced (re-read after a restart).
        self._inputs: dict[str, list[BatchInputLine]] = {}
        # The queued lines' jobs (written once, so safe to keep), and where the next poll of a
        # batch's unanswered lines starts (the polls take turns over them).
        self._lines: dict[str, dict[int, LineJobs]] = {}
        self._poll_from: dict[str, int] = {}
        # The lines known answered (by this runner, or read back), per batch: read again from
        # Redis only when the batch's counts say some were answered elsewhere (_answered_lines).
        self._answered: dict[str, set[int]] = {}

    async def run_forever(self) -> None:
        task = asyncio.current_task()
        while True:
            try:
                await self.tick()
            except REDIS_UNREACHABLE as exc:
                log.warning("batch runner: Redis unreachable (%s); retrying", exc)
            except REDIS_REFUSES_WRITES as exc:
                log.warning("batch runner: Redis refuses writes: %s (%s); retrying",
                            why_writes_are_refused(exc), exc)
            except Exception:  # a bug must not stop every batch of this process for good
                log.exception("batch runner: tick failed")
            # A cancel (the API shutting down) that reached a Redis call as it failed may come
            # out as that call's error instead: the loop must still end, or shutdown waits on it.
            if task is not None and task.cancelling():
                raise asyncio.CancelledError
            await asyncio.sleep(self.settings.batch_tick_s)

    async def tick(self) -> None:
        """Advance every open batch whose lock this process gets, one step each."""
        for batch_id in await self.store.open_ids():
            token = uuid.uuid4().hex
            if not await self.store.lock(batch_id, token, _LOCK_TTL_MS):
                continue  # another process advances it now
            try:
                await self.advance(batch_id)
            finally:
                await self.store.unlock(batch_id, token)

    async def advance(self, batch_id: str) -> None:
        try:
            batch = await self.store.get(batch_id)
        except ApiError:
            await self.store.close(batch_id)  # its hash is gone: nothing left to advance
            return
        if batch.status.is_final:
            await self.store.close(batch_id)
            self._forget(batch_id)
            return
        if batch.status is BatchStatus.CANCELLING:
            await self._wind_down(batch, BatchStatus.CANCELLED, "batch_cancelled",
                                  "The batch was cancelled before this request ran")
        elif time.time() >= batch.expires_at and batch.status in (BatchStatus.VALIDATING,
                                                                  BatchStatus.IN_PROGRESS):
            await self._wind_down(batch, BatchStatus.EXPIRED, "batch_expired",
                                  "This request could not be executed before the completion "
                                  "window expired")
        elif batch.status is BatchStatus.VALIDATING:
            await self._validate(batch)
        elif batch.status is BatchStatus.IN_PROGRESS:
            await self._progress(batch)
        elif batch.status is BatchStatus.FINALIZING:
            await self._finalize(batch, BatchStatus.COMPLETED, (BatchStatus.FINALIZING,))

    # validating -> in_progress | failed
    async def _validate(self, batch: BatchRecord) -> None:
        try:
            lines = await self._input(batch)
        except ApiError as exc:
            await self._fail(batch, [{"code": exc.code or "invalid_file", "message": exc.message,
                                      "param": "input_file_id", "line": None}])
            return
        errors = [{"code": "invalid_url", "param": "url", "line": line.line_number,
                   "message": f"The line's url is {line.url}, but the batch's endpoint is "
                              f"{batch.endpoint}: every line of a batch must use its endpoint"}
                  for line in lines if line.url != batch.endpoint]
        if errors:
            await self._fail(batch, errors[:100])
            return
        await self.store.transition(batch.id, (BatchStatus.VALIDATING,), BatchStatus.IN_PROGRESS,
                                    total=len(lines))

    async def _input(self, batch: BatchRecord) -> list[BatchInputLine]:
        lines = self._inputs.get(batch.id)
        if lines is None:
            content = await self.files.content(batch.input_file_id, batch.owner)
            lines = await anyio.to_thread.run_sync(  # seconds for a big file: off the event loop
                parse_batch_input, content.encode(), self.settings.max_batch_lines)
            self._inputs[batch.id] = lines
        return lines

    async def _fail(self, batch: BatchRecord, errors: list[dict[str, Any]]) -> None:
        await self.end_batch(batch, BatchStatus.FAILED, (BatchStatus.VALIDATING,),
                             errors=json.dumps(errors))

    # in_progress -> finalizing -> completed
    async def _progress(self, batch: BatchRecord) -> None:
        if batch.submitted < batch.total:
            await self._submit_some(batch)
            batch = await self.store.get(batch.id)
        await self._answer_ended(batch, poll_lines=self.settings.batch_poll_lines)
        batch = await self.store.get(batch.id)
        if batch.submitted >= batch.total and batch.completed + batch.failed >= batch.total:
            if await self.store.transition(batch.id, (BatchStatus.IN_PROGRESS,),
                                           BatchStatus.FINALIZING):
                await self._finalize(batch, BatchStatus.COMPLETED, (BatchStatus.FINALIZING,))

    async def _submit_some(self, batch: BatchRecord) -> None:
        try:
            lines = await self._input(batch)
        except ApiError as exc:  # the input file was deleted (or expired) mid-batch
            for index in range(batch.submitted, batch.total):
                await self._write_answer(batch.id, index, ERROR, _error_line(
                    f"line-{index}", "input_file_missing",
                    f"The batch's input file is gone ({exc.message}): this request was never run"))
                await self.store.record_line(batch.id, index, None)
            return
        end = min(batch.total, batch.submitted + self.settings.batch_submit_lines)
        for line in lines[batch.submitted:end]:
            try:
                jobs = await self._submit_line(batch, line)
            except _Later:
                return
            await self.store.record_line(batch.id, line.index, jobs)

    async def _submit_line(self, batch: BatchRecord, line: BatchInputLine) -> LineJobs | None:
        """Queue one line as jobs; a line refused (bad body, unknown model, too long) is answered
        in the error file at once, with the error its route would have answered (None)."""
        try:
            if line.body.get("stream"):
                raise InvalidRequestError("'stream' is not available in a batch: each request's "
                                          "answer is written whole to the output file",
                                          param="stream")
            if line.body.get("background"):
                raise InvalidRequestError("'background' is not available in a batch: a batch's "
                                          "lines run in the background already",
                                          param="background")
            if line.url == RESPONSES_URL and line.body.get("conversation") is not None:
                raise InvalidRequestError("'conversation' is not available in a batch: lines run "
                                          "in any order, so none can take turns in one; continue "
                                          "a stored response with previous_response_id",
                                          param="conversation")
            queue = self._queue_response if line.url == RESPONSES_URL else self._queue_completion
            queued = await queue(batch, line)
        except (QueueFullError, KeyLimitError, ServiceUnavailableError) as exc:
            log.info("batch %s: line %d waits (%s)", batch.id, line.index, exc.message)
            raise _Later from exc
        except ApiError as exc:
            status = 400 if isinstance(exc, InvalidRequestError) else exc.status_code
            await self._write_answer(batch.id, line.index, ERROR, _response_line(
                line.custom_id, f"{batch.id}-{line.index}", status,
                openai_error_body(exc.message, exc.error_type, exc.param, exc.code)))
            return None
        return LineJobs(custom_id=line.custom_id, body=line.body,
                        job_ids=[job.spec.job_id for job in queued.accepted],
                        prompt_tokens=[job.prompt_tokens or 0 for job in queued.accepted],
                        echoes=queued.echoes, n=queued.n, parses_calls=queued.parses_calls,
                        prompt_token_ids=_prompt_ids(line, queued.accepted))

    async def _queue_completion(self, batch: BatchRecord, line: BatchInputLine) -> _Queued:
        """A chat or plain completion line, queued as its route queues the request."""
        body: ChatCompletionRequest | CompletionRequest = (
            validated(ChatCompletionRequest, line.body) if line.url == CHAT_URL
            else validated(CompletionRequest, line.body))
        common = common_fields(body, batch.owner, priority=Priority.BATCH,
                               idempotency_key=_idempotency_key(batch, line),
                               **webhook_url_of(body.webhook_url, {}))
        if isinstance(body, ChatCompletionRequest):
            chat = chat_requests(body, self.settings, common)
            accepted = await self.ctx.jobs.submit_many(chat.requests)
            return _Queued(accepted, [chat.echo if body.echo else ""] * len(accepted), body.n,
                           chat.calling.parses_calls)
        accepted = await self.ctx.jobs.submit_many(completion_requests(body, self.settings, common))
        return _Queued(accepted, [(job.prompt_text or "") if body.echo else "" for job in accepted],
                       body.n, parses_calls=False)

    async def _queue_response(self, batch: BatchRecord, line: BatchInputLine) -> _Queued:
        """A /v1/responses line: its one chat completion job, as the route queues it."""
        body = validated(ResponsesRequest, line.body)
        submitted = await submit_response(self.ctx, body, batch.owner,
                                          await history_of(self.ctx, body, batch.owner),
                                          priority=Priority.BATCH,
                                          idempotency_key=_idempotency_key(batch, line))
        return _Queued(submitted.accepted, [""], 1, submitted.parses_calls)

    async def _write_answer(self, batch_id: str, index: int, kind: str, line: dict[str, Any]) -> None:
        """Line `index`'s answer (the first one written stays: BatchStore.answer); the line is
        answered either way."""
        await self.store.answer(batch_id, index, kind, line)
        self._answered.setdefault(batch_id, set()).add(index)

    async def _answered_lines(self, batch: BatchRecord) -> set[int]:
        """The lines answered so far. [redis-cost] Every answer bumps the batch's completed or
        failed count in its own script, so while those add up to the lines this runner knows
        answered, none was answered elsewhere (another process holding the lock for a while), and
        the answers' hash is not read again: for a batch of 50,000 lines that read was 50,000
        fields every tick. The known lines are all truly answered, so a count read a moment ago
        can only make this runner poll a line another answered meanwhile, whose answer then stays."""
        known = self._answered.setdefault(batch.id, set())
        if len(known) != batch.completed + batch.failed:
            known |= await self.store.answered(batch.id)
        return known

    async def _queued_lines(self, batch: BatchRecord, answered: set[int]) -> dict[int, LineJobs]:
        """The queued lines not answered yet (read from Redis once each, then kept here)."""
        cache = self._lines.setdefault(batch.id, {})
        unread = [index for index in range(batch.submitted)
                  if index not in cache and index not in answered]
        if unread:
            cache.update(await self.store.lines_at(batch.id, unread))
        return {index: line for index, line in cache.items() if index not in answered}

    async def _answer_ended(self, batch: BatchRecord, ending: tuple[str, str] | None = None,
                            poll_lines: int | None = None) -> set[int]:
        """Answer the queued lines whose jobs all ended, polling at most `poll_lines` of them
        (taking turns: a big batch costs each tick a bounded number of reads); returns the lines
        polled and still unanswered. `ending` (code, message): the batch is winding down, so a
        canceled job's line says so."""
        pending = await self._queued_lines(batch, await self._answered_lines(batch))
        indexes = sorted(pending)
        if poll_lines is not None and len(indexes) > poll_lines:
            start = self._poll_from.get(batch.id, 0)
            turn = [i for i in indexes if i >= start][:poll_lines]
            turn += indexes[:poll_lines - len(turn)]  # wrap around
            self._poll_from[batch.id] = turn[-1] + 1
            pending = {index: pending[index] for index in turn}
        statuses = await self._statuses([job_id for line in pending.values() for job_id in line.job_ids])
        waiting: set[int] = set()
        for index, line in sorted(pending.items()):
            ended = [statuses.get(job_id) for job_id in line.job_ids]
            if all(status is not None and status.is_final for status in ended):
                await self._write_answer(batch.id, index,
                                         *await self._answer(batch, line, ended, ending))
            elif any(status is None for status in ended):
                await self._write_answer(batch.id, index, ERROR, _error_line(
                    line.custom_id, "job_expired", "The request's job expired before its answer "
                    "was written (CARPOOL_RESULT_TTL_S is shorter than the batch took)"))
            else:
                waiting.add(index)
        return waiting

    async def _statuses(self, job_ids: list[str]) -> dict[str, JobStatus | None]:
        async with self.ctx.aio.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hget(self.ctx.keys.state(job_id), "status")
            replies = await pipe.execute()
        return {job_id: JobStatus(reply) if reply else None for job_id, reply in zip(job_ids, replies)}

    async def _answer(self, batch: BatchRecord, line: LineJobs, ended: list[JobStatus | None],
                      ending: tuple[str, str] | None) -> tuple[str, dict[str, Any]]:
        request_id = line.job_ids[0]
        if JobStatus.FAILED in ended:
            job_id = line.job_ids[ended.index(JobStatus.FAILED)]
            error = await self.ctx.aio.hget(self.ctx.keys.state(job_id), "error")
            reason = (error.decode() if isinstance(error, bytes) else error) or "no reason given"
            return ERROR, _response_line(line.custom_id, request_id, 500, openai_error_body(
                f"The job failed: {reason}", "server_error", None, "job_failed"))
        if JobStatus.CANCELED in ended:
            code, message = ending or ("request_cancelled", "The request's job was canceled")
            return ERROR, _error_line(line.custom_id, code, message)
        if batch.endpoint == RESPONSES_URL:
            return OUTPUT, _response_line(line.custom_id, request_id, 200,
                                          await self._response(batch.owner, line))
        is_chat = batch.endpoint == CHAT_URL
        body = (ChatCompletionRequest if is_chat else CompletionRequest).model_validate(line.body)
        # The sampling the line's first choice was queued with (its logprobs counts), as queued.
        common = common_fields(body, "")
        sampling = (chat_requests(body, self.settings, common).requests[0].sampling
                    if isinstance(body, ChatCompletionRequest)
                    else completion_requests(body, self.settings, common)[0].sampling)
        prompt_only = isinstance(body, CompletionRequest) and body.scores_prompt
        prompt_ids = line.prompt_token_ids or [None] * len(line.job_ids)
        jobs = [ChoiceJob(index=index, prompt_number=index // line.n, job_id=job_id, echo=echo,
                          prompt_tokens=prompt_tokens, prompt_only=prompt_only,
                          prompt_token_ids=tuple(ids) if ids is not None else None)
                for index, (job_id, echo, prompt_tokens, ids)
                in enumerate(zip(line.job_ids, line.echoes, line.prompt_tokens, prompt_ids,
                                 strict=True))]
        results = await wait_for_results(self.ctx, jobs)  # ended: their streams end at once
        assert results is not None  # (None only for a client that left)
        state = JobState.from_fields(await self.ctx.aio.hgetall(self.ctx.keys.state(request_id)))
        formatters = await logprobs_formatters(self.ctx, state.model, sampling, jobs, is_chat,
                                               bool(body.return_tokens_as_token_ids))
        parser = get_parser(self.settings.tool_parser) if line.parses_calls else None
        answer = await answer_body(
            self.ctx, body, results, is_chat=is_chat,
            response_id=("chatcmpl-" if is_chat else "cmpl-") + request_id,
            created=int(state.created_at), model=state.model, sampling=sampling,
            formatters=formatters, tool_parser=parser)
        if isinstance(body, ChatCompletionRequest) and body.store:
            await self.ctx.chat_completions.keep(batch.owner, answer, metadata=body.metadata,
                                                 messages=line.body["messages"])
        return OUTPUT, _response_line(line.custom_id, request_id, 200, answer)

    async def _response(self, owner: str, line: LineJobs) -> dict[str, Any]:
        """A /v1/responses line's response object, stored as the route stores one (`store`). The
        chat it continues is read again for that: a previous response gone meanwhile (deleted,
        or past its retention) leaves this one continuing only its own input."""
        body = ResponsesRequest.model_validate(line.body)
        try:
            history = await history_of(self.ctx, body, owner)
        except NotFoundError:
            history = []
        given = chat_messages(body.input)
        state = JobState.from_fields(
            await self.ctx.aio.hgetall(self.ctx.keys.state(line.job_ids[0])))
        response = await ended_response(self.ctx, body, state, history, given)
        await keep_response(self.ctx, owner, body, history, given, response)
        return response

    # cancelling -> cancelled; validating | in_progress -> expired
    async def _wind_down(self, batch: BatchRecord, final: BatchStatus, code: str,
                         message: str) -> None:
        """Lines never queued are answered as cancelled/expired at once; queued ones get their
        jobs canceled and are answered as they end (a job that finished first keeps its answer
        in the output file). Once none runs (or after _WIND_DOWN_GRACE_S), the batch ends: until
        then it stays cancelling (or in_progress past its window), as OpenAI's does."""
        if batch.stamps.get("in_progress_at") is None and batch.total == 0:
            # Ended while validating: its lines are still answered, each as never run.
            try:
                batch.total = len(await self._input(batch))
                await self.store.set_fields(batch.id, total=batch.total)
            except ApiError:
                pass  # no readable input file: no lines to answer
        waiting = await self._answer_ended(batch, ending=(code, message))
        lines = self._lines.get(batch.id, {})
        for index in sorted(waiting):
            for job_id in lines[index].job_ids:
                await self.ctx.jobs.cancel_unowned(job_id)  # (a queued job ends here and now)
        if waiting:
            waiting = await self._answer_ended(batch, ending=(code, message))
        started = batch.stamps.get("cancelling_at", batch.expires_at)
        if waiting and time.time() < started + _WIND_DOWN_GRACE_S:
            return  # running jobs stop at their worker's next step: answered at a next tick
        for index in sorted(waiting):  # held by no live worker for the whole grace: given up
            await self._write_answer(batch.id, index, ERROR,
                                    _error_line(lines[index].custom_id, code, message))
        custom_ids = await self._custom_ids(batch)
        for index in range(batch.submitted, batch.total):  # never queued
            await self._write_answer(batch.id, index, ERROR,
                                    _error_line(custom_ids.get(index, f"line-{index}"), code, message))
        allowed = ((BatchStatus.CANCELLING,) if final is BatchStatus.CANCELLED
                   else (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS))
        await self._finalize(batch, final, allowed)

    async def _custom_ids(self, batch: BatchRecord) -> dict[int, str]:
        if batch.submitted >= batch.total:
            return {}
        try:
            return {line.index: line.custom_id for line in await self._input(batch)}
        except ApiError:
            return {}

    async def _finalize(self, batch: BatchRecord, final: BatchStatus,
                        allowed: tuple[BatchStatus, ...]) -> None:
        """Write the output and error files (ids derived from the batch's: written once), then
        end the batch with them."""
        answers = await self.store.answers(batch.id)
        files: dict[str, str] = {}
        for kind, name in ((OUTPUT, "output"), (ERROR, "error")):
            content = "".join(line + "\n" for index, (k, line) in sorted(answers.items()) if k == kind)
            if content:
                file = await self.files.create(
                    batch.owner, f"{batch.id}_{name}.jsonl", OUTPUT_PURPOSE, content,
                    file_id=f"file-{batch.id.removeprefix('batch_')}-{name}")
                files[f"{name}_file_id"] = file.id
        await self.end_batch(batch, final, allowed, **files)

    async def end_batch(self, batch: BatchRecord, final: BatchStatus,
                        allowed: tuple[BatchStatus, ...], **fields: str) -> bool:
        """THE place a batch reaches a final status (completed, failed, expired, cancelled).
        True when this call moved it (once per batch); the batch's webhook event (batch.completed,
        ...) is written by that same move, so it goes out exactly once."""
        event = None
        if batch.webhook_url:
            ended = dataclasses.replace(batch, status=final)
            data = {**ended.to_openai(), **fields}
            if "errors" in fields:
                data["errors"] = {"object": "list", "data": json.loads(fields["errors"])}
            event = (f"batch.{final.value}", batch.webhook_url, batch.owner, data)
        moved = await self.store.transition(batch.id, allowed, final, event, **fields)
        if moved:
            log.info("batch %s %s", batch.id, final.value)
        elif not (await self.store.get(batch.id)).status.is_final:
            return False  # a cancel came first: the next tick winds it down as cancelled
        await self.store.close(batch.id)
        self._forget(batch.id)
        return moved

    def _forget(self, batch_id: str) -> None:
        for cache in (self._inputs, self._lines, self._poll_from, self._answered):
            cache.pop(batch_id, None)


def _prompt_ids(line: BatchInputLine, accepted: list[AcceptedJob]) -> list[list[int] | None] | None:
    """What a return_token_ids line's answer shows as each choice's prompt ids: the ids its job
    was queued with (None for other lines, which keep none)."""
    if line.url == RESPONSES_URL or not line.body.get("return_token_ids"):
        return None
    return [list(job.spec.prompt_token_ids) if job.spec.prompt_token_ids is not None else None
            for job in accepted]


def _idempotency_key(batch: BatchRecord, line: BatchInputLine) -> str:
    """The job service's Idempotency-Key of a line: queueing it again returns the same jobs."""
    return f"carpool-batch:{batch.id}:{line.index}"


def _response_line(custom_id: str, request_id: str, status_code: int,
                   body: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"batch_req_{request_id}", "custom_id": custom_id,
            "response": {"status_code": status_code, "request_id": request_id, "body": body},
            "error": None}


def _error_line(custom_id: str, code: str, message: str) -> dict[str, Any]:
    """A line that got no response at all (never run, cancelled, expired)."""
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}
