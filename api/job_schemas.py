"""Request and response bodies of the jobs API (`/v1/jobs`), as documented at /docs."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from api.fields import (
    LOGPROBS_DISTRIBUTION,
    AllowedTokenIds,
    BadWords,
    DeadlineS,
    MaxTokens,
    MinTokens,
    NonEmptyText,
    QueueTimeoutS,
    RetentionS,
    Temperature,
    Text,
    TopP,
    TruncatePromptTokens,
    TypicalP,
    WebhookUrl,
)
from api.sampling_fields import SharedSamplingFields
from api.structured_output import StructuredOutputParams
from protocol import FinishReason, JobStatus, Priority


class JobMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"] = Field(description="Who says it.")
    content: Annotated[Text, Field(description="What they say.")]


class JobCreate(StructuredOutputParams, SharedSamplingFields):
    """A generation job: give exactly one of `prompt` (plain text) and `messages` (a chat)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0.0},
        {"messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 64,
         "priority": "high"},
    ]})

    model: str | None = Field(None, description="A served model (GET /v1/models); default: the "
                                                "first one registered.")
    prompt: Annotated[NonEmptyText | None, Field(
        description="Text to continue, as is (no chat template).")] = None
    messages: list[JobMessage] | None = Field(
        None, min_length=1, description="A conversation, rendered with the model's chat template.")
    max_tokens: MaxTokens = 16
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    truncate_prompt_tokens: TruncatePromptTokens = None
    min_tokens: MinTokens = 0
    typical_p: TypicalP = 1.0
    allowed_token_ids: AllowedTokenIds = None
    bad_words: BadWords = []
    logprobs: int | None = Field(
        None, strict=True, ge=0,
        description="Return each token's log-probability and those of the `logprobs` most likely "
                    "tokens at its position (0: the token's only), in the stream and the status; "
                    "capped by the server's max_logprobs. " + LOGPROBS_DISTRIBUTION)
    prompt_logprobs: int | None = Field(
        None, strict=True, ge=0,
        description="vLLM's: each prompt token's log-probability given the ones before it and the "
                    "this many most likely there (raw model distribution; capped by the server's "
                    "max_logprobs), in the status once the first token is out.")
    priority: Priority = Field(Priority.NORMAL, description="Queue: high, normal, low or batch (idle seats only).")
    queue_timeout_s: QueueTimeoutS = None
    deadline_s: DeadlineS = None
    retention_s: RetentionS = None
    webhook_url: WebhookUrl = None
    n: int = Field(1, strict=True, ge=1,
                   description="Jobs to run on this input (at most the server's max_n), queued "
                               "together, all or none; with a seed, job i samples with seed + i. "
                               "Their ids are in the answer's job_ids.")

    @model_validator(mode="after")
    def _one_input(self) -> JobCreate:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        return self


class JobAccepted(BaseModel):
    job_id: str = Field(description="The job's id, for /v1/jobs/{job_id}.")
    object: Literal["job"] = Field(default="job", description="Always 'job'.")
    status: JobStatus = Field(description="'queued': it waits for a worker (for a repeated "
                                          "Idempotency-Key: the first job's status now).")
    model: str = Field(description="The model that will run it.")
    priority: Priority = Field(description="The queue it waits in.")
    prompt_tokens: int | None = Field(None, description="Prompt length in the model's tokens "
                                                        "(None when the API cannot count them).")
    max_tokens: int = Field(description="Most tokens it will generate (the default filled in).")
    status_url: str = Field(description="GET it for the job's status (also in Location).")
    stream_url: str = Field(description="Server-Sent Events of the job's tokens (resumable).")
    job_ids: list[str] | None = Field(
        None, description="Only with n > 1: the n jobs, in order (job_id is the first).")


class Usage(BaseModel):
    prompt_tokens: int = Field(description="Tokens of the prompt (after the chat template).")
    completion_tokens: int = Field(description="Tokens generated.")
    total_tokens: int = Field(description="The two together.")


