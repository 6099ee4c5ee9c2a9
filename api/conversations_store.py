"""Conversations (OpenAI's Conversations API): a record and its items, owned by an API key.

A conversation is a hash (owner, created_at, metadata) and a list of items as JSON, oldest first,
in the shape its item routes answer with (api/responses_conversation.py `with_ids` and the
responses' output items). Both are kept for the server's result retention after their last
write, as stored responses are. Items are few enough (the chat a model reads) that a page is cut
from the whole list in the process.

A response naming a conversation adds its input and output items when it ends (`add_once`):
once per response, in one script, so two readers settling one background response do not add
them twice. A background response's turn is settled by whoever reads first: it, the
conversation's next response or its items' listing (the conversation's pending list).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, cast

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from api.errors import NotFoundError
from protocol import Keys

# KEYS: the conversation, its items, the response's once-marker. ARGV: retention_s, then items.
# Returns 1 (added), 0 (added before), -1 (the conversation is gone).
_ADD_ONCE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if not redis.call('SET', KEYS[3], '1', 'NX', 'EX', ARGV[1]) then return 0 end
-- In runs: unpack of a whole long input would pass Lua's C stack limit (about 8,000 values).
for i = 2, #ARGV, 1000 do redis.call('RPUSH', KEYS[2], unpack(ARGV, i, math.min(i + 999, #ARGV))) end
for i = 1, 2 do redis.call('EXPIRE', KEYS[i], ARGV[1]) end
return 1
"""


@dataclass(frozen=True, slots=True)
class Conversation:
    id: str
    owner: str
    created_at: int
    metadata: dict[str, str]

    def as_object(self) -> dict[str, Any]:
        """The conversation as the API answers it."""
        return {"id": self.id, "object": "conversation", "created_at": self.created_at,
                "metadata": self.metadata}


def _dumps(item: dict[str, Any]) -> str:
    return json.dumps(item, ensure_ascii=False, separators=(",", ":"))


class ConversationStore:
    def __init__(self, aio: aioredis.Redis, keys: Keys, retention_s: int) -> None:
        self._aio = aio
        self._keys = keys
        self.retention_s = retention_s
        self._add_once = aio.register_script(_ADD_ONCE)

    async def create(self, owner: str, metadata: dict[str, str],
                     items: list[dict[str, Any]]) -> Conversation:
        conversation = Conversation("conv_" + uuid.uuid4().hex, owner, int(time.time()), metadata)
        record, listed = self._keys.conversation(conversation.id), self._keys.conversation_items(
            conversation.id)
        async with self._writing(conversation.id) as pipe:
            pipe.hset(record, mapping={"owner": owner, "created_at": conversation.created_at,
                                       "metadata": json.dumps(metadata)})
            if items:
                pipe.rpush(listed, *[_dumps(item) for item in items])
        return conversation

    async def get(self, conversation_id: str, owner: str,
                  param: str = "conversation_id") -> Conversation:
        """The owner's conversation; 404 naming `param` when missing, expired or another key's."""
        fields = await self._aio.hgetall(self._keys.conversation(conversation_id))
        if not fields or fields["owner"] != owner:
            raise NotFoundError(f"No conversation with id '{conversation_id}' (conversations are "
                                f"kept {self.retention_s} s after their last change)",
                                param=param, code="conversation_not_found")
        return Conversation(conversation_id, owner, int(fields["created_at"]),
                            json.loads(fields["metadata"]))

    async def set_metadata(self, conversation: Conversation,
                           metadata: dict[str, str]) -> Conversation:
        async with self._writing(conversation.id) as pipe:
            pipe.hset(self._keys.conversation(conversation.id), "metadata", json.dumps(metadata))
        return Conversation(conversation.id, conversation.owner, conversation.created_at, metadata)

    async def delete(self, conversation: Conversation) -> None:
        await self._aio.delete(self._keys.conversation(conversation.id),
                               self._keys.conversation_items(conversation.id),
                               self._keys.conversation_pending(conversation.id))

    async def add_pending(self, conversation_id: str, response_id: str) -> None:
        """A background response taking a turn: its turn joins when it is settled."""
        pending = self._keys.conversation_pending(conversation_id)
        async with self._aio.pipeline(transaction=True) as pipe:
            pipe.rpush(pending, response_id)
            pipe.expire(pending, self.retention_s)
            await pipe.execute()

    async def pending(self, conversation_id: str) -> list[str]:
        """Its background responses not yet joined, in the order they were made."""
        listed = await self._aio.lrange(self._keys.conversation_pending(conversation_id), 0, -1)
        return cast(list[str], listed)

    async def drop_pending(self, conversation_id: str, response_id: str) -> None:
        await self._aio.lrem(self._keys.conversation_pending(conversation_id), 0, response_id)

    async def items(self, conversation: Conversation) -> list[dict[str, Any]]:
        """Every item, oldest first."""
        listed = await self._aio.lrange(self._keys.conversation_items(conversation.id), 0, -1)
        return [json.loads(item) for item in listed]

    async def item(self, conversation: Conversation, item_id: str) -> dict[str, Any]:
        """One item; 404 naming item_id when the conversation has none of that id."""
        for item in await self.items(conversation):
            if item.get("id") == item_id:
                return item
        raise self._no_item(conversation, item_id)

    async def add(self, conversation: Conversation, items: list[dict[str, Any]]) -> None:
        async with self._writing(conversation.id) as pipe:
            pipe.rpush(self._keys.conversation_items(conversation.id),
                       *[_dumps(item) for item in items])

    async def add_once(self, conversation_id: str, response_id: str,
                       items: list[dict[str, Any]]) -> bool:
        """Add a response's items unless they were added before or the conversation is gone
        (deleted meanwhile: nothing to add to); True when this call added them."""
        keys = [self._keys.conversation(conversation_id),
                self._keys.conversation_items(conversation_id),
                self._keys.conversation_response(response_id)]
        added = await self._add_once(keys=keys, args=[self.retention_s,
                                                      *[_dumps(item) for item in items]])
        return bool(added == 1)

    async def delete_item(self, conversation: Conversation, item_id: str) -> None:
        listed = self._keys.conversation_items(conversation.id)
        for encoded in cast(list[str], await self._aio.lrange(listed, 0, -1)):
            if json.loads(encoded).get("id") == item_id:
                async with self._writing(conversation.id) as pipe:
                    pipe.lrem(listed, 1, encoded)
                return
        raise self._no_item(conversation, item_id)

    @asynccontextmanager
    async def _writing(self, conversation_id: str) -> AsyncIterator[Pipeline]:
        """A transaction for a change to the conversation, sent with the renewal of its
        retention (the change's last write): one round trip."""
        async with self._aio.pipeline(transaction=True) as pipe:
            yield pipe
            pipe.expire(self._keys.conversation(conversation_id), self.retention_s)
            pipe.expire(self._keys.conversation_items(conversation_id), self.retention_s)
            await pipe.execute()

    @staticmethod
    def _no_item(conversation: Conversation, item_id: str) -> NotFoundError:
        return NotFoundError(f"Conversation '{conversation.id}' has no item with id '{item_id}'",
                             param="item_id", code="item_not_found")
