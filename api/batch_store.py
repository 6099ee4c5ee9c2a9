"""Batches in Redis: the batch object (a hash), its lines' jobs and answers (hashes by line index),
and the status transitions, each one conditional on the status it leaves (a Lua script), so a
cancel racing a runner, or two runners racing each other, can never move a batch backwards.

Statuses, as OpenAI's Batch API has them:
  validating -> in_progress -> finalizing -> completed
  validating -> failed (the input file does not fit the batch)
  validating | in_progress -> cancelling -> cancelled      (POST /v1/batches/{id}/cancel)
  validating | in_progress -> expired                      (its completion window passed)
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import redis.asyncio as aioredis

from api.errors import NotFoundError
from api.owner_pages import index_page, one_by_one
from protocol import Keys
from protocol.webhook_events import EMIT_EVENT_LUA


class BatchStatus(str, Enum):
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def is_final(self) -> bool:
        return self in (BatchStatus.FAILED, BatchStatus.COMPLETED, BatchStatus.EXPIRED,
                        BatchStatus.CANCELLED)

    @property
    def stamp(self) -> str:
        """The batch object's timestamp field this status sets (OpenAI's names)."""
        return {BatchStatus.IN_PROGRESS: "in_progress_at", BatchStatus.FINALIZING: "finalizing_at",
                BatchStatus.COMPLETED: "completed_at", BatchStatus.FAILED: "failed_at",
                BatchStatus.EXPIRED: "expired_at", BatchStatus.CANCELLING: "cancelling_at",
                BatchStatus.CANCELLED: "cancelled_at"}.get(self, "created_at")


_STAMPS = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
           "cancelling_at", "cancelled_at")
OUTPUT, ERROR = "o", "e"  # the file an answer goes to (the first character of its stored value)


@dataclass(slots=True)
class BatchRecord:
    id: str
    owner: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: BatchStatus
    created_at: int
    expires_at: int
    metadata: dict[str, str] | None = None
    stamps: dict[str, int] = field(default_factory=dict)  # the *_at fields set so far
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict[str, Any]] | None = None  # why validation failed
    total: int = 0  # requests in the input file (known once validated)
    completed: int = 0  # lines answered in the output file
    failed: int = 0  # lines answered in the error file
    submitted: int = 0  # lines queued (or answered at submission) so far, in file order
    webhook_url: str = ""  # where its final status is POSTed (webhooks/); "" for nowhere

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id, "object": "batch", "endpoint": self.endpoint,
            "errors": {"object": "list", "data": self.errors} if self.errors else None,
            "input_file_id": self.input_file_id, "completion_window": self.completion_window,
            "status": self.status.value, "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id, "created_at": self.created_at,
            "expires_at": self.expires_at,
            **{name: self.stamps.get(name) for name in _STAMPS},
            "request_counts": {"total": self.total, "completed": self.completed,
                               "failed": self.failed},
            "metadata": self.metadata,
        }

    @classmethod
    def from_fields(cls, fields: dict[str, str]) -> BatchRecord:
        return cls(
            id=fields["id"], owner=fields.get("owner", ""), endpoint=fields["endpoint"],
            input_file_id=fields["input_file_id"], completion_window=fields["completion_window"],
            status=BatchStatus(fields["status"]), created_at=int(fields["created_at"]),
            expires_at=int(fields["expires_at"]),
            metadata=json.loads(fields["metadata"]) if fields.get("metadata") else None,
            stamps={name: int(fields[name]) for name in _STAMPS if fields.get(name)},
            output_file_id=fields.get("output_file_id") or None,
            error_file_id=fields.get("error_file_id") or None,
            errors=json.loads(fields["errors"]) if fields.get("errors") else None,
            total=int(fields.get("total") or 0), completed=int(fields.get("completed") or 0),
            failed=int(fields.get("failed") or 0), submitted=int(fields.get("submitted") or 0),
            webhook_url=fields.get("webhook_url", ""))


@dataclass(frozen=True, slots=True)
class LineJobs:
    """The jobs one input line was queued as (its n choices, or its prompts times n)."""

    custom_id: str
    body: dict[str, Any]
    job_ids: list[str]
    prompt_tokens: list[int]  # the API's count per job (0: unknown)
    echoes: list[str]  # the text each choice starts with
    n: int
    parses_calls: bool = False  # a chat line whose tools are parsed from the reply
    # With return_token_ids: the token ids each job was queued with (the API decided them, so
    # they are what the model saw); kept only for such lines, whose answers show them.
    prompt_token_ids: list[list[int] | None] | None = None

    def to_json(self) -> str:
        data: dict[str, Any] = {
            "custom_id": self.custom_id, "body": self.body, "job_ids": self.job_ids,
            "prompt_tokens": self.prompt_tokens, "echoes": self.echoes, "n": self.n,
            "parses_calls": self.parses_calls}
        if self.prompt_token_ids is not None:
            data["prompt_token_ids"] = self.prompt_token_ids
        return json.dumps(data, ensure_ascii=False)

    @classmethod
    def from_json(cls, payload: str) -> LineJobs:
        data = json.loads(payload)
        return cls(custom_id=data["custom_id"], body=data["body"], job_ids=data["job_ids"],
                   prompt_tokens=data["prompt_tokens"], echoes=data["echoes"], n=data["n"],
                   parses_calls=bool(data.get("parses_calls")),
                   prompt_token_ids=data.get("prompt_token_ids"))


# KEYS: batch, webhook events. ARGV: number of allowed current statuses, the statuses, the
# webhook event to emit with the move ('' for none; else JSON [type, url, owner, data]), then
# field/value pairs.
# Returns 1 (moved), or the status the batch has (refused), or false (no such batch).
_TRANSITION = EMIT_EVENT_LUA + """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return false end
local n = tonumber(ARGV[1])
for i = 2, n + 1 do
  if ARGV[i] == status then
    for j = n + 3, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[j], ARGV[j + 1]) end
    if ARGV[n + 2] ~= '' then
      -- The batch's webhook event, in the same script as the status it reports: written once,
      -- by the one call that made the move.
      local event = cjson.decode(ARGV[n + 2])
      emit_event(KEYS[2], event[1], event[2], event[3], event[4])
    end
    return 1
  end
