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
from typing import Any, Literal

import anyio.to_thread
import redis
import redis.asyncio as aioredis
from pydantic import BaseModel
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.serializers import JSONSerializer
from tokenizers import Tokenizer

from api.chat_template import (
    ChatTemplateError,
    render_chat,
    template_kwargs_for,
    template_takes_tools,
)
from api.errors import ConflictError, InvalidRequestError, NotFoundError, ServiceUnavailableError
from api.idempotency_key import IDEMPOTENCY_HEADER
from api.key_policies import KeyPolicies
from api.model_registry import ModelRegistry
from api.queue_admission import QueueAdmission
from api.recent_submissions import RecentSubmissions
from api.sampling_defaults import served_defaults, with_model_defaults
from api.state_reads import end_if_taken_away_by_rq, read_state
from api.structured_output import StructuredOutputParams
from api.submission_batcher import SubmissionBatcher
from api.tokenizer_cache import TokenizerCache
from api.webhook_urls import checked_webhook_url
from protocol import JobSpec, JobState, JobStatus, Keys, ModelCard, Priority, SamplingParams
from protocol.generation import MAX_SEED, PromptLogprobs
from protocol.job_reader import PROMPT_LOGPROBS_FIELD
from protocol.job_submission import (
    DEFAULT_FAILURE_TTL,
    DEFAULT_RESULT_TTL,
    DuplicateSubmission,
    Idempotency,
    SubmissionRefused,
    cancel_job,
    prepare_submission,
)
from protocol.rq_keys import RQKeys
from protocol.webhook_urls import WebhookAllowList

