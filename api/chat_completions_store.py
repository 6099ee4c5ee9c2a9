"""Stored chat completions (`store: true` on POST /v1/chat/completions, OpenAI's stored
completions): the completion as it was answered, its metadata and the request's messages, owned
by the API key that made it and kept for the server's result retention.

A record is one JSON string; the owner's index (a sorted set by creation time) lets listings
page them in either order and filter them by model and metadata.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from typing import Any, Literal

import redis.asyncio as aioredis

from api.errors import NotFoundError
from api.owner_pages import index_page
from protocol import Keys

# Completions a filtered listing reads at once (one MGET) once its first page's worth is read.
_SCAN_BATCH = 100


@dataclass(frozen=True, slots=True)
class StoredChatCompletion:
    owner: str
    completion: dict[str, Any]  # the chat.completion object as answered
    metadata: dict[str, str]
    messages: list[dict[str, Any]]  # the request's messages as the messages route lists them

    @property
    def id(self) -> str:
        return str(self.completion["id"])

    def as_object(self) -> dict[str, Any]:
        """The completion as retrieve, list and update answer it: with its metadata."""
        return {**self.completion, "metadata": self.metadata}

    def to_json(self) -> str:
        return json.dumps({"owner": self.owner, "completion": self.completion,
                           "metadata": self.metadata, "messages": self.messages},
                          ensure_ascii=False, separators=(",", ":"))


class ChatCompletionStore:
    def __init__(self, aio: aioredis.Redis, keys: Keys, retention_s: int) -> None:
        self._aio = aio
        self._keys = keys
        self.retention_s = retention_s

    async def keep(self, owner: str, completion: dict[str, Any], metadata: dict[str, str] | None,
                   messages: list[dict[str, Any]]) -> None:
        """Stores a chat completion as answered, with the request's messages (as sent)."""
        await self.save(StoredChatCompletion(owner, completion, metadata or {},
                                             stored_messages(str(completion["id"]), messages)))

    async def save(self, stored: StoredChatCompletion) -> None:
        async with self._aio.pipeline(transaction=True) as pipe:
            pipe.set(self._keys.chat_completion(stored.id), stored.to_json(), ex=self.retention_s)
            # Scored by the precise time: completions made within one second still list in order.
            pipe.zadd(self._keys.chat_completions_by_owner(stored.owner), {stored.id: time.time()})
            pipe.expire(self._keys.chat_completions_by_owner(stored.owner), self.retention_s)
            await pipe.execute()

    async def find(self, completion_id: str, owner: str) -> StoredChatCompletion | None:
        return _owned(await self._aio.get(self._keys.chat_completion(completion_id)), owner)

    async def get(self, completion_id: str, owner: str) -> StoredChatCompletion:
        """The owner's stored completion; 404 when missing, expired or another key's."""
        stored = await self.find(completion_id, owner)
        if stored is None:
            raise NotFoundError(
                f"No stored chat completion with id '{completion_id}' (completions are kept "
                f"{self.retention_s} s, and only when made with store: true)",
                param="completion_id", code="chat_completion_not_found")
        return stored

    async def set_metadata(self, stored: StoredChatCompletion,
                           metadata: dict[str, str]) -> StoredChatCompletion:
        """Replaces the metadata (the one part of a stored completion that changes); the
        record keeps its remaining retention."""
        updated = replace(stored, metadata=metadata)
        # XX: a completion deleted meanwhile stays deleted (and never loses its TTL).
        await self._aio.set(self._keys.chat_completion(stored.id), updated.to_json(), xx=True,
                            keepttl=True)
        return updated

    async def delete(self, stored: StoredChatCompletion) -> None:
        async with self._aio.pipeline(transaction=True) as pipe:
            pipe.delete(self._keys.chat_completion(stored.id))
            pipe.zrem(self._keys.chat_completions_by_owner(stored.owner), stored.id)
            await pipe.execute()

    async def page(self, owner: str, *, after: str | None, limit: int,
                   order: Literal["asc", "desc"], model: str | None,
                   metadata: dict[str, str]) -> tuple[list[StoredChatCompletion], bool]:
        """The owner's stored completions of `model` (any when None) whose metadata holds every
        pair of `metadata`, in `order` of creation after the completion `after`; and whether
        more follow."""
        def wanted(stored: StoredChatCompletion) -> bool:
            return ((model is None or stored.completion.get("model") == model)
                    and all(stored.metadata.get(k) == v for k, v in metadata.items()))

        async def load_many(completion_ids: list[str]) -> list[StoredChatCompletion | None]:
            # One MGET a batch: a filter that matches few completions scans many.
            payloads = await self._aio.mget([self._keys.chat_completion(completion_id)
                                             for completion_id in completion_ids])
            return [_owned(payload, owner) for payload in payloads]

        return await index_page(self._aio, self._keys.chat_completions_by_owner(owner), after,
                                limit, load_many, keep=wanted, order=order,
                                scan_batch=_SCAN_BATCH)


def _owned(payload: str | bytes | None, owner: str) -> StoredChatCompletion | None:
    """The record `payload` holds when it is `owner`'s; None when missing or another's."""
    record = json.loads(payload) if payload else None
    if record is None or record["owner"] != owner:
        return None
    return StoredChatCompletion(record["owner"], record["completion"], record["metadata"],
                                record["messages"])


def stored_messages(completion_id: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's messages (as sent: validated, not rewritten) as the messages route lists
    them: each with an id, its content as text and, when it came as a list of parts, the parts."""
    listed = []
    for index, message in enumerate(messages):
        content = message.get("content")
        parts = content if isinstance(content, list) else None
        listed.append({"id": f"{completion_id}-{index}", "role": message["role"],
                       "content": "".join(part["text"] for part in parts) if parts else content,
                       "name": message.get("name"), "content_parts": parts})
        for field in ("tool_calls", "tool_call_id"):
            if message.get(field) is not None:
                listed[-1][field] = message[field]
    return listed
