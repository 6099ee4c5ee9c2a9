"""Stored Responses API responses (`store: true`, OpenAI's default): one JSON string per response,
kept for the server's result retention, read back by its owner only.

A record holds the response object as answered, the input items as input_items lists them, and
the chat a continuation starts from (the chat this response continued, its input and its output
as messages; never the instructions, which OpenAI does not carry over).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from api.errors import NotFoundError
from protocol import Keys


@dataclass(frozen=True, slots=True)
class StoredResponse:
    owner: str
    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    # The chat a response naming this one continues; while `job_id` is set, the chat before
    # its output (api/responses_background.py adds the output once the job ends).
    conversation: list[dict[str, Any]]
    # A background response whose job has not been settled yet: the job; and for any background
    # response the request (as sent) its answer and its events are built from.
    job_id: str | None = None
    request: dict[str, Any] | None = None

    @property
    def is_pending(self) -> bool:
        return self.job_id is not None

    def to_json(self) -> str:
        record: dict[str, Any] = {"owner": self.owner, "response": self.response,
                                  "input_items": self.input_items,
                                  "conversation": self.conversation}
        if self.job_id is not None:
            record["job_id"] = self.job_id
        if self.request is not None:
            record["request"] = self.request
        return json.dumps(record, ensure_ascii=False, separators=(",", ":"))


class ResponseStore:
    def __init__(self, aio: aioredis.Redis, keys: Keys, retention_s: int) -> None:
        self._aio = aio
        self._keys = keys
        self.retention_s = retention_s

    async def save(self, stored: StoredResponse) -> None:
        await self._aio.set(self._keys.response(stored.response["id"]), stored.to_json(),
                            ex=self.retention_s)

    async def get(self, response_id: str, owner: str, param: str = "response_id") -> StoredResponse:
        """The owner's stored response; 404 naming `param` when missing, expired or another key's."""
        payload = await self._aio.get(self._keys.response(response_id))
        record = json.loads(payload) if payload else None
        if record is None or record["owner"] != owner:
            raise NotFoundError(f"No response with id '{response_id}' (responses are kept "
                                f"{self.retention_s} s, and only when made with store: true)",
                                param=param, code="response_not_found")
        return StoredResponse(record["owner"], record["response"], record["input_items"],
                              record["conversation"], record.get("job_id"), record.get("request"))

    async def delete(self, response_id: str, owner: str) -> None:
        await self.get(response_id, owner)  # 404 for another key's, as for a missing one
        await self._aio.delete(self._keys.response(response_id))
