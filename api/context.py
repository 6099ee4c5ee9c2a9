"""The objects one API process shares between requests, built once from its settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import redis
import redis.asyncio as aioredis
import redis.asyncio.retry
import redis.retry
from fastapi import Request
from redis.backoff import NoBackoff

from api.auth import ApiKeyAuth
from api.batch_files import FileStore
from api.batch_store import BatchStore
from api.chat_completions_store import ChatCompletionStore
from api.conversations_store import ConversationStore
from api.job_service import JobService
from api.job_stream import JobStream, StreamShard
from api.key_policies import KeyPolicies, KeyPolicy
from api.model_registry import ModelRegistry
from api.responses_store import ResponseStore
from api.settings import ApiSettings
from api.state_reads import SharedStateReads
from api.stream_hub import StreamHub
from api.stream_outages import RedisRecovery
from api.tokenizer_cache import TokenizerCache
from protocol import JobState, Keys
from protocol.redis_errors import drop_idle_connections
from protocol.stream_shards import shard_urls, started_shard

# No retries, pinned: Redis down answers 503 at once and a hung Redis after one socket timeout.
# redis-py's constructor defaults to 10 retries backing off up to 1 s (a hung Redis would hold a
# request for 11 timeouts); from_url happens to give 0 today. A pooled connection that a Redis
# restart closed needs no retry: the pool checks a connection as it hands it out.
REDIS_RETRIES = 0
_NO_BACKOFF = NoBackoff()
_POOL_WAIT_S = 60.0  # longest wait for a free pooled connection (with the stream hub)


@dataclass(slots=True)
class AppContext:
    settings: ApiSettings
    keys: Keys
    aio: aioredis.Redis  # reads, streams, metrics (decoded str replies)
    sync: redis.Redis  # RQ and the protocol's sync helpers (bytes replies, as RQ requires)
    auth: ApiKeyAuth
    models: ModelRegistry
    jobs: JobService
    hub: StreamHub | None  # None: every SSE subscriber blocks on an XREAD of its own
    # Stream shards (protocol.stream_shards), each with its own hub: [aio] when not sharded.
    shard_clients: list[aioredis.Redis] = field(default_factory=list)
    shard_hubs: list[StreamHub | None] = field(default_factory=list)
    state_reads: SharedStateReads | None = None
    # Shared by the streams riding out an outage: one PING at a time per server.
    recovery: RedisRecovery = field(default_factory=RedisRecovery)
    # The Batch API's files and batches (built from the settings when not handed in).
    files: FileStore = field(init=False)
    batches: BatchStore = field(init=False)
    # The Responses API's stored responses (kept as long as a finished job's results).
    responses: ResponseStore = field(init=False)
    # The Conversations API's conversations (kept as long, after their last change).
    conversations: ConversationStore = field(init=False)
    # Chat completions made with store: true (kept as long as stored responses).
    chat_completions: ChatCompletionStore = field(init=False)

    def __post_init__(self) -> None:
        self.files = FileStore(self.aio, self.keys, self.settings.file_retention_s)
        self.batches = BatchStore(self.aio, self.keys, self.settings.batch_retention_s)
        self.responses = ResponseStore(self.aio, self.keys, self.settings.result_ttl_s)
        self.conversations = ConversationStore(self.aio, self.keys, self.settings.result_ttl_s)
        self.chat_completions = ChatCompletionStore(self.aio, self.keys, self.settings.result_ttl_s)

    @classmethod
    def build(cls, settings: ApiSettings, aio: aioredis.Redis | None = None,
              sync: redis.Redis | None = None) -> AppContext:
        timeout = settings.redis_timeout_s
        if aio is None:
            aio = _async_client(settings.redis_url, settings)
        if sync is None:
            sync = redis.Redis.from_url(settings.redis_url, socket_connect_timeout=timeout,
                                        socket_timeout=timeout,
                                        retry=redis.retry.Retry(_NO_BACKOFF, REDIS_RETRIES))
        keys = Keys(prefix=settings.keys_prefix)
        models = ModelRegistry(aio, keys, settings.retry_after_s)
        tokenizers = TokenizerCache(aio, keys)
        jobs = JobService(aio, sync, keys, models, tokenizers, settings.max_queue_depth,
                          settings.retry_after_s, settings.idempotency_ttl_s,
                          settings.result_ttl_s, settings.failure_ttl_s, settings.max_logprobs,
                          settings.webhook_allow_list, settings.max_batch_queue_depth,
                          key_policies(settings))
        shard_clients = [
            aio if url == settings.redis_url else _async_client(url, settings)
            for url in shard_urls(settings.redis_url, settings.stream_redis_urls)]
        # One hub (one reader connection, blocked on the shard's step notifications) per shard.
        shard_hubs = [_hub(client, settings, keys) for client in shard_clients]
        return cls(settings=settings, keys=keys, aio=aio, sync=sync,
                   auth=ApiKeyAuth(settings.api_keys), models=models, jobs=jobs,
                   hub=shard_hubs[0], shard_clients=shard_clients, shard_hubs=shard_hubs,
                   state_reads=SharedStateReads(aio, settings.stream_block_ms / 1000 / 2))

    def redis_heard_within(self, seconds: float) -> bool:
        """Whether the main Redis was heard serving within the last `seconds`: its stream hub
        (the first shard's, when that is the main Redis) got a step notification then."""
        on_main = bool(self.shard_clients) and self.shard_clients[0] is self.aio
        return on_main and self.hub is not None and self.hub.heard_within(seconds)

    def stream(self, job_id: str, state: JobState | None = None) -> JobStream:
        """The reader of `job_id`'s stream, on its shard: the one `state` records (or, for a job
        started before shards were recorded, its job id's). Without a state (a job this request
        just submitted) or for one no worker started yet, the reader waits for the stream on
        every shard (protocol/stream_shards.py)."""
        if not self.shard_clients:  # a context built by hand, without shards
            return JobStream(self.aio, self.keys, job_id, self.settings.stream_block_ms, self.hub)
        num_shards = len(self.shard_clients)
        index = (None if state is None
                 else started_shard(job_id, state.stream_shard, state.started_at, num_shards))
        if index is None and num_shards > 1:
            hubs = self.shard_hubs or [None] * num_shards
            return JobStream(self.aio, self.keys, job_id, self.settings.stream_block_ms,
                             state_reads=self.state_reads,
                             unplaced=[StreamShard(client, hub)
                                       for client, hub in zip(self.shard_clients, hubs)])
        index = index or 0  # one shard: all streams on it
        return JobStream(self.aio, self.keys, job_id, self.settings.stream_block_ms,
                         self.shard_hubs[index], stream_redis=self.shard_clients[index],
                         state_reads=self.state_reads)

    async def drop_idle_connections(self) -> None:
        """protocol.redis_errors.drop_idle_connections, for the async clients too."""
        clients = {id(client): client for client in [self.aio, *self.shard_clients]}
        for client in clients.values():
            await client.connection_pool.disconnect(inuse_connections=False)
        drop_idle_connections([self.sync])

    async def close(self) -> None:
        hubs = self.shard_hubs or [self.hub]
        for hub in hubs:
            if hub is not None:
                await hub.close()
        for client in self.shard_clients:
            if client is not self.aio:
                await client.aclose()
        await self.aio.aclose()
        self.sync.close()


def _async_client(url: str, settings: ApiSettings) -> aioredis.Redis:
    timeout = settings.redis_timeout_s
    # A socket timeout must outlast the XREAD BLOCK of a waiting stream.
    socket_timeout = timeout + settings.stream_block_ms / 1000
    kwargs: dict[str, Any] = dict(
        decode_responses=True, socket_connect_timeout=timeout, socket_timeout=socket_timeout,
        max_connections=settings.max_redis_connections,
        retry=redis.asyncio.retry.Retry(_NO_BACKOFF, REDIS_RETRIES))
    if settings.stream_hub:
        # Requests only borrow a connection for a command or two: past the cap they queue for
        # one (bounded connections however many subscribers connect at once) rather than fail.
        # The wait is long: an event loop busy with 10,000 streams holds each connection for its
        # lag, and a stream whose state check gave up would end. (A down Redis still fails at
        # once, a hung one after the socket timeout: those waits end as connections free up.)
        pool = aioredis.BlockingConnectionPool.from_url(url, timeout=_POOL_WAIT_S, **kwargs)
        return aioredis.Redis(connection_pool=pool)
    return aioredis.Redis.from_url(url, **kwargs)


def _hub(client: aioredis.Redis, settings: ApiSettings, keys: Keys) -> StreamHub | None:
    if not settings.stream_hub:
        return None
    # Its own connections from the shard's pool: one subscribed to the step notifications, one
    # for its reads of the streams.
    reader = aioredis.Redis(connection_pool=client.connection_pool, single_connection_client=True)
    return StreamHub(reader, settings.stream_block_ms,
                     min_interval_ms=settings.stream_hub_interval_ms, keys=keys)


def key_policies(settings: ApiSettings) -> KeyPolicies:
    default = KeyPolicy(weight=settings.default_key_weight,
                        max_queued_jobs=settings.max_queued_jobs_per_key,
                        tokens_per_minute=settings.tokens_per_minute_per_key)
    return KeyPolicies.build(settings.api_keys, default, settings.key_weights,
                             settings.key_max_queued_jobs, settings.key_tokens_per_minute)


def get_context(request: Request) -> AppContext:
    return cast(AppContext, request.app.state.context)  # set at startup; Starlette's state is untyped
