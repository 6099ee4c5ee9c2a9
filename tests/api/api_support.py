"""Builders for the API tests: the app on fakeredis (one in-process server, Lua via lupa), a
registered model with a small word-level tokenizer, and what a worker would have written."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import fakeredis
import httpx
from fastapi import FastAPI
from rq.job import Job
from rq.serializers import JSONSerializer
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from api.app import create_app
from api.context import AppContext
from api.settings import ApiSettings
from protocol import (
    FinishReason,
    JobState,
    JobStatus,
    Keys,
    ModelCard,
    StreamEntry,
    TokenLogprobs,
    WorkerStats,
    stream_ids,
)
from protocol.rq_keys import RQKeys
from protocol.token_runs import run_entry_id, run_fields

MODEL = "tiny"
CONTEXT = 32
VOCAB = 100  # the registered model's vocabulary size (token ids 0..99)
KEY_A = "key-a-secret"
KEY_B = "key-b-secret"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def word_tokenizer() -> Tokenizer:
    """One token per whitespace-separated word or punctuation mark: lengths are easy to reason on."""
    words = ["[UNK]", "<|im_start|>", "<|im_end|>", "hello", "world", "system", "user",
             "assistant", "the", "a"]
    tokenizer = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    return tokenizer


@dataclass(slots=True)
class Harness:
    app: FastAPI
    context: AppContext
    server: fakeredis.FakeServer
    sync: fakeredis.FakeRedis  # the test's own view of the same fake server
    keys: Keys

    def client(self, key: str | None = None) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        transport = httpx.ASGITransport(app=self.app, raise_app_exceptions=False)
        return httpx.AsyncClient(transport=transport, base_url="http://carpool.test",
                                 headers=headers, timeout=10)

    def register_model(self, name: str = MODEL, context: int = CONTEXT,
                       chat_template: str | None = CHAT_TEMPLATE, tokenizer: bool = True,
                       created_at: float = 1.0) -> ModelCard:
        card = ModelCard(name=name, max_model_len=context, eos_token="<|im_end|>",
                         bos_token="<|im_start|>", chat_template=chat_template,
                         created_at=created_at, vocab_size=VOCAB)
        self.sync.hset(self.keys.models(), name, card.to_json())
        if tokenizer:
            self.sync.set(self.keys.model_tokenizer(name), word_tokenizer().to_str())
        return card

    def add_worker(self, name: str = "w1", model: str = MODEL, **numbers: float) -> WorkerStats:
        stats = WorkerStats(name=name, model=model, mode="continuous", updated_at=time.time(),
                            **numbers)  # type: ignore[arg-type]
        self.sync.hset(self.keys.worker_stats(name), mapping=stats.to_fields())
        self.sync.expire(self.keys.worker_stats(name), 30)
        # Every worker registers with RQ under its name (worker/rq_presence.py).
        self.sync.sadd(RQKeys.workers_set(), RQKeys.worker(name))
        return stats

    def state(self, job_id: str) -> JobState:
        return JobState.from_fields(self.sync.hgetall(self.keys.state(job_id)))

    def publish_tokens(self, job_id: str, texts: list[str], start: int = 0) -> None:
        """Token entries as a worker appends them (explicit ids 0-(index+1))."""
        for offset, text in enumerate(texts):
            index = start + offset
            entry = StreamEntry(kind=StreamEntry.TOKEN, index=index, token_id=100 + index, text=text)
            self.sync.xadd(self.keys.stream(job_id), entry.to_fields(),
                           id=stream_ids.token_entry_id(index))
        if self.state(job_id).status is JobStatus.QUEUED:
            self.sync.hset(self.keys.state(job_id), mapping={"status": "running",
                                                              "started_at": time.time()})

    def publish_run(self, job_id: str, texts: list[str], start: int = 0) -> None:
        """The tokens as ONE entry, a run, as a worker with a stream interval appends them."""
        self.sync.xadd(self.keys.stream(job_id),
                       run_fields(start, [100 + start + i for i in range(len(texts))], texts),
                       id=run_entry_id(start, len(texts)))

    def publish_entries(self, job_id: str,
                        tokens: Sequence[tuple[int, str, TokenLogprobs | None]]) -> None:
        """Token entries of chosen ids, texts and logprobs, one a token, as a worker appends them."""
        for index, (token_id, text, logprobs) in enumerate(tokens):
            entry = StreamEntry(kind=StreamEntry.TOKEN, index=index, token_id=token_id, text=text,
                                logprobs=logprobs)
            self.sync.xadd(self.keys.stream(job_id), entry.to_fields(),
                           id=stream_ids.token_entry_id(index))

    def job_spec(self, job_id: str) -> dict[str, Any]:
        """The job's spec as the API queued it (the RQ job's argument), with its id."""
        spec: dict[str, Any] = Job.fetch(job_id, connection=self.context.sync,
                                         serializer=JSONSerializer).args[0]
        return {"job_id": job_id, **spec}

    async def serve_entries(self, tokens: Sequence[tuple[int, str, TokenLogprobs | None]],
                            reason: FinishReason = FinishReason.LENGTH,
                            prompt_tokens: int = 2) -> dict[str, Any]:
        """Play the worker for the next job: these token entries, then its end; the job's spec."""
        job_id = await self.take_job()
        self.publish_entries(job_id, tokens)
        self.publish_done(job_id, len(tokens), reason, prompt_tokens,
                          text="".join(text for _, text, _ in tokens))
        return self.job_spec(job_id)

    def publish_done(self, job_id: str, num_tokens: int, reason: FinishReason = FinishReason.STOP,
                     prompt_tokens: int = 3, error: str = "", text: str = "") -> None:
        """The final entry and the final JobState, as a worker writes them when a job ends."""
        entry = StreamEntry(kind=StreamEntry.DONE, finish_reason=reason, prompt_tokens=prompt_tokens,
                            completion_tokens=num_tokens, error=error)
        status = {FinishReason.ERROR: "failed", FinishReason.CANCELED: "canceled"}.get(
            reason, "finished")
        with self.sync.pipeline(transaction=True) as pipe:
            pipe.xadd(self.keys.stream(job_id), entry.to_fields(),
                      id=stream_ids.done_entry_id(num_tokens))
            pipe.hset(self.keys.state(job_id), mapping={
                "status": status, "finish_reason": reason.value, "error": error,
                "prompt_tokens": prompt_tokens, "completion_tokens": num_tokens, "text": text,
                "finished_at": time.time()})
            pipe.execute()

    def finish_job(self, job_id: str, texts: list[str], reason: FinishReason = FinishReason.STOP,
                   prompt_tokens: int = 3) -> None:
        self.publish_tokens(job_id, texts)
        self.publish_done(job_id, len(texts), reason, prompt_tokens, text="".join(texts))

    async def take_job(self, timeout_s: float = 5.0, model: str = MODEL) -> str:
        """Wait for the next job on any of `model`'s queues (highest priority first) and take it off, as a
        worker's dequeue would."""
        queues = [RQKeys.queue(name) for name in self.keys.queue_names(model)]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, queue in zip(self.keys.queue_names(model), queues):
                job_id = self.sync.lpop(queue)
                if job_id:
                    # Off its owner's list of the fair-share index too, as the claim takes it.
                    owner = self.sync.hget(self.keys.state(job_id), "owner") or ""
                    self.sync.lrem(self.keys.queue_owner_jobs(name, owner), 1, job_id)
                    return str(job_id)
            await asyncio.sleep(0.005)
        raise TimeoutError("no job arrived on any queue")

    async def serve_next_job(self, texts: list[str], reason: FinishReason = FinishReason.STOP,
                             prompt_tokens: int = 3, delay_s: float = 0.0) -> str:
        job_id = await self.take_job()
        for index, text in enumerate(texts):
            await asyncio.sleep(delay_s)
            self.publish_tokens(job_id, [text], start=index)
        self.publish_done(job_id, len(texts), reason, prompt_tokens, text="".join(texts))
        return job_id


