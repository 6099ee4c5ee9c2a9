"""Payloads that cross Redis, as plain data with JSON codecs (never pickle)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from protocol.generation import FinishReason, SamplingParams, TokenLogprobs

# vLLM's own limit (its validator's, 128) rather than a new one: a salt vLLM takes is taken here,
# and room enough for the 43 base64 characters (256 bits) it recommends, or a tenant id beside them.
MAX_CACHE_SALT_CHARS = 128


class Priority(str, Enum):
    HIGH = "high"
    NORMAL = "normal"
    LOW = "low"
    # Below low: the Batch API's lines. Workers take them only for seats no other tier wants
    # and requeue (preempt) them first when a higher tier waits (worker.jobs.batch_preemption).
    BATCH = "batch"

    @classmethod
    def ordered(cls) -> list[Priority]:
        return [cls.HIGH, cls.NORMAL, cls.LOW, cls.BATCH]

    @property
    def is_background(self) -> bool:
        """Whether jobs of this tier give way to every other tier (preempted first)."""
        return self is Priority.BATCH


class JobStatus(str, Enum):
    QUEUED = "queued"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back on the queue's front, resumes from its stream
    FINISHED = "finished"
    FAILED = "failed"
    CANCELED = "canceled"

    @property
    def is_final(self) -> bool:
        return self in (JobStatus.FINISHED, JobStatus.FAILED, JobStatus.CANCELED)


@dataclass(frozen=True, slots=True)
class JobSpec:
    """What a client asked for. Exactly one of `prompt`, `messages` and `prompt_token_ids` is set
    (token ids: a prompt the client tokenized itself, fed to the model as is)."""

    job_id: str
    model: str
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)  # travels whole to the sampler
    priority: Priority = Priority.NORMAL
    owner: str = ""  # the API key's id that submitted it ("" when the API runs open)
    created_at: float = field(default_factory=time.time)
    prompt_token_ids: list[int] | None = None
    # Seconds since the epoch, 0 = none. Past `queue_deadline_at` a job that has not started is
    # never started; past `deadline_at` it is never started, or ends at the next step boundary
    # (finish reason EXPIRED, keeping what it generated).
    queue_deadline_at: float = 0.0
    deadline_at: float = 0.0
    # Where the job's final event is POSTed (protocol.webhook_events); "" = no webhook. Copied into
    # the JobState, where the scripts that end the job read it.
    webhook_url: str = ""
    # How `messages` become the prompt (vLLM's chat fields): the assistant's turn opened after
    # them, or the last message itself left open and continued (an assistant's answer begun).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # More variables for the chat template (vLLM's chat_template_kwargs), those it reads.
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # vLLM's cache_salt: the job shares prefix-cache blocks only with jobs of the same salt (None:
    # with the unsalted ones). Not a sampling field: it changes what is reused, never the tokens.
    cache_salt: str | None = None

    def expiry(self, now: float, has_started: bool) -> str:
        """Why the job must end now without (more) generation: "" while within its deadlines."""
        if self.deadline_at and now >= self.deadline_at:
            return "deadline"
        if not has_started and self.queue_deadline_at and now >= self.queue_deadline_at:
            return "queue timeout"
        return ""

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data: the single argument recorded on the RQ job."""
        data = {name: getattr(self, name) for name in self.__dataclass_fields__}
        data["sampling"] = self.sampling.to_dict()
        data["priority"] = self.priority.value
        # Fields newer than the first workers, left out at their defaults: jobs that use none of
        # them stay valid to workers that predate them.
        for name, default in (("prompt_token_ids", None), ("webhook_url", ""),
                              ("add_generation_prompt", True), ("continue_final_message", False),
                              ("chat_template_kwargs", {}), ("cache_salt", None)):
            if data[name] == default:
                del data[name]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobSpec:
        """Inverse of to_dict; a malformed payload raises ValueError (never KeyError/TypeError)."""
        if not isinstance(data, dict):
            raise ValueError(f"job spec must be a JSON object, got {type(data).__name__}")
        known = set(cls.__dataclass_fields__)
        sampling_names = SamplingParams.field_names()
        # Jobs queued by an API that still wrote the sampling fields flat: fold them in.
        flat = {name: data[name] for name in sampling_names & set(data)}
        unknown = sorted(set(data) - known - sampling_names)
        if unknown:
            raise ValueError(f"job spec has unknown fields: {', '.join(unknown)}")
        for name in ("job_id", "model"):
            if not isinstance(data.get(name), str) or not data[name]:
                raise ValueError(f"job spec needs a non-empty string {name!r}")
        fields = dict(data)
        try:
            fields["priority"] = Priority(fields.get("priority", Priority.NORMAL.value))
        except ValueError as exc:
            raise ValueError(
                f"job spec has an unknown priority {fields.get('priority')!r}") from exc
        for name in flat:
            del fields[name]
        sampling = fields.get("sampling", {})
        if not isinstance(sampling, dict):
            raise ValueError(f"job spec's sampling must be a JSON object, got {type(sampling).__name__}")
        merged = {**flat, **sampling}
        if isinstance(merged.get("stop"), str):
            merged["stop"] = [merged["stop"]]
        fields["sampling"] = SamplingParams.from_dict(merged)
        for name in ("queue_deadline_at", "deadline_at"):
            value = fields.get(name, 0.0)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"job spec's {name} must be a number of seconds since the "
                                 f"epoch (0: none), got {value!r}")
        if not isinstance(fields.get("webhook_url", ""), str):
            raise ValueError("job spec's 'webhook_url' must be a string")
        for name in ("add_generation_prompt", "continue_final_message"):
            if not isinstance(fields.get(name, False), bool):
                raise ValueError(f"job spec's {name!r} must be true or false")
        if not isinstance(fields.get("chat_template_kwargs", {}), dict):
            raise ValueError("job spec's 'chat_template_kwargs' must be a JSON object")
        _check_cache_salt(fields.get("cache_salt"))
        if fields.get("continue_final_message") and fields.get("add_generation_prompt", True):
            raise ValueError("job spec cannot both continue the final message and open a new turn "
                             "(continue_final_message needs add_generation_prompt false)")
        inputs = [name for name in ("prompt", "messages", "prompt_token_ids")
                  if fields.get(name) is not None]
        if len(inputs) != 1:
            raise ValueError("job spec needs exactly one of 'prompt', 'messages' and "
                             "'prompt_token_ids'")
        token_ids = fields.get("prompt_token_ids")
        if token_ids is not None and (
                not isinstance(token_ids, list) or not token_ids
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                           for t in token_ids)):
            raise ValueError("job spec's 'prompt_token_ids' must be a non-empty list of "
                             "non-negative ints")
        return cls(**fields)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, payload: str | bytes) -> JobSpec:
        try:
            data = json.loads(payload)
        except json.JSONDecodeError as exc:
            raise ValueError(f"job spec is not valid JSON: {exc}") from exc
        return cls.from_dict(data)


