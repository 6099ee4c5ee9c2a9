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

from api.chat_template import ChatTemplateError, render_chat
from api.errors import InvalidRequestError, NotFoundError
from api.model_registry import ModelRegistry
from api.queue_admission import QueueAdmission
from api.structured_output import StructuredOutputParams
from api.tokenizer_cache import TokenizerCache
from protocol import JobSpec, JobState, JobStatus, Keys, ModelCard, Priority, SamplingParams
from protocol.job_submission import cancel_job, submit_job
from protocol.rq_keys import RQKeys

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
    # The names the client used, so errors name its fields.
    input_param: str = "prompt"
    max_tokens_param: str = "max_tokens"


@dataclass(frozen=True, slots=True)
class AcceptedJob:
    spec: JobSpec
    prompt_tokens: int | None  # None when no tokenizer is published for the model


def sampling_of(body: BaseModel) -> SamplingParams:
    """The sampling spec of a validated request body: every field named as one of SamplingParams'
    (max_tokens aside, which the job service resolves against the model's context)."""
    names = SamplingParams.field_names() - {"max_tokens", "structured_output"}
    sampling = SamplingParams.from_fields(body.model_dump(include=set(names)))
    if isinstance(body, StructuredOutputParams):  # compiled here: a bad schema is a 400 naming it
        sampling = dataclasses.replace(sampling, structured_output=body.structured_output())
    return sampling


def new_job_id() -> str:
    return uuid.uuid4().hex  # RQ job ids allow only letters, digits, '_' and '-'


class JobService:
    def __init__(self, aio: aioredis.Redis, sync: redis.Redis, keys: Keys, models: ModelRegistry,
                 tokenizers: TokenizerCache, max_queue_depth: int, retry_after_s: int) -> None:
        self._aio = aio
        self._sync = sync
        self._keys = keys
        self._models = models
        self._tokenizers = tokenizers
        self._admission = QueueAdmission(aio, keys, max_queue_depth, retry_after_s)

    async def queue_depths(self) -> dict[Priority, int]:
        async with self._aio.pipeline(transaction=False) as pipe:
            for priority in Priority.ordered():
                pipe.llen(RQKeys.queue(self._keys.queue_name(priority)))
            depths = await pipe.execute()
        return dict(zip(Priority.ordered(), depths))

    async def submit(self, request: GenerationRequest) -> AcceptedJob:
        card = await self._models.resolve(request.model)
        prompt_tokens, is_exact = await self._count_prompt(card, request)
        max_tokens = self._check_lengths(card, request, prompt_tokens, is_exact)
        async with self._admission.admit() as admission:
            spec = JobSpec(
                job_id=new_job_id(), model=card.name, prompt=request.prompt,
                messages=request.messages,
                sampling=dataclasses.replace(request.sampling, max_tokens=max_tokens),
                priority=request.priority, owner=request.owner, created_at=time.time(),
            )
            # RQ is sync: run it in a worker thread rather than block the event loop.
            await anyio.to_thread.run_sync(partial(submit_job, self._sync, spec, self._keys,
                                                   admission=admission))
        return AcceptedJob(spec, prompt_tokens)

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
