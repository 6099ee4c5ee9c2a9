"""The API process's one settings object (environment prefix CARPOOL_), built once at start."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from api.fields import MAX_RETENTION_S
from protocol.stream_shards import parse_shard_urls
from protocol.webhook_urls import WebhookAllowList


class ApiSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CARPOOL_", extra="ignore")

    host: str = Field("127.0.0.1", description="Interface uvicorn binds to.")
    port: int = Field(8000, ge=1, le=65535)
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis holding queues and streams.")
    keys_prefix: str = Field("carpool", description="Prefix of every Carpool key (protocol.Keys).")
    stream_redis_urls: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Stream shards, as the workers have them (CARPOOL_STREAM_REDIS_URLS=u1,u2), "
                    "one per Redis server: a job's stream is on the one its state records (its "
                    "worker's); empty: on redis_url.")
    # NoDecode: the variable is a comma-separated list ("key1,key2"), not JSON.
    api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Accepted bearer keys; empty means the API runs open (CARPOOL_API_KEYS=k1,k2).",
    )
    # Per-key policies (api/key_policies.py): "key=value" lists over the keys of api_keys.
    default_key_weight: float = Field(
        1.0, gt=0, description="A key's share of seats when keys compete for a model's workers "
                               "(fair shares), unless key_weights names it.")
    key_weights: Annotated[dict[str, float], NoDecode] = Field(
        default_factory=dict,
        description="Weights of named keys (CARPOOL_KEY_WEIGHTS=k1=2,k2=1): a key of weight 2 gets "
                    "twice the tokens of a key of weight 1 while both have jobs waiting.")
    max_queued_jobs_per_key: int = Field(
        0, ge=0, description="Jobs one key may have waiting in a model's queues; past it its "
                             "submissions get 429 (0: no limit).")
    key_max_queued_jobs: Annotated[dict[str, int], NoDecode] = Field(
        default_factory=dict, description="The same for named keys (CARPOOL_KEY_MAX_QUEUED_JOBS="
                                          "k1=100,k2=10); 0: no limit.")
    tokens_per_minute_per_key: int = Field(
        0, ge=0, description="Tokens (prompt + max_tokens of each job) one key may submit per "
                             "minute, over every API process; past it 429 with the wait in "
                             "Retry-After (0: no limit).")
    key_tokens_per_minute: Annotated[dict[str, int], NoDecode] = Field(
        default_factory=dict, description="The same for named keys (CARPOOL_KEY_TOKENS_PER_MINUTE="
                                          "k1=100000); 0: no limit.")
    public_docs: bool = Field(
        True, description="Serve /docs and /openapi.json without a key (they hold no job data)."
    )
    max_queue_depth: int = Field(
        1000, ge=1, description="Jobs waiting over one model's priority queues before its submissions "
                              "get 429."
    )
    max_batch_queue_depth: int = Field(
        1000, ge=1, description="Jobs waiting on one model's batch-tier queue: batch lines past it "
        "wait in their batch's input file. The batch queue does not count toward "
        "max_queue_depth, so a big batch never turns interactive requests away.")
    retry_after_s: int = Field(1, ge=1, description="Retry-After sent with 429 and 503 answers.")
    result_ttl_s: int = Field(
        24 * 3600, ge=1, le=MAX_RETENTION_S,
        description="How long a finished or canceled job (status, result, token stream) is kept "
                    "after it ends, unless the job asks for its own retention_s.")
    failure_ttl_s: int = Field(
        7 * 24 * 3600, ge=1, le=MAX_RETENTION_S,
        description="The same for a failed job (kept longer, to inspect).")
    idempotency_ttl_s: int = Field(
        24 * 3600, ge=1, le=30 * 24 * 3600,
        description="How long an Idempotency-Key keeps answering with its first job.")
    max_n: int = Field(
        16, ge=1, description="Most choices (`n`) per prompt on the OpenAI routes; each is a job.")
    max_prompts: int = Field(
        64, ge=1, description="Most prompts in one /v1/completions request (a list of prompts).")
    max_logprobs: int = Field(
        20, ge=0, description="Most alternatives a request may ask for per token (completions' "
                              "logprobs, chat's top_logprobs, the jobs API's logprobs); vLLM's cap.")
    max_body_bytes: int = Field(
        2 * 1024 * 1024, ge=1024,
        description="Largest request body accepted; a larger one is answered 413 unread. Two MiB "
                    "holds a 1M-character prompt, far past any served model's context.")
    stream_block_ms: int = Field(
        1000, ge=10, le=60_000,
        description="XREAD BLOCK timeout: how often a waiting stream re-checks the job and client.",
    )
    stream_hub: bool = Field(
        True,
        description="Follow every SSE subscriber's stream through one blocking XREAD per API "
                    "process (one Redis connection, one command per wake for all streams); false: "
                    "each subscriber blocks on an XREAD and a connection of its own.")
    stream_hub_interval_ms: float = Field(
        0.0, ge=0, le=1000,
        description="Least time between two of the stream hub's turns that brought entries: a "
                    "few ms let one read of the step notifications gather the steps of several "
                    "workers, at that much added token latency.")
    sse_keepalive_s: float = Field(15.0, gt=0, description="Idle time before an SSE keep-alive (api/sse.py).")
    stream_outage_s: float = Field(
        30.0, ge=0, le=3600,
        description="How long an open stream (or a request waiting for its answer) rides out Redis "
                    "or its stream shard being unreachable, keeping its client's connection alive, "
                    "before it ends with an error; it resumes after its last event when Redis "
                    "answers again (api/stream_outages.py). 0: end at the first failure.")
    redis_timeout_s: float = Field(
        5.0, gt=0, description="Connect/command timeout to Redis, so Redis down answers 503 quickly."
    )
    redis_max_connections: int | None = Field(
        None, ge=1,
        description="Redis connections the API may open, per Redis server. Default: 64 with the "
                    "stream hub, where a request that finds them all busy waits for one (up to "
                    "60 s) instead of failing, so 10,000 subscribers connecting at once "
                    "hold 64 at most; 10000 without it, where every SSE subscriber holds one while "
                    "it waits on XREAD (Redis's own maxclients default is 10000).")
    http_keep_alive_s: int = Field(
        75, ge=1,
        description="How long uvicorn keeps an idle HTTP/1.1 connection open (uvicorn's default is "
                    "5 s). A request a client sends on a pooled connection as the server closes it "
                    "fails with a reset the client cannot safely retry (a POST may have landed); a "
                    "long timeout makes that race rare. 75 s outlives common proxy and load "
                    "balancer idle timeouts (nginx 75 s, AWS ALB 60 s), so they close first.")
    tool_parser: str = Field(
        "hermes", description="How tool calls are read from the output of chat requests with "
                              "tools (api/tool_parsers.py: hermes).")
    webhook_allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Hosts a job's webhook_url may name: host patterns (*.example.com) and networks "
                    "(10.0.0.0/8), comma-separated; empty: any public address. Private, loopback "
                    "and link-local addresses only when listed (protocol/webhook_urls.py).")
    max_file_bytes: int = Field(
        50 * 1024 * 1024, ge=1, description="Largest file POST /v1/files takes (Batch API input); "
        "files are kept in Redis, so this bounds the memory one upload costs.")
    max_batch_lines: int = Field(50_000, ge=1, description="Most requests one batch input file holds.")
    file_retention_s: int = Field(
        7 * 24 * 3600, ge=60, description="How long uploaded files and batch output files are kept.")
    batch_retention_s: int = Field(
        7 * 24 * 3600, ge=60, description="How long a batch object is kept once it ended.")
    batch_tick_s: float = Field(
        1.0, gt=0, le=60, description="How often each API process advances the open batches.")
    batch_submit_lines: int = Field(
        256, ge=1, description="Lines a batch runner queues per batch and tick (the rest wait "
        "for the next tick, so a huge batch never stalls the others).")
    batch_poll_lines: int = Field(
        1024, ge=1, description="Unanswered lines a batch runner checks per batch and tick (they "
        "take turns), bounding the Redis reads a huge batch costs.")
    batch_runner: bool = Field(
        True, description="Advance open batches in this API process (any number of processes "
        "may: a Redis lock per batch keeps them from duplicating work).")
    cors_allowed_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["*"],
        description="Origins whose web pages may call the API from a browser (CORS), "
                    "comma-separated; * (the default, as vLLM's --allowed-origins) any, empty: "
                    "none. Keys still apply: a page needs one to reach anything but the open "
                    "routes.")
    log_level: str = Field("info")

    @field_validator("webhook_allowed_hosts", mode="before")
    @classmethod
    def _split_hosts(cls, value: object) -> object:
        if isinstance(value, str):
            value = [entry.strip() for entry in value.split(",") if entry.strip()]
        if isinstance(value, list):
            WebhookAllowList.parse([str(entry) for entry in value])  # a bad entry fails at start
        return value

    @property
    def webhook_allow_list(self) -> WebhookAllowList:
        return WebhookAllowList.parse(self.webhook_allowed_hosts)

    @field_validator("tool_parser")
    @classmethod
    def _known_tool_parser(cls, value: str) -> str:
        from api.tool_parsers import parser_names  # here: settings load before the routes

        if value not in parser_names():
            raise ValueError(f"unknown tool parser {value!r} (known: {', '.join(parser_names())})")
        return value

    @field_validator("stream_redis_urls", mode="before")
    @classmethod
    def _split_urls(cls, value: object) -> object:
        return parse_shard_urls(value)

    @field_validator("key_weights", "key_max_queued_jobs", "key_tokens_per_minute", mode="before")
    @classmethod
    def _split_pairs(cls, value: object) -> object:
        if not isinstance(value, str):
            return value
        pairs: dict[str, str] = {}
        for item in (part.strip() for part in value.split(",")):
            key, sep, number = item.rpartition("=")
            if item and (not sep or not key.strip()):
                raise ValueError(f"expected key=value pairs separated by commas, got {item!r}")
            if item:
                pairs[key.strip()] = number.strip()
        return pairs

    @model_validator(mode="after")
    def _per_key_settings_name_known_keys(self) -> ApiSettings:
        for name in ("key_weights", "key_max_queued_jobs", "key_tokens_per_minute"):
            values: dict[str, float] = getattr(self, name)
            unknown = [key for key in values if key not in self.api_keys]
            if unknown:
                raise ValueError(f"{name} names {len(unknown)} key(s) that are not in api_keys")
            negative = [key for key, number in values.items()
                        if number < 0 or (name == "key_weights" and number == 0)]
            if negative:
                raise ValueError(f"{name} must be {'> 0' if name == 'key_weights' else '>= 0'} "
                                 f"for every key")
        return self

    @field_validator("api_keys", "cors_allowed_origins", mode="before")
    @classmethod
    def _split_keys(cls, value: object) -> object:
        if isinstance(value, str):
            return [key.strip() for key in value.split(",") if key.strip()]
        return value

    @property
    def max_redis_connections(self) -> int:
        if self.redis_max_connections is not None:
            return self.redis_max_connections
        return 64 if self.stream_hub else 10_000