def _check_cache_salt(value: Any) -> None:
    # An empty salt would read as none in vLLM, silently sharing the cache it was meant to split.
    if value is None:
        return
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_CACHE_SALT_CHARS:
        raise ValueError(f"job spec's 'cache_salt' must be a string of 1 to {MAX_CACHE_SALT_CHARS} "
                         "characters, or left out")


@dataclass(frozen=True, slots=True)
class StreamEntry:
    """One entry of a job's token stream.

    Token entries carry `index`, `token_id` and `text` (the text this token releases; may be ""
    while a possible stop string or a split UTF-8 character is held back), and `logprobs` (the
    field `lp`, TokenLogprobs.encode) when the job asked for them. The final entry has
    `finish_reason` and usage, and `error` when the job failed.

    Entry ids are explicit: the token with index i is `0-(i+1)` and the final entry follows the
    last token, so Redis itself refuses a duplicate or out-of-order append.
    """

    kind: str  # "token" or "done"
    index: int = -1
    token_id: int = -1
    text: str = ""
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""
    cached_tokens: int = 0  # prompt tokens the prefix cache held (final entry only)
    logprobs: TokenLogprobs | None = None

    TOKEN = "token"
    DONE = "done"


    def to_fields(self) -> dict[str, str]:
        if self.kind == StreamEntry.TOKEN:
            fields = {"kind": self.kind, "index": str(self.index), "token_id": str(self.token_id),
                      "text": self.text}
            if self.logprobs is not None:
                fields["lp"] = self.logprobs.encode()
            return fields
        return {
            "kind": self.kind,
            "finish_reason": self.finish_reason.value if self.finish_reason else "",
            "prompt_tokens": str(self.prompt_tokens),
            "completion_tokens": str(self.completion_tokens),
            "error": self.error,
            "cached_tokens": str(self.cached_tokens),
        }

    @classmethod
    def from_fields(cls, fields: dict[Any, Any]) -> StreamEntry:
        f = {_text(k): _text(v) for k, v in fields.items()}
        if f["kind"] == cls.TOKEN:
            return cls(kind=cls.TOKEN, index=int(f["index"]), token_id=int(f["token_id"]),
                       text=f["text"],
                       logprobs=TokenLogprobs.decode(f["lp"]) if f.get("lp") else None)
        return cls(
            kind=cls.DONE,
            finish_reason=FinishReason(f["finish_reason"]) if f["finish_reason"] else None,
            prompt_tokens=int(f["prompt_tokens"]),
            completion_tokens=int(f["completion_tokens"]),
            error=f.get("error", ""),
            cached_tokens=int(f.get("cached_tokens") or 0),
        )


