"""What both the jobs API and the OpenAI routes do with a job: check, submit, look up, cancel.

Checks that need the model (context length, tokenizer) happen here, so the two route families
answer the same limits with the same messages (only their error shapes differ).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass, field
from functools import partial

import anyio.to_thread
import redis
import redis.asyncio as aioredis
from pydantic import BaseModel
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.serializers import JSONSerializer

from api.chat_template import ChatTemplateError, render_chat
from api.errors import ConflictError, InvalidRequestError, NotFoundError
from api.idempotency_key import IDEMPOTENCY_HEADER
from api.model_registry import ModelRegistry
from api.queue_admission import QueueAdmission
from api.tokenizer_cache import TokenizerCache
from protocol import JobSpec, JobState, JobStatus, Keys, ModelCard, Priority, SamplingParams
from protocol.job_submission import (
    DEFAULT_FAILURE_TTL,
    DEFAULT_RESULT_TTL,
    DuplicateSubmission,
    Idempotency,
    cancel_job,
    submit_job,
)

# Tokenizing this much text on the event loop would stall other requests: use a thread.
_THREAD_TOKENIZE_CHARS = 8192


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A validated request of either route family, before the model-dependent checks."""

    owner: str
    model: str | None
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    max_tokens: int | None = None  # None: as many as the context leaves
    # Everything else the sampler honours; its max_tokens is set once the context is known.
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: Priority = Priority.NORMAL
    queue_timeout_s: float | None = None  # seconds from submission; None: no limit
    deadline_s: float | None = None
    idempotency_key: str | None = None  # the Idempotency-Key header
    retention_s: int | None = None  # kept this long once ended; None: the server's defaults
    # The names the client used, so errors name its fields.
    input_param: str = "prompt"
    max_tokens_param: str = "max_tokens"


@dataclass(frozen=True, slots=True)
class AcceptedJob:
    spec: JobSpec
    prompt_tokens: int | None  # None when no tokenizer is published for the model
    is_replay: bool = False  # the first job of a repeated Idempotency-Key, not a new one


def sampling_of(body: BaseModel) -> SamplingParams:
    """The sampling spec of a validated request body: every field named as one of SamplingParams'
    (max_tokens aside, which the job service resolves against the model's context)."""
    names = SamplingParams.field_names() - {"max_tokens"}
    return SamplingParams.from_fields(body.model_dump(include=set(names)))


def _after(start: float, seconds: float | None) -> float:
    return start + seconds if seconds else 0.0


def new_job_id() -> str:
    return uuid.uuid4().hex  # RQ job ids allow only letters, digits, '_' and '-'


