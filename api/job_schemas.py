"""Request and response bodies of the jobs API (`/v1/jobs`), as documented at /docs."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from api.fields import (
    IgnoreEos,
    MaxTokens,
    NonEmptyText,
    Seed,
    StopStrings,
    Temperature,
    Text,
    TopK,
    TopP,
)
from api.structured_output import StructuredOutputParams
from protocol import FinishReason, JobStatus, Priority


class JobMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"] = Field(description="Who says it.")
    content: Annotated[Text, Field(description="What they say.")]


class JobCreate(StructuredOutputParams):
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
    top_k: TopK = 0
    seed: Seed = None
    stop: StopStrings = []
    ignore_eos: IgnoreEos = False
    priority: Priority = Field(Priority.NORMAL, description="Queue to wait in: high, normal or low.")

    @model_validator(mode="after")
    def _one_input(self) -> JobCreate:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        return self


class JobAccepted(BaseModel):
    job_id: str = Field(description="The job's id, for /v1/jobs/{job_id}.")
    object: Literal["job"] = Field(default="job", description="Always 'job'.")
    status: JobStatus = Field(description="'queued': it waits for a worker.")
    model: str = Field(description="The model that will run it.")
    priority: Priority = Field(description="The queue it waits in.")
    prompt_tokens: int | None = Field(None, description="Prompt length in the model's tokens "
                                                        "(None when the API cannot count them).")
    max_tokens: int = Field(description="Most tokens it will generate (the default filled in).")
    status_url: str = Field(description="GET it for the job's status (also in Location).")
    stream_url: str = Field(description="Server-Sent Events of the job's tokens (resumable).")


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


class JobView(BaseModel):
    job_id: str = Field(description="The job's id.")
    object: Literal["job"] = Field(default="job", description="Always 'job'.")
    status: JobStatus = Field(description="queued, running, preempted, finished, failed or canceled.")
    model: str = Field(description="The model running it.")
    text: str = Field(description="The text generated so far (all of it once the job ended).")
    num_tokens: int = Field(description="Tokens generated so far.")
    finish_reason: FinishReason | None = Field(
        description="Once ended: stop (EOS or a stop string), length, canceled or error.")
    error: str | None = Field(description="Why the job failed, when it did.")
    usage: Usage | None = Field(description="Token counts, once the job ended.")
    num_preemptions: int = Field(description="Times the job was preempted and resumed.")
    worker: str | None = Field(description="The worker that holds (or last held) it.")
    timings: JobTimings = Field(description="When things happened, and the latencies.")
    stream_url: str = Field(description="Server-Sent Events of its tokens (resumable).")


class JobCanceled(BaseModel):
    job_id: str = Field(description="The job's id.")
    object: Literal["job"] = Field(default="job", description="Always 'job'.")
    status: JobStatus = Field(description="The job's status after the request: canceled, or the "
                                          "final status it had already reached.")
    canceled: bool = Field(description="Whether this request canceled it.")


class ErrorDetail(BaseModel):
    detail: str | list[dict[str, object]] = Field(
        description="What went wrong: a sentence, or (422) FastAPI's list of invalid fields.")