@dataclass(frozen=True, slots=True)
class JobState:
    """Carpool's view of a job, kept in the hash `Keys.state(job_id)` (fields as strings).

    RQ's job hash keeps the queue's view (queued/started/finished...) and the final result;
    this hash adds what RQ has no field for. Timestamps are seconds since the epoch, 0 = not yet.
    Workers write prompt_tokens and first_token_at with the first token (and prompt_tokens on a
    requeue); completion_tokens, text and token_ids with the final status. Progress in between
    is the token stream (XLEN / the last entry id), which the per-token writes keep cheap.
    """

    job_id: str
    status: JobStatus
    owner: str = ""
    model: str = ""
    worker: str = ""  # the worker that holds (or last held) the job
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    error: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    created_at: float = 0.0
    started_at: float = 0.0
    first_token_at: float = 0.0
    finished_at: float = 0.0
    cached_tokens: int = 0  # prompt tokens the prefix cache held when the job last started
    num_recoveries: int = 0  # times recovery requeued it after its worker's lease lapsed
    queue_deadline_at: float = 0.0  # the JobSpec's deadlines, for status readers
    deadline_at: float = 0.0
    # The job's sampling.logprobs (-1: none asked), so a status read knows to fetch them.
    logprobs: int = -1
    # Its sampling.prompt_logprobs (-1: none asked), so a status read knows to HGET them (the
    # worker writes them, encoded, in this hash's `prompt_logprobs` field: protocol.job_reader).
    prompt_logprobs_asked: int = -1
    # The JobSpec's webhook_url: the scripts that end the job read it here to emit its event.
    webhook_url: str = ""
    # Its sampling.max_tokens: what the fair-share claim charges the owner up front (corrected
    # to the tokens generated when the job ends; worker/jobs/fair_share.py). 0: not recorded.
    max_tokens: int = 0
    # The final result (set with the final status): generated text and token ids.
    text: str = ""
    token_ids: tuple[int, ...] = ()
    # RQ's execution record of the current claim ("job_id:execution_id"), so recovery can
    # remove it from the StartedJobRegistry when it requeues a job whose worker died.
    execution: str = ""
    # The stream shard holding its token stream: the one of the worker that first started it
    # (protocol/stream_shards.py). -1: not started yet, or the streams are not sharded.
    stream_shard: int = -1

    def to_fields(self) -> dict[str, str]:
        out = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if isinstance(value, Enum):
                out[name] = value.value
            elif isinstance(value, tuple):
                out[name] = json.dumps(list(value), separators=(",", ":"))
            else:
                out[name] = "" if value is None else str(value)
        return out

    def result(self) -> JobResult:
        """The job's result as stored on the RQ job (meaningful once the status is final)."""
        return JobResult(
            job_id=self.job_id, status=self.status, text=self.text, token_ids=list(self.token_ids),
            finish_reason=self.finish_reason, error=self.error, prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens, created_at=self.created_at,
            started_at=self.started_at, first_token_at=self.first_token_at,
            finished_at=self.finished_at, num_preemptions=self.num_preemptions, worker=self.worker,
        )

    @classmethod
    def from_fields(cls, fields: dict[Any, Any]) -> JobState:
        f = {_text(k): _text(v) for k, v in fields.items()}
        kwargs: dict[str, Any] = {}
        for name, spec in cls.__dataclass_fields__.items():
            if name not in f:
                continue
            raw = f[name]
            if name == "status":
                kwargs[name] = JobStatus(raw)
            elif name == "finish_reason":
                kwargs[name] = FinishReason(raw) if raw else None
            elif spec.type in ("int",):
                kwargs[name] = int(raw) if raw else 0
            elif spec.type in ("float",):
                kwargs[name] = float(raw) if raw else 0.0
            elif spec.type.startswith("tuple"):
                kwargs[name] = tuple(json.loads(raw)) if raw else ()
            else:
                kwargs[name] = raw
        return cls(**kwargs)