class JobTimings(BaseModel):
    """Seconds since the epoch (None: not yet), and the latencies derived from them."""

    created_at: float | None = Field(description="When it was submitted.")
    started_at: float | None = Field(description="When a worker first took it.")
    first_token_at: float | None = Field(description="When its first token was generated.")
    finished_at: float | None = Field(description="When it ended.")
    queued_s: float | None = Field(description="From submission to a worker first taking it.")
    time_to_first_token_s: float | None = Field(description="From submission to the first token.")
    e2e_s: float | None = Field(description="From submission to the end.")
    queue_deadline_at: float | None = Field(
        None, description="Not started by then, it never starts (queue_timeout_s).")
    deadline_at: float | None = Field(None, description="Past it, the job ends (deadline_s).")


class TopLogprob(BaseModel):
    token_id: int = Field(description="A likely token at this position.")
    logprob: float = Field(description="Its log-probability.")


class PromptTokenLogprob(BaseModel):
    logprob: float = Field(description="Its log-probability given the prompt tokens before it.")
    rank: int = Field(description="Its rank there (1: the most likely).")
    decoded_token: str = Field(description="The token decoded alone.")


class TokenLogprob(BaseModel):
    index: int = Field(description="The token's position in the output, 0-based.")
    token_id: int = Field(description="The token generated.")
    logprob: float = Field(description="Its log-probability (see JobCreate.logprobs).")
    top_logprobs: list[TopLogprob] = Field(description="The most likely tokens, most likely first.")


class JobView(BaseModel):
    job_id: str = Field(description="The job's id.")
    object: Literal["job"] = Field(default="job", description="Always 'job'.")
    status: JobStatus = Field(description="queued, running, preempted, finished, failed or canceled.")
    model: str = Field(description="The model running it.")
    text: str = Field(description="The text generated so far (all of it once the job ended).")
    num_tokens: int = Field(description="Tokens generated so far.")
    finish_reason: FinishReason | None = Field(
        description="Once ended: stop (EOS or a stop string), length, canceled, error or "
                    "expired (its deadline or queue timeout passed).")
    error: str | None = Field(description="Why the job failed, when it did.")
    usage: Usage | None = Field(description="Token counts, once the job ended.")
    num_preemptions: int = Field(description="Times the job was preempted and resumed.")
    worker: str | None = Field(description="The worker that holds (or last held) it.")
    timings: JobTimings = Field(description="When things happened, and the latencies.")
    stream_url: str = Field(description="Server-Sent Events of its tokens (resumable).")
    logprobs: list[TokenLogprob] | None = Field(
        None, description="Per token so far, when the job asked for logprobs; else null.")
    prompt_logprobs: list[dict[str, PromptTokenLogprob] | None] | None = Field(
        None, description="vLLM's shape, when the job asked for prompt_logprobs and its first token "
                          "is out: per prompt token null (the first) or {token id: {logprob, rank, "
                          "decoded_token}} for the token and the most likely; else null.")


class JobSummary(BaseModel):
    job_id: str = Field(description="The job's id.")
    object: Literal["job"] = Field(default="job", description="Always 'job'.")
    status: JobStatus = Field(description="queued, running, preempted, finished, failed or canceled.")
    model: str = Field(description="The model it asked for.")
    created_at: float = Field(description="When it was submitted (seconds since the epoch).")
    finished_at: float | None = Field(description="When it ended (None: not yet).")
    finish_reason: FinishReason | None = Field(description="Once ended: why.")
    completion_tokens: int = Field(description="Tokens generated (counted once it ended).")
    status_url: str = Field(description="GET it for the job's full status and text.")


class JobList(BaseModel):
    object: Literal["list"] = Field(default="list", description="Always 'list'.")
    data: list[JobSummary] = Field(description="Your jobs, newest first.")
    has_more: bool = Field(description="Whether older jobs follow.")
    next_after: str | None = Field(description="Pass as `after` for the next page (None: none).")


class JobCanceled(BaseModel):
    job_id: str = Field(description="The job's id.")
    object: Literal["job"] = Field(default="job", description="Always 'job'.")
    status: JobStatus = Field(description="The job's status after the request: canceled, or the "
                                          "final status it had already reached.")
    canceled: bool = Field(description="Whether this request canceled it.")


class ErrorDetail(BaseModel):
    detail: str | list[dict[str, object]] = Field(
        description="What went wrong: a sentence, or (422) FastAPI's list of invalid fields.")