# One app per distinct settings, reused across tests with a fresh context each: FastAPI builds a
# route's validators on its first request, which would otherwise cost every test ~0.1 s.
_APPS: dict[str, FastAPI] = {}


def make_harness(**settings: object) -> Harness:
    server = fakeredis.FakeServer()
    aio = fakeredis.FakeAsyncRedis(server=server, decode_responses=True)
    sync_for_app = fakeredis.FakeRedis(server=server)
    config = ApiSettings(**{"stream_block_ms": 20, "sse_keepalive_s": 0.05, **settings})
    context = AppContext.build(config, aio=aio, sync=sync_for_app)
    app = _APPS.get(config.model_dump_json())
    if app is None:
        app = _APPS[config.model_dump_json()] = create_app(config, context)
    app.state.context = context
    return Harness(app=app, context=context, server=server,
                   sync=fakeredis.FakeRedis(server=server, decode_responses=True),
                   keys=Keys(prefix=config.keys_prefix))


def parse_sse(text: str) -> list[dict[str, str]]:
    """Events of an SSE body as dicts (id, event, data); comment lines give {'comment': ...}."""
    events: list[dict[str, str]] = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        event: dict[str, str] = {}
        for line in block.split("\n"):
            if not line:
                continue  # a keep-alive's empty line (api.sse.SSE_KEEPALIVE)
            if line.startswith(":"):
                event["comment"] = line[1:].strip()
                continue
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            event[name] = event[name] + "\n" + value if name in event else value
        events.append(event)
    return events