@dataclass(frozen=True, slots=True)
class JobResult:
    """A job's final outcome: the RQ job's return value (`Job.return_value()`), as a JSON object.

    Timestamps are seconds since the epoch: `created_at` is when it was queued.
    """

    job_id: str
    status: JobStatus
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    created_at: float = 0.0
    started_at: float = 0.0
    first_token_at: float = 0.0
    finished_at: float = 0.0
    num_preemptions: int = 0
    worker: str = ""

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["status"] = self.status.value
        data["finish_reason"] = self.finish_reason.value if self.finish_reason else None
        data["usage"] = {"prompt_tokens": self.prompt_tokens,
                         "completion_tokens": self.completion_tokens,
                         "total_tokens": self.prompt_tokens + self.completion_tokens}
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobResult:
        fields = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        fields["status"] = JobStatus(fields["status"])
        reason = fields.get("finish_reason")
        fields["finish_reason"] = FinishReason(reason) if reason else None
        return cls(**fields)


@dataclass(frozen=True, slots=True)
class ModelCard:
    """What a worker tells the API about the model it serves."""

    name: str
    max_model_len: int
    eos_token: str | None = None
    bos_token: str | None = None
    chat_template: str | None = None
    created_at: float = field(default_factory=time.time)
    # The model's generation_config.json sampling fields, in SamplingParams' names
    # (protocol.generation_defaults): what a request that leaves a field out gets, as in vLLM.
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    vocab_size: int = 0  # rows of the model's output layer (0: unknown), for logit_bias checks

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, payload: str | bytes) -> ModelCard:
        return cls(**json.loads(payload))


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """A worker's live numbers, refreshed every iteration (for /metrics and /healthz)."""

    name: str
    model: str
    mode: str
    num_running: int = 0
    num_waiting: int = 0
    num_kv_blocks_used: int = 0
    num_kv_blocks_total: int = 0
    slot_utilisation: float = 0.0
    max_num_seqs: int = 0
    updated_at: float = 0.0
    # Jobs the worker holds a lease on (in its batch or about to end). Idle, this and
    # num_kv_blocks_used must both be 0: anything else is a leak.
    num_jobs: int = 0
    # `rq suspend` holds it: it finishes what it runs and starts nothing new.
    suspended: bool = False

    def to_fields(self) -> dict[str, str]:
        return {k: str(int(v) if isinstance(v, bool) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_fields(cls, fields: dict[Any, Any]) -> WorkerStats:
        f = {_text(k): _text(v) for k, v in fields.items()}
        types: dict[str, Callable[[str], Any]] = {
            "name": str, "model": str, "mode": str, "slot_utilisation": float,
            "updated_at": float, "suspended": lambda value: value == "1"}
        return cls(**{k: types.get(k, int)(v) for k, v in f.items() if k in cls.__dataclass_fields__})


# Latency histogram buckets in seconds, shared by the workers that observe and the API that renders.
HISTOGRAM_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)
HISTOGRAMS = ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_latency_seconds")
# Counter fields of Keys.counters(), incremented by workers.
COUNTERS = (
    "generated_tokens_total",  # tokens appended to streams
    "prompt_tokens_total",  # prompt tokens of jobs that ended
    "jobs_finished_total",
    "jobs_failed_total",
    "jobs_canceled_total",
    "jobs_expired_total",  # ended by their deadline or queue timeout (finish reason expired)
    "jobs_preempted_total",  # put back on the queue by a worker (KV pressure or drain)
    "jobs_recovered_total",  # put back on the queue by recovery after their lease lapsed
    "fenced_writes_total",  # appends refused because the worker no longer held the lease
    "prefix_cache_queries_total",  # prompt tokens of jobs that ended (vLLM's prefix_cache_queries)
    "prefix_cache_hits_total",  # of those, found in the prefix cache (vLLM's prefix_cache_hits)
    # plus one finished_counter(reason) per finish reason (vLLM's request_success)
)
FINISHED_COUNTER_PREFIX = "requests_finished_"


def finished_counter(reason: FinishReason) -> str:
    """The counter field of jobs that ended for `reason`, by its OpenAI name (stop, length,
    abort, error), as vLLM labels request_success."""
    return f"{FINISHED_COUNTER_PREFIX}{reason.openai_name}_total"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