class JobService:
    def __init__(self, aio: aioredis.Redis, sync: redis.Redis, keys: Keys, models: ModelRegistry,
                 tokenizers: TokenizerCache, max_queue_depth: int, retry_after_s: int,
                 idempotency_ttl_s: int = 24 * 3600, result_ttl_s: int = DEFAULT_RESULT_TTL,
                 failure_ttl_s: int = DEFAULT_FAILURE_TTL) -> None:
        self._aio = aio
        self._sync = sync
        self._keys = keys
        self._models = models
        self._tokenizers = tokenizers
        self._admission = QueueAdmission(aio, keys, max_queue_depth, retry_after_s)
        self._idempotency_ttl_s = idempotency_ttl_s
        self._result_ttl_s = result_ttl_s
        self._failure_ttl_s = failure_ttl_s

    async def submit(self, request: GenerationRequest) -> AcceptedJob:
        card = await self._models.resolve(request.model)
        prompt_tokens, is_exact = await self._count_prompt(card, request)
        max_tokens = self._check_lengths(card, request, prompt_tokens, is_exact)
        idempotency = None
        if request.idempotency_key is not None:
            idempotency = Idempotency(self._keys.idempotency(request.owner, request.idempotency_key),
                                      self._idempotency_ttl_s)
            # A retry finds its first job here, even while the queue is full.
            first = await self._aio.get(idempotency.key)
            if first is not None:
                return await self._replay(
                    first.decode() if isinstance(first, bytes) else first, prompt_tokens)
        try:
            return await self._enqueue(card, request, max_tokens, prompt_tokens, idempotency)
        except DuplicateSubmission as duplicate:  # a concurrent twin enqueued first
            return await self._replay(duplicate.job_id, prompt_tokens)

    async def _enqueue(self, card: ModelCard, request: GenerationRequest, max_tokens: int,
                       prompt_tokens: int | None, idempotency: Idempotency | None) -> AcceptedJob:
        async with self._admission.admit(card.name) as admission:
            created_at = time.time()
            spec = JobSpec(
                job_id=new_job_id(), model=card.name, prompt=request.prompt,
                messages=request.messages,
                sampling=dataclasses.replace(request.sampling, max_tokens=max_tokens),
                priority=request.priority, owner=request.owner, created_at=created_at,
                queue_deadline_at=_after(created_at, request.queue_timeout_s),
                deadline_at=_after(created_at, request.deadline_s),
            )
            # RQ is sync: run it in a worker thread rather than block the event loop.
            await anyio.to_thread.run_sync(partial(
                submit_job, self._sync, spec, self._keys, admission=admission,
                idempotency=idempotency, result_ttl=request.retention_s or self._result_ttl_s,
                failure_ttl=request.retention_s or self._failure_ttl_s))
        return AcceptedJob(spec, prompt_tokens)

    async def _replay(self, job_id: str, prompt_tokens: int | None) -> AcceptedJob:
        """The job a repeated Idempotency-Key made first, as its submission accepted it."""
        try:
            job = await anyio.to_thread.run_sync(
                partial(Job.fetch, job_id, connection=self._sync, serializer=JSONSerializer))
            spec = JobSpec.from_dict(job.args[0])
        except (NoSuchJobError, ValueError, IndexError) as exc:
            raise ConflictError(
                f"This Idempotency-Key made job '{job_id}', which is no longer kept; use a new "
                f"key to submit again", param=IDEMPOTENCY_HEADER,
                code="idempotency_key_reused") from exc
        return AcceptedJob(spec, prompt_tokens, is_replay=True)

    async def state(self, job_id: str, owner: str) -> JobState:
        """The job's state; 404 for unknown jobs and for jobs of another key alike."""
        fields = await self._aio.hgetall(self._keys.state(job_id))
        if not fields:
            raise NotFoundError(f"No job with id '{job_id}'", param="job_id", code="job_not_found")
        state = JobState.from_fields(fields)
        if state.owner != owner:
            # The same answer as for a missing job: another key's job ids must not leak.
            raise NotFoundError(f"No job with id '{job_id}'", param="job_id", code="job_not_found")
        return state

    async def cancel(self, job_id: str, owner: str) -> JobStatus:
        await self.state(job_id, owner)
        status = await anyio.to_thread.run_sync(cancel_job, self._sync, job_id, self._keys)
        if status is None:  # expired between the two calls
            raise NotFoundError(f"No job with id '{job_id}'", param="job_id", code="job_not_found")
        return status

    async def cancel_unowned(self, job_id: str) -> JobStatus | None:
        """Cancel a job this process submitted itself (its client went away): no owner check."""
        return await anyio.to_thread.run_sync(cancel_job, self._sync, job_id, self._keys)

    async def _count_prompt(self, card: ModelCard, request: GenerationRequest) -> tuple[int | None, bool]:
        """Prompt length in the model's tokens, and whether that count is exact."""
        tokenizer = await self._tokenizers.get(card)
        if request.messages is not None:
            try:
                text, is_exact = render_chat(card, request.messages)
            except ChatTemplateError as exc:
                raise InvalidRequestError(f"The model's chat template rejects these messages: {exc}",
                                          param=request.input_param) from exc
            add_special_tokens = False  # a chat template writes its special tokens itself
        else:
            text, is_exact, add_special_tokens = request.prompt or "", True, True
        if tokenizer is None:
            return None, False
        if len(text) > _THREAD_TOKENIZE_CHARS:
            encoding = await anyio.to_thread.run_sync(
                partial(tokenizer.encode, text, add_special_tokens=add_special_tokens))
        else:
            encoding = tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return len(encoding.ids), is_exact

    def _check_lengths(self, card: ModelCard, request: GenerationRequest, prompt_tokens: int | None,
                       is_exact: bool) -> int:
        context = card.max_model_len
        if request.max_tokens is not None and request.max_tokens > context:
            raise InvalidRequestError(
                f"'{request.max_tokens_param}' must be at most {context}, the context length of "
                f"model '{card.name}' (got {request.max_tokens})", param=request.max_tokens_param)
        if prompt_tokens is None:
            return request.max_tokens or context
        if prompt_tokens >= context:
            raise InvalidRequestError(
                f"'{request.input_param}' is {prompt_tokens} tokens long, but model '{card.name}' "
                f"has a context length of {context} tokens (prompt and completion together), so "
                f"nothing would be left to generate", param=request.input_param,
                code="context_length_exceeded")
        room = context - prompt_tokens
        if request.max_tokens is None:
            return room
        if is_exact and request.max_tokens > room:
            raise InvalidRequestError(
                f"Model '{card.name}' has a context length of {context} tokens; the prompt takes "
                f"{prompt_tokens}, so '{request.max_tokens_param}' can be at most {room} "
                f"(got {request.max_tokens})", param=request.max_tokens_param,
                code="context_length_exceeded")
        return request.max_tokens
