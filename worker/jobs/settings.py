"""The worker process's one settings object (environment prefix CARPOOL_), built once at start.

Command-line flags (`python -m worker --max-num-seqs 8`) override the environment; everything is
validated here, and the rest of the worker reads this object (or the EngineConfig it builds).
"""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path
from typing import Annotated, Literal, TypedDict

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from protocol.stream_shards import parse_shard_urls
from protocol.stream_steps import LIVE_WINDOW_MS
from worker.engine.config import BatchingMode, EngineConfig, LogprobsMode


class EngineKwargs(TypedDict):
    """The EngineConfig fields WorkerSettings.engine_kwargs fills in."""

    model: str
    dtype: str
    device: str
    block_size: int
    num_kv_blocks: int | None
    kv_cache_memory_gib: float | None
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    max_model_len: int | None
    mode: BatchingMode
    num_threads: int | None
    logprobs_mode: LogprobsMode


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CARPOOL_", extra="ignore")

    model: str = Field("smollm2", description="Bundled model name or a local HF directory.")
    served_model_name: str = Field(
        "", description="The name jobs and the API use for it; default: the model name, or the "
        "directory's name for a path.")
    redis_url: str = Field("redis://127.0.0.1:6379/0")
    # NoDecode: the variable is a comma-separated list ("redis://a,redis://b"), not JSON.
    stream_redis_urls: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Stream shards: Redis servers for the token streams, a job's on the shard of "
                    "the worker that first started it (protocol.stream_shards); empty: the "
                    "streams stay on redis_url. List redis_url itself to keep its share of "
                    "streams there.")
    stream_shard: int = Field(
        -1, ge=-1, description="This worker's stream shard (an index into stream_redis_urls): "
        "the jobs it starts stream there. -1: the next in turn over the fleet's worker starts.")
    keys_prefix: str = Field("carpool", description="Prefix of every Carpool key (protocol.Keys).")
    name: str = Field("", description="Worker name in rq info and stats; default host-pid-random.")
    mode: BatchingMode = BatchingMode.CONTINUOUS
    max_num_seqs: int | None = Field(
        None, ge=1, le=4096, description="Seats; default: from the device and the KV pool (up to 256).")
    max_num_batched_tokens: int | None = Field(
        None, ge=1, description="Token budget of a step; default: 8 per seat, 512 to 2048 on a CPU.")
    num_kv_blocks: int | None = Field(None, ge=1)
    kv_cache_memory_gib: float | None = Field(
        None, gt=0, le=1 << 20, description="GiB the paged KV pool may take when num_kv_blocks is "
        "unset (vLLM's VLLM_CPU_KVCACHE_SPACE on a CPU): the pool holds the seats' full contexts "
        "or this much, the smaller; more of it gives more seats and longer contexts room. Unset: "
        "a quarter of the memory available at start on a CPU (at least 2 GiB where half of it "
        "allows), half the memory free on a GPU once the model is loaded. A worker refuses to "
        "start with a pool larger than the memory available (free on a GPU).")
    block_size: int = Field(16, ge=1, le=1024)
    max_model_len: int | None = Field(None, ge=2)
    dtype: str = "auto"
    device: str = "auto"
    num_threads: int | None = Field(None, ge=1)
    logprobs_mode: LogprobsMode = Field(
        LogprobsMode.RAW, description="What generated tokens' logprobs are of (vLLM's "
        "--logprobs-mode): raw_logprobs, the model's own distribution whatever the request's "
        "temperature, penalties or bias (vLLM's default); processed_logprobs, the distribution "
        "after them at the request's temperature, the one the token was drawn from (before "
        "min-p, top-k and top-p).")
    lease_seconds: float = Field(
        30.0, gt=0, description="A job's lease: renewed at the first iteration after an eighth of it "
        "passed; once it lapses (worker dead or stuck) recovery requeues the job and the old owner "
        "can no longer append.")
    drain_seconds: float = Field(
        30.0, ge=0,
        description="On SIGTERM: time to finish running jobs before requeueing the rest.")
    idle_block_seconds: float = Field(
        1.0, gt=0, le=30, description="Longest wait on the queues when idle (it also bounds how "
        "late an idle worker notices SIGTERM).")
    stats_ttl_seconds: float = Field(10.0, gt=0, description="TTL of the WorkerStats hash.")
    stream_interval_ms: float = Field(
        0.0, ge=0, le=1000, description="Least time between two publishes of the batch's tokens "
        "(0: every step, as vLLM's stream_interval 1). The steps in between keep their tokens, "
        "which then go to Redis as one stream entry per job: Redis' cost goes by entries and "
        "round trips, not tokens (protocol/token_runs.py). A first token, an end, a requeue "
        "and a preemption are published at once; cancel requests are seen at publishes.")
    durable_interval_ms: float = Field(
        500.0, ge=0, le=LIVE_WINDOW_MS - 1000, description="[redis-cost] Least time between two "
        "writes of a job's tokens to its stream; the publishes in between send them to "
        "subscribers live, in the step notifications only (0: every publish writes the streams). "
        "Redis' cost goes by entries, so a job's stream gets one entry for the tokens of that "
        "long while subscribers still get each token at its step; a dead worker's live tokens "
        "go into the streams from its live journal when recovery requeues its jobs (protocol/"
        "stream_steps.py). Streams on stream shards are written at every publish.")
    metrics_interval_ms: float = Field(
        1000.0, ge=0, le=60_000, description="Least time between two writes of the worker's "
        "metric counters and latency histograms (0: every publish). They add up in the worker "
        "meanwhile; a worker going idle or draining writes them at once. A step's histogram "
        "buckets are some fifteen commands, paid once a second instead of at every step.")
    redis_timeout_seconds: float = Field(10.0, gt=0)
    redis_backoff_base_seconds: float = Field(
        0.05, gt=0, description="First wait before retrying an unreachable Redis; it doubles "
        "with every failure (jittered) up to the cap.")
    redis_backoff_max_seconds: float = Field(
        2.0, gt=0, description="Longest wait between Redis retries (and at most a quarter "
        "lease, so a short outage never costs the worker its leases).")
    log_level: str = "INFO"
    fault: Literal["", "kill_after_wake"] = Field(
        "", description="Fault injection for tests only: kill_after_wake SIGKILLs the worker "
        "right after its idle wait returns, before it claims (the old job-loss window).")
    openmp: Literal["intel", "gnu"] = Field(
        "gnu", description="OpenMP runtime of the model's CPU threads: torch's GNU one, or Intel's "
        "(preloaded from the intel-openmp package, as vLLM does; opt-in, see process_preloads).")
    allocator: Literal["tcmalloc", "system"] = Field(
        "tcmalloc", description="Memory allocator of the worker process: tcmalloc (preloaded "
        "where libtcmalloc-minimal4 is installed, as vLLM's CPU backend asks) or glibc's malloc "
        "(worker.model.process_preloads).")

    @field_validator("stream_redis_urls", mode="before")
    @classmethod
    def _split_urls(cls, value: object) -> object:
        return parse_shard_urls(value)

    @model_validator(mode="after")
    def _check(self) -> WorkerSettings:
        if self.stream_shard >= max(1, len(self.stream_redis_urls)):
            raise ValueError(f"stream_shard {self.stream_shard} is not an index into "
                             f"stream_redis_urls ({len(self.stream_redis_urls)} listed)")
        if self.idle_block_seconds >= self.lease_seconds:
            # An idle wait longer than the lease would let recovery and heartbeats fall behind.
            self.idle_block_seconds = max(0.05, self.lease_seconds / 4)
        if self.stream_interval_ms / 1000 > self.lease_seconds / 16:
            # Leases are renewed at publishes: a few times a lease, with room to spare.
            raise ValueError(f"stream_interval_ms ({self.stream_interval_ms:g}) must be at most "
                             f"a sixteenth of the lease ({self.lease_seconds:g} s): lower "
                             "CARPOOL_STREAM_INTERVAL_MS or raise CARPOOL_LEASE_SECONDS")
        if not self.served_model_name:
            path = Path(self.model).expanduser()
            self.served_model_name = path.name if path.is_dir() else self.model
        if not self.name:
            self.name = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        EngineConfig(**self.engine_kwargs())  # fail at start, with the engine's own message
        return self

    def engine_kwargs(self) -> EngineKwargs:
        return EngineKwargs(model=self.model, dtype=self.dtype, device=self.device,
                            block_size=self.block_size, num_kv_blocks=self.num_kv_blocks,
                            kv_cache_memory_gib=self.kv_cache_memory_gib,
                            max_num_seqs=self.max_num_seqs,
                            max_num_batched_tokens=self.max_num_batched_tokens,
                            max_model_len=self.max_model_len, mode=self.mode,
                            num_threads=self.num_threads, logprobs_mode=self.logprobs_mode)

    def engine_config(self) -> EngineConfig:
        # The worker requeues preempted jobs on Redis, so another worker can take them.
        return EngineConfig(**self.engine_kwargs(), requeue_preempted=False)

    @property
    def lease_ms(self) -> int:
        return max(1, int(self.lease_seconds * 1000))

    @property
    def redis_backoff_cap_seconds(self) -> float:
        return max(self.redis_backoff_base_seconds,
                   min(self.redis_backoff_max_seconds, self.lease_seconds / 4))

    @property
    def heartbeat_seconds(self) -> float:
        """How often the RQ heartbeat, execution records and recovery run."""
        return min(self.lease_seconds / 2, 10.0)

    @property
    def execution_ttl_seconds(self) -> int:
        """TTL of RQ's execution records. Well past the lease, so Carpool's recovery requeues an
        abandoned job before RQ's own cleanup (any rq worker's maintenance) would fail it."""
        return int(max(self.lease_seconds * 3, 60)) + 60