end
return status
"""

# KEYS: answers, batch. ARGV: line index, stored answer, count field (completed|failed).
# A line is answered once: a second answer (a concurrent or repeated runner) changes nothing.
_ANSWER = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
  return 1
end
return 0
"""


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


class BatchStore:
    def __init__(self, aio: aioredis.Redis, keys: Keys, retention_s: int) -> None:
        self._aio = aio
        self._keys = keys
        self.retention_s = retention_s
        self._transition = aio.register_script(_TRANSITION)
        self._answer = aio.register_script(_ANSWER)

    async def create(self, owner: str, endpoint: str, input_file_id: str, completion_window: str,
                     window_s: int, metadata: dict[str, str] | None,
                     webhook_url: str = "") -> BatchRecord:
        now = int(time.time())
        batch = BatchRecord(id=new_batch_id(), owner=owner, endpoint=endpoint,
                            input_file_id=input_file_id, completion_window=completion_window,
                            status=BatchStatus.VALIDATING, created_at=now,
                            expires_at=now + window_s, metadata=metadata,
                            webhook_url=webhook_url)
        fields: dict[Any, Any] = {"id": batch.id, "owner": owner, "endpoint": endpoint,
                  "input_file_id": input_file_id, "completion_window": completion_window,
                  "status": batch.status.value, "created_at": str(now),
                  "expires_at": str(batch.expires_at),
                  "metadata": json.dumps(metadata) if metadata is not None else "",
                  "webhook_url": webhook_url}
        async with self._aio.pipeline(transaction=True) as pipe:
            pipe.hset(self._keys.batch(batch.id), mapping=fields)
            # Scored by the precise time: batches made within one second still list in order.
            pipe.zadd(self._keys.batches_by_owner(owner), {batch.id: time.time()})
            pipe.sadd(self._keys.batches_open(), batch.id)
            await pipe.execute()
        return batch

    async def get(self, batch_id: str, owner: str | None = None) -> BatchRecord:
        """The batch; 404 when missing or (with `owner`) another key's."""
        fields = await self._aio.hgetall(self._keys.batch(batch_id))
        if not fields or (owner is not None and _text(fields.get("owner", "")) != owner):
            raise NotFoundError(f"No batch with id '{batch_id}'", param="batch_id",
                                code="batch_not_found")
        return BatchRecord.from_fields({_text(k): _text(v) for k, v in fields.items()})

    async def page(self, owner: str, limit: int, after: str | None) -> tuple[list[BatchRecord], bool]:
        """The owner's batches, newest first, after the batch id `after`; and whether more follow."""
        async def load(batch_id: str) -> BatchRecord | None:
            try:
                return await self.get(batch_id, owner)
            except NotFoundError:
                return None  # its retention ended

        return await index_page(self._aio, self._keys.batches_by_owner(owner), after, limit,
                                one_by_one(load))

    async def open_ids(self) -> list[str]:
        return sorted(str(i) for i in await self._aio.smembers(self._keys.batches_open()))

    async def transition(self, batch_id: str, allowed: tuple[BatchStatus, ...], to: BatchStatus,
                         event: tuple[str, str, str, dict[str, Any]] | None = None,
                         **fields: str | int) -> bool:
        """Move to `to` (stamping its *_at time and setting `fields`) only from `allowed`; with
        `event` (type, url, owner, data), its webhook event is written by the same script, so
        exactly one event goes with the one move."""
        pairs: list[str | int] = ["status", to.value, to.stamp, int(time.time())]
        for name, value in fields.items():
            pairs += [name, value]
        encoded = "" if event is None else json.dumps(
            [event[0], event[1], event[2], json.dumps(event[3], separators=(",", ":"))])
        moved = await self._transition(
            keys=[self._keys.batch(batch_id), self._keys.webhook_events()],
            args=[len(allowed), *(s.value for s in allowed), encoded, *pairs])
        return bool(moved == 1)

    async def close(self, batch_id: str) -> None:
        """After a final status: no runner looks at it again; it, its lines and answers expire
        (the answers live on in its files)."""
        async with self._aio.pipeline(transaction=True) as pipe:
            pipe.srem(self._keys.batches_open(), batch_id)
            pipe.expire(self._keys.batch(batch_id), self.retention_s)
            pipe.expire(self._keys.batch_lines(batch_id), 3600)
            pipe.expire(self._keys.batch_answers(batch_id), 3600)
            await pipe.execute()

    async def set_fields(self, batch_id: str, **fields: str | int) -> None:
        mapping: dict[Any, Any] = {name: str(value) for name, value in fields.items()}
        await self._aio.hset(self._keys.batch(batch_id), mapping=mapping)

    async def record_line(self, batch_id: str, index: int, line: LineJobs | None) -> None:
        """Line `index` was queued as `line` (None: it was answered at submission instead), and
        the submission cursor moves past it."""
        async with self._aio.pipeline(transaction=True) as pipe:
            if line is not None:
                pipe.hset(self._keys.batch_lines(batch_id), str(index), line.to_json())
            pipe.hset(self._keys.batch(batch_id), "submitted", index + 1)
            await pipe.execute()

    async def lines(self, batch_id: str) -> dict[int, LineJobs]:
        raw = await self._aio.hgetall(self._keys.batch_lines(batch_id))
        return {int(index): LineJobs.from_json(_text(payload)) for index, payload in raw.items()}

    async def lines_at(self, batch_id: str, indexes: list[int]) -> dict[int, LineJobs]:
        """The lines of `indexes` that were queued (a line answered at submission has none)."""
        raw = await self._aio.hmget(self._keys.batch_lines(batch_id), [str(i) for i in indexes])
        return {index: LineJobs.from_json(_text(payload))
                for index, payload in zip(indexes, raw) if payload is not None}

    async def answer(self, batch_id: str, index: int, kind: str, line: dict[str, Any]) -> bool:
        """Line `index`'s answer, for the output (OUTPUT) or error (ERROR) file; False when the
        line already had one (it keeps its first)."""
        stored = kind + json.dumps(line, ensure_ascii=False, separators=(",", ":"))
        count = "completed" if kind == OUTPUT else "failed"
        written = await self._answer(
            keys=[self._keys.batch_answers(batch_id), self._keys.batch(batch_id)],
            args=[index, stored, count])
        return bool(written)

    async def answered(self, batch_id: str) -> set[int]:
        return {int(i) for i in await self._aio.hkeys(self._keys.batch_answers(batch_id))}

    async def answers(self, batch_id: str) -> dict[int, tuple[str, str]]:
        """Line index -> (OUTPUT or ERROR, the file line)."""
        raw = await self._aio.hgetall(self._keys.batch_answers(batch_id))
        return {int(index): (_text(value)[0], _text(value)[1:]) for index, value in raw.items()}

    async def lock(self, batch_id: str, token: str, ttl_ms: int) -> bool:
        return bool(await self._aio.set(self._keys.batch_lock(batch_id), token, nx=True, px=ttl_ms))

    async def unlock(self, batch_id: str, token: str) -> None:
        key = self._keys.batch_lock(batch_id)
        if await self._aio.get(key) == token:  # (a lapsed lock another runner took stays theirs)
            await self._aio.delete(key)


def _text(value: Any) -> str:
    """A reply as text (the API's client decodes; a bytes reply would come from another)."""
    return value.decode() if isinstance(value, bytes) else str(value)