# Tokenizing this much text on the event loop would stall other requests: use a thread.
_THREAD_TOKENIZE_CHARS = 8192


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A validated request of either route family, before the model-dependent checks."""

    owner: str
    model: str | None
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    prompt_token_ids: list[int] | None = None  # a prompt the client tokenized itself
    max_tokens: int | None = None  # None: as many as the context leaves
    # Everything else the sampler honours; its max_tokens is set once the context is known.
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: Priority = Priority.NORMAL
    # The names the client used, so errors name its fields.
    input_param: str = "prompt"
    max_tokens_param: str = "max_tokens"
    # Fields the client set; the model's generation_config.json fills in the others. None: all
    # of them were set (no defaults applied).
    explicit_fields: frozenset[str] | None = None
    queue_timeout_s: float | None = None  # seconds from submission; None: no limit
    deadline_s: float | None = None
    idempotency_key: str | None = None  # the Idempotency-Key header
    retention_s: int | None = None  # kept this long once ended; None: the server's defaults
    logprobs_param: str = "logprobs"  # chat calls it top_logprobs
    # A chat with tools, as a model whose template reads `tools` renders it (api/tool_calls.py);
    # `messages` then holds the Hermes rendering for the other templates.
    template_tools: list[dict[str, Any]] | None = None
    template_messages: list[dict[str, Any]] | None = None
    webhook_url: str | None = None  # where the job's final event goes (protocol.webhook_events)
    webhook_param: str = "webhook_url"  # or the header it came in
    # How `messages` become the prompt (JobSpec's fields of the same names).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    cache_salt: str | None = None  # vLLM's: who the job shares prefix-cache blocks with
    # How the prompt becomes token ids when the request asks otherwise than the worker does
    # (PromptIds): with special tokens (None: the worker's way, text true, a chat false), and
    # which end truncate_prompt_tokens cuts.
    add_special_tokens: bool | None = None
    truncation_side: Literal["left", "right"] = "left"
    # The request field needing the prompt's ids decided here (None: the worker decides them).
    prompt_ids_param: str | None = None


@dataclass(frozen=True, slots=True)
class AcceptedJob:
    spec: JobSpec
    prompt_tokens: int | None  # None when no tokenizer is published for the model
    # The prompt as text (token-id prompts decoded; None without a tokenizer), for `echo`.
    prompt_text: str | None = None
    # When (monotonic) it had nothing generated for sure: before its submission was sent, so
    # that the stream hub need not read its stream first (StreamHub.subscribe). None: a job of
    # a repeated Idempotency-Key, not a new one (`is_replay`).
    fresh_since: float | None = None

    @property
    def is_replay(self) -> bool:
        return self.fresh_since is None


def sampling_of(body: BaseModel, **overrides: Any) -> SamplingParams:
    """The sampling spec of a validated request body: every field named as one of SamplingParams'
    (max_tokens aside, which the job service resolves against the model's context), except those
    given in `overrides` (a field the body spells differently, as chat's logprobs)."""
    names = SamplingParams.field_names() - {"max_tokens", "structured_output"} - set(overrides)
    sampling = SamplingParams.from_fields({**body.model_dump(include=set(names)), **overrides})
    if isinstance(body, StructuredOutputParams):  # compiled here: a bad schema is a 400 naming it
        sampling = dataclasses.replace(sampling, structured_output=body.structured_output())
    return sampling


def _after(start: float, seconds: float | None) -> float:
    return start + seconds if seconds else 0.0


def choice_sampling(sampling: SamplingParams, choice: int) -> SamplingParams:
    """Choice `choice`'s sampling: with a seed, seed + choice (as vLLM seeds its n child
    requests), so choice 0 draws what n = 1 would and a seeded n = 4 repeats run to run."""
    if sampling.seed is None or choice == 0:
        return sampling
    return dataclasses.replace(sampling, seed=(sampling.seed + choice) % (MAX_SEED + 1))


async def _encoded_ids(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """The text's token ids; a long text is encoded off the event loop, which a long encode
    would otherwise hold up for every other request."""
    if len(text) > _THREAD_TOKENIZE_CHARS:
        encoding = await anyio.to_thread.run_sync(
            partial(tokenizer.encode, text, add_special_tokens=add_special_tokens))
    else:
        encoding = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return list(encoding.ids)


def _seen_text(tokenizer: Tokenizer, ids: list[int], text: str | None,
               request: GenerationRequest, card: ModelCard) -> str:
    """The text of the prompt tokens the model sees: `text` (None: the ids decoded) when it sees
    them all, else its last tokens (truncate_prompt_tokens) decoded."""
    seen = request.sampling.truncated_prompt_length(len(ids), card.max_model_len)
    if text is not None and seen == len(ids):
        return text
    return str(tokenizer.decode(ids[len(ids) - seen:], skip_special_tokens=False))


def _render(card: ModelCard, request: GenerationRequest, messages: list[dict[str, Any]],
            tools: list[dict[str, Any]] | None = None) -> tuple[str, bool]:
    """`messages` rendered as the request asks (render_chat's text and exactness); a template
    that refuses them is the client's 400, naming the request's input."""
    try:
        return render_chat(card, messages, tools=tools,
                           add_generation_prompt=request.add_generation_prompt,
                           continue_final_message=request.continue_final_message,
                           template_kwargs=request.chat_template_kwargs)
    except ChatTemplateError as exc:
        raise InvalidRequestError(f"The model's chat template rejects these messages: {exc}",
                                  param=request.input_param) from exc


def new_job_id() -> str:
    return uuid.uuid4().hex  # RQ job ids allow only letters, digits, '_' and '-'


class JobService:
    def __init__(self, aio: aioredis.Redis, sync: redis.Redis, keys: Keys, models: ModelRegistry,
                 tokenizers: TokenizerCache, max_queue_depth: int, retry_after_s: int,
                 idempotency_ttl_s: int = 24 * 3600, result_ttl_s: int = DEFAULT_RESULT_TTL,
                 failure_ttl_s: int = DEFAULT_FAILURE_TTL, max_logprobs: int = 20,
                 webhook_allow_list: WebhookAllowList = WebhookAllowList(),
                 max_batch_queue_depth: int | None = None,
                 key_policies: KeyPolicies = KeyPolicies()) -> None:
        self._aio = aio
        self._sync = sync
        self._keys = keys
        self._models = models
        self._tokenizers = tokenizers
        self._retry_after_s = retry_after_s
        self._admission = QueueAdmission(keys, max_queue_depth, retry_after_s,
                                         max_background_depth=max_batch_queue_depth)
        self._submissions = SubmissionBatcher(sync)
        self._recent = RecentSubmissions()
        self._idempotency_ttl_s = idempotency_ttl_s
        self._result_ttl_s = result_ttl_s
        self._failure_ttl_s = failure_ttl_s
        self._max_logprobs = max_logprobs
        self._webhook_allow_list = webhook_allow_list
        self._key_policies = key_policies

    async def submit(self, request: GenerationRequest) -> AcceptedJob:
        (accepted,) = await self.submit_many([request])
        return accepted

    async def submit_many(self, requests: list[GenerationRequest]) -> list[AcceptedJob]:
        """Check every request, then queue them all in one transaction (all or none), counted as
        len(requests) jobs by the queue admission: a request's n choices, one job each. They
        share one model (the first request's)."""
        card = await self._models.resolve(requests[0].model, recent=True)
        hook = requests[0]
        if hook.webhook_url is not None:  # one request's jobs share it: checked once
            await checked_webhook_url(hook.webhook_url, self._webhook_allow_list, hook.webhook_param)
        checked = []
        for request in requests:
            request = await self._rendered(card, request)
            request, decided_text = await self._with_decided_ids(card, request)
            self._check_sampling(card, request)
            await self._check_bad_words(card, request)
            prompt_tokens, is_exact, prompt_text = await self._count_prompt(card, request)
            if decided_text is not None:
                prompt_text = decided_text  # the text given, not its ids decoded (with a BOS...)
            if prompt_tokens is not None:  # what the model will see of it (truncate_prompt_tokens)
                prompt_tokens = request.sampling.truncated_prompt_length(prompt_tokens,
                                                                         card.max_model_len)
            max_tokens = self._check_lengths(card, request, prompt_tokens, is_exact)
            sampling = request.sampling
            if request.explicit_fields is not None:
                sampling = with_model_defaults(sampling, card.generation_defaults,
                                               request.explicit_fields)
                default_max = served_defaults(card.generation_defaults).get("max_tokens")
                if request.max_tokens_param not in request.explicit_fields \
                        and isinstance(default_max, int) and default_max >= 1:
                    max_tokens = min(max_tokens, default_max)
            if sampling.min_tokens > max_tokens:
                raise InvalidRequestError(
                    f"'min_tokens' must be at most {request.max_tokens_param} ({max_tokens}); got "
                    f"{sampling.min_tokens}", param="min_tokens")
            checked.append((request, dataclasses.replace(sampling, max_tokens=max_tokens),
                            prompt_tokens, prompt_text))
        # One request's jobs (its n choices) share its Idempotency-Key and retention.
        first = checked[0][0]
        idempotency = None
        if first.idempotency_key is not None:
            idempotency = Idempotency(self._keys.idempotency(first.owner, first.idempotency_key),
                                      self._idempotency_ttl_s)
        try:
            return await self._enqueue(card, checked, idempotency)
        except DuplicateSubmission as duplicate:
            # The key named jobs already (a retry, or a concurrent twin that went first): the
            # submission's script looks before its limits, so a retry finds its first jobs even
            # while the queue is full, in the request it would have enqueued with.
            return await self._replay(duplicate.job_id, checked)

    async def _enqueue(self, card: ModelCard,
                       checked: list[tuple[GenerationRequest, SamplingParams, int | None, str | None]],
                       idempotency: Idempotency | None) -> list[AcceptedJob]:
        first = checked[0][0]
        policy = self._key_policies.for_owner(first.owner)
        # What the tokens-per-minute limit counts: each job's prompt and its most new tokens.
        tokens = sum((prompt_tokens or 0) + sampling.max_tokens
                     for _, sampling, prompt_tokens, _ in checked)
        if policy.tokens_per_minute and not first.priority.is_background \
                and tokens > policy.tokens_per_minute:
            raise InvalidRequestError(
                f"This request needs {tokens} tokens (prompt + {first.max_tokens_param} over its "
                f"{len(checked)} job(s)), more than this API key may submit in a minute "
                f"({policy.tokens_per_minute}, tokens_per_minute_per_key); lower "
                f"{first.max_tokens_param} or the prompt", param=first.max_tokens_param)
        admission = self._admission.admission(card.name, len(checked), first.owner, policy,
                                              tokens, first.priority)
        created_at, fresh_since = time.time(), time.monotonic()
        accepted = [AcceptedJob(JobSpec(
            job_id=new_job_id(), model=card.name, prompt=request.prompt,
            messages=request.messages, prompt_token_ids=request.prompt_token_ids,
            sampling=sampling, priority=request.priority, owner=request.owner,
            created_at=created_at,
            queue_deadline_at=_after(created_at, request.queue_timeout_s),
            deadline_at=_after(created_at, request.deadline_s),
            webhook_url=request.webhook_url or "",
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            chat_template_kwargs=request.chat_template_kwargs or {},
            cache_salt=request.cache_salt), prompt_tokens, prompt_text, fresh_since=fresh_since)
            for request, sampling, prompt_tokens, prompt_text in checked]
        result_ttl = first.retention_s or self._result_ttl_s
        failure_ttl = first.retention_s or self._failure_ttl_s
        try:
            # One script checks the limits and enqueues (api/queue_admission.py); RQ is sync, so
            # it is built and sent from a worker thread, with the submissions arriving beside it
            # (api/submission_batcher.py).
            await self._submissions.submit(partial(
                prepare_submission, self._sync, [job.spec for job in accepted], self._keys,
                check=admission.check, idempotency=idempotency,
                result_ttl=result_ttl, failure_ttl=failure_ttl))
        except SubmissionRefused as refused:
            raise admission.refusal(refused.verdict) from None
        for job in accepted:
            self._recent.add(job.spec.job_id, job.spec.owner, fresh_since,
                             min(result_ttl, failure_ttl))
        return accepted

    async def _replay(self, recorded: str,
                      checked: list[tuple[GenerationRequest, SamplingParams, int | None, str | None]],
                      ) -> list[AcceptedJob]:
        """The jobs a repeated Idempotency-Key made first (their ids, comma-separated), as their
        submission accepted them."""
        job_ids = recorded.split(",")
        if len(job_ids) != len(checked):
            raise ConflictError(
                f"This Idempotency-Key was first used for {len(job_ids)} jobs, this request "
                f"makes {len(checked)}; use a new key for a different request",
                param=IDEMPOTENCY_HEADER, code="idempotency_key_reused")
        replayed = []
        for job_id, (_, _, prompt_tokens, prompt_text) in zip(job_ids, checked):
            try:
                job = await anyio.to_thread.run_sync(
                    partial(Job.fetch, job_id, connection=self._sync, serializer=JSONSerializer))
                spec = JobSpec.from_dict(job.args[0])
            except (NoSuchJobError, ValueError, IndexError) as exc:
                raise ConflictError(
                    f"This Idempotency-Key made job '{job_id}', which is no longer kept; use a "
                    f"new key to submit again", param=IDEMPOTENCY_HEADER,
                    code="idempotency_key_reused") from exc
            replayed.append(AcceptedJob(spec, prompt_tokens, prompt_text))  # (no fresh_since)
        return replayed

    async def model_tokenizer(self, model: str) -> Tokenizer | None:
        """The served model's tokenizer, by name (None when no worker published one)."""
        return await self._tokenizers.get(await self._models.resolve(model))

    async def tokenizer(self, card: ModelCard) -> Tokenizer | None:
        """The model's tokenizer as the API knows it (None when no worker published one)."""
        return await self._tokenizers.get(card)

    def submitted_here(self, job_id: str, owner: str) -> float | None:
        """When (monotonic) `job_id` had nothing generated for sure, if this process submitted
        it for `owner` lately and its state surely exists still (api/recent_submissions.py); None
        when only its state can tell."""
        return self._recent.fresh_since(job_id, owner)

    async def state(self, job_id: str, owner: str) -> JobState:
        """The job's state; 404 for unknown jobs and for jobs of another key alike. A queued
        job rq itself took off its queue (`rq empty`, Job.delete, rq's Job.cancel), which no
        worker will claim, is ended canceled first (the RQ status comes in the same request)."""
        state_key = self._keys.state(job_id)
        fields, rq_status = await read_state(self._aio, state_key, RQKeys.job(job_id))
        if not fields:
            raise NotFoundError(f"No job with id '{job_id}'", param="job_id", code="job_not_found")
        state = JobState.from_fields(fields)
        if state.owner != owner:
            # The same answer as for a missing job: another key's job ids must not leak.
            raise NotFoundError(f"No job with id '{job_id}'", param="job_id", code="job_not_found")
        if await end_if_taken_away_by_rq(self._aio, self._keys, job_id, state.status, rq_status):
            state = JobState.from_fields(await self._aio.hgetall(state_key))
        return state

    async def prompt_logprobs(self, job_id: str) -> PromptLogprobs | None:
        """The prompt logprobs the job asked for, once its first token is out (else None): one
        state-hash field, read alone as it is as long as the prompt (protocol.job_reader)."""
        payload = await self._aio.hget(self._keys.state(job_id), PROMPT_LOGPROBS_FIELD)
        if not payload:
            return None
        return PromptLogprobs.decode(payload.decode() if isinstance(payload, bytes) else str(payload))

    async def cancel(self, job_id: str, owner: str) -> JobStatus:
        await self.state(job_id, owner)
        status = await anyio.to_thread.run_sync(cancel_job, self._sync, job_id, self._keys)
        if status is None:  # expired between the two calls
            raise NotFoundError(f"No job with id '{job_id}'", param="job_id", code="job_not_found")
        return status

    async def cancel_unowned(self, job_id: str) -> JobStatus | None:
        """Cancel a job this process submitted itself (its client went away): no owner check."""
        return await anyio.to_thread.run_sync(cancel_job, self._sync, job_id, self._keys)

    def _check_sampling(self, card: ModelCard, request: GenerationRequest) -> None:
        """The limits that depend on the settings or the model: logprobs, token ids."""
        sampling = request.sampling
        if sampling.logprobs is not None and sampling.logprobs > self._max_logprobs:
            raise InvalidRequestError(
                f"'{request.logprobs_param}' must be at most {self._max_logprobs} (this server's "
                f"max_logprobs); got {sampling.logprobs}", param=request.logprobs_param)
        if sampling.prompt_logprobs is not None and sampling.prompt_logprobs > self._max_logprobs:
            # (echo + logprobs asks for the logprobs' count, checked above.)
            raise InvalidRequestError(
                f"'prompt_logprobs' must be at most {self._max_logprobs} (this server's "
                f"max_logprobs); got {sampling.prompt_logprobs}", param="prompt_logprobs")
        if not card.vocab_size:
            return  # a worker too old to say: the worker itself fails a job with a bad id
        for param, token_ids in (("logit_bias", [token_id for token_id, _ in sampling.logit_bias]),
                                 ("stop_token_ids", sampling.stop_token_ids),
                                 ("allowed_token_ids", sampling.allowed_token_ids or ())):
            for token_id in token_ids:
                if token_id >= card.vocab_size:
                    raise InvalidRequestError(
                        f"'{param}' names token id {token_id}, outside the vocabulary of model "
                        f"'{card.name}' (ids 0 to {card.vocab_size - 1})", param=param)

    async def _check_bad_words(self, card: ModelCard, request: GenerationRequest) -> None:
        """A bad word the model's tokenizer turns into no tokens (its normalizer drops every
        character of it) would ban nothing: the worker refuses it as vLLM does, which fails the
        job after it queued. Refused here instead, where the tokenizer is published."""
        words = request.sampling.bad_words
        if not words:
            return
        tokenizer = await self._tokenizers.get(card)
        if tokenizer is None:
            return  # the worker tokenizes them, and fails the job with the same words
        for i, word in enumerate(words):
            # The worker's tokenization (worker/engine/engine.py): leading whitespace stripped.
            if not await _encoded_ids(tokenizer, word.lstrip(), add_special_tokens=False):
                raise InvalidRequestError(
                    f"'bad_words' entry {i} ({word!r}) is no tokens at all in model "
                    f"'{card.name}''s tokenizer, so it could ban nothing", param=f"bad_words.{i}")

    async def prompt_tokens(self, request: GenerationRequest) -> int:
        """The prompt's length in the model's tokens, as a submission of `request` counts it (its
        template's tools and kwargs applied): what its job's usage would report. A 503 while the
        model has no tokenizer published."""
        card = await self._models.resolve(request.model, recent=True)
        count, _, _ = await self._count_prompt(card, await self._rendered(card, request))
        if count is None:
            raise ServiceUnavailableError(f"No tokenizer is published for model '{card.name}' "
                                          "yet", self._retry_after_s)
        return count

    async def _rendered(self, card: ModelCard, request: GenerationRequest) -> GenerationRequest:
        """The request as the model's template takes it: the template kwargs it reads, and its
        tools rendered by the template where it renders them."""
        if request.chat_template_kwargs:  # those the model's template reads travel on
            request = dataclasses.replace(request, chat_template_kwargs=template_kwargs_for(
                card, request.chat_template_kwargs))
        return await self._with_template_tools(card, request)

    async def _with_template_tools(self, card: ModelCard,
                                   request: GenerationRequest) -> GenerationRequest:
        """A chat with tools for a model whose template renders tools itself: rendered here with
        `tools` (the worker renders plain messages only) and queued as token ids. Without a
        tokenizer or such a template, the request keeps its Hermes-style messages."""
        if request.template_tools is None or request.template_messages is None \
                or not template_takes_tools(card):
            return request
        tokenizer = await self._tokenizers.get(card)
        if tokenizer is None:
            return request
        text, is_exact = _render(card, request, request.template_messages, request.template_tools)
        if not is_exact:
            return request
        # (A chat's add_special_tokens: its template writes them, unless the request asks more.)
        ids = tokenizer.encode(text, add_special_tokens=bool(request.add_special_tokens)).ids
        return dataclasses.replace(request, messages=None, prompt_token_ids=ids,
                                   template_tools=None, template_messages=None)

    async def _with_decided_ids(self, card: ModelCard, request: GenerationRequest,
                                ) -> tuple[GenerationRequest, str | None]:
        """The request queued as the prompt's token ids decided here, where a field of it needs
        them decided (prompt_ids_param): tokenized with or without special tokens as it asks,
        then truncated on the side it asks; the worker runs those ids as they are, so they are
        exactly what return_token_ids shows. Also a text prompt as echo shows it: the text given
        when the model sees all of it, else the tokens it sees decoded (None for the others,
        whose echo is their ids decoded, as before)."""
        param = request.prompt_ids_param
        if param is None:
            return request, None
        tokenizer = await self._tokenizers.get(card)
        ids = await self._whole_prompt_ids(card, request, tokenizer, param)
        keep = request.sampling.truncated_prompt_length(len(ids), card.max_model_len)
        seen = ids[:keep] if request.truncation_side == "right" else ids[len(ids) - keep:]
        if not seen:
            raise InvalidRequestError(
                f"'{request.input_param}' holds no tokens once tokenized (with "
                f"add_special_tokens {request.add_special_tokens is not False}): nothing to "
                "generate from", param=request.input_param)
        text = request.prompt
        if text is not None and keep < len(ids):
            assert tokenizer is not None  # (a text prompt was tokenized with it)
            text = str(tokenizer.decode(seen, skip_special_tokens=False))
        return dataclasses.replace(request, prompt=None, messages=None, prompt_token_ids=seen,
                                   template_tools=None, template_messages=None), text

    async def _whole_prompt_ids(self, card: ModelCard, request: GenerationRequest,
                                tokenizer: Tokenizer | None, param: str) -> list[int]:
        """The prompt's token ids before truncation: a token-id prompt's as given (special
        tokens are never added to them, as vLLM), a text or a chat tokenized as asked."""
        if request.prompt_token_ids is not None:
            return list(request.prompt_token_ids)
        if tokenizer is None:
            raise ServiceUnavailableError(
                f"No tokenizer is published for model '{card.name}' yet, and '{param}' needs the "
                "prompt tokenized here", self._retry_after_s)
        if request.messages is not None:
            text, is_exact = _render(card, request, request.messages)
            if not is_exact:
                # The worker's own template run could give other ids than this approximation.
                raise InvalidRequestError(
                    f"'{param}' needs the chat's token ids decided here, but model "
                    f"'{card.name}''s chat template uses what this server cannot render exactly",
                    param=param)
            add_special_tokens = bool(request.add_special_tokens)
        else:
            text, add_special_tokens = request.prompt or "", request.add_special_tokens is not False
        return await _encoded_ids(tokenizer, text, add_special_tokens)

    async def _count_prompt(self, card: ModelCard,
                            request: GenerationRequest) -> tuple[int | None, bool, str | None]:
        """Prompt length in the model's tokens, whether that count is exact, and the prompt as
        text (None for a chat, or token ids without a tokenizer): as the model sees it, so with
        truncate_prompt_tokens the text of its last tokens (what echo answers with, as vLLM's)."""
        tokenizer = await self._tokenizers.get(card)
        if request.prompt_token_ids is not None:
            ids = request.prompt_token_ids
            if tokenizer is None:
                return len(ids), True, None  # the worker checks them against its vocabulary
            vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
            outside = [token_id for token_id in ids if token_id >= vocab_size]
            if outside:
                raise InvalidRequestError(
                    f"'{request.input_param}' holds token id {outside[0]}, outside the "
                    f"vocabulary of model '{card.name}' (ids 0 to {vocab_size - 1})",
                    param=request.input_param)
            return len(ids), True, _seen_text(tokenizer, ids, None, request, card)
        if request.messages is not None:
            text, is_exact = _render(card, request, request.messages)
            add_special_tokens = False  # a chat template writes its special tokens itself
        else:
            text, is_exact, add_special_tokens = request.prompt or "", True, True
        prompt_text = None if request.messages is not None else text
        if tokenizer is None:
            return None, False, prompt_text
        ids = await _encoded_ids(tokenizer, text, add_special_tokens)
        if prompt_text is not None:
            prompt_text = _seen_text(tokenizer, ids, prompt_text, request, card)
        return len(ids), is_exact, prompt_text

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
