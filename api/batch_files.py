"""Files of the Batch API: a batch input file's JSONL checked line by line, and the file store
(Redis hashes with a retention TTL, one per file, listed per owner).

An input line is `{"custom_id": str, "method": "POST", "url": <endpoint>, "body": {...}}`, as
OpenAI's Batch API takes it; the body itself is checked when its line is submitted (a bad body
is that line's answer in the error file, not a refused upload).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from api.errors import InvalidRequestError, NotFoundError
from api.owner_pages import index_page, one_by_one
from protocol import Keys

BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
# Purposes a client may upload with; batch_output is the purpose of the files batches write.
UPLOAD_PURPOSES = ("batch",)
OUTPUT_PURPOSE = "batch_output"


@dataclass(frozen=True, slots=True)
class BatchInputLine:
    index: int  # 0-based, among the file's requests (blank lines are not requests)
    line_number: int  # 1-based line of the file, for messages
    custom_id: str
    url: str
    body: dict[str, Any]


def parse_batch_input(content: bytes, max_lines: int) -> list[BatchInputLine]:
    """The requests of a batch input file; 400 naming the first bad line and what to fix."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        line_number = content[:exc.start].count(b"\n") + 1
        raise InvalidRequestError(f"Line {line_number} is not UTF-8 (byte 0x{content[exc.start]:02x}"
                                  f"); encode the file as UTF-8", param="file") from exc
    lines: list[BatchInputLine] = []
    seen: dict[str, int] = {}
    for line_number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        if len(lines) == max_lines:
            raise InvalidRequestError(f"The file holds more than {max_lines} requests (the limit "
                                      f"per batch, CARPOOL_MAX_BATCH_LINES); split it",
                                      param="file")
        line = _parse_line(raw, line_number, len(lines))
        if line.custom_id in seen:
            raise InvalidRequestError(
                f"Line {line_number}: custom_id '{line.custom_id}' is used on line "
                f"{seen[line.custom_id]} too; every request needs its own custom_id", param="file")
        seen[line.custom_id] = line_number
        lines.append(line)
    if not lines:
        raise InvalidRequestError("The file holds no requests: write one JSON object per line",
                                  param="file")
    return lines


def _parse_line(raw: str, line_number: int, index: int) -> BatchInputLine:
    def bad(what: str) -> InvalidRequestError:
        return InvalidRequestError(f"Line {line_number}: {what}", param="file")

    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise bad(f"not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise bad(f"must be a JSON object, got {type(data).__name__}")
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise bad("'custom_id' must be a non-empty string")
    if data.get("method") != "POST":
        raise bad(f"'method' must be \"POST\" (got {json.dumps(data.get('method'))})")
    url = data.get("url")
    if url not in BATCH_ENDPOINTS:
        raise bad(f"'url' must be one of {', '.join(BATCH_ENDPOINTS)} (got {json.dumps(url)})")
    body = data.get("body")
    if not isinstance(body, dict):
        raise bad("'body' must be a JSON object (the request's body)")
    unknown = sorted(set(data) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise bad(f"unknown field '{unknown[0]}' (a line holds custom_id, method, url and body)")
    return BatchInputLine(index, line_number, custom_id, str(url), body)


@dataclass(frozen=True, slots=True)
class FileObject:
    id: str
    bytes: int
    created_at: int
    expires_at: int
    filename: str
    purpose: str
    owner: str = ""

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "expires_at": self.expires_at, "filename": self.filename, "purpose": self.purpose,
                "status": "processed", "status_details": None}

    def to_fields(self) -> dict[str, str]:
        return {"id": self.id, "bytes": str(self.bytes), "created_at": str(self.created_at),
                "expires_at": str(self.expires_at), "filename": self.filename,
                "purpose": self.purpose, "owner": self.owner}

    @classmethod
    def from_fields(cls, fields: dict[str, str]) -> FileObject:
        return cls(id=fields["id"], bytes=int(fields["bytes"]), created_at=int(fields["created_at"]),
                   expires_at=int(fields["expires_at"]), filename=fields["filename"],
                   purpose=fields["purpose"], owner=fields.get("owner", ""))


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


class FileStore:
    """Files in Redis (`aio` decodes replies: file contents are UTF-8 JSONL text)."""

    def __init__(self, aio: aioredis.Redis, keys: Keys, retention_s: int) -> None:
        self._aio = aio
        self._keys = keys
        self.retention_s = retention_s

    async def create(self, owner: str, filename: str, purpose: str, content: str,
                     file_id: str | None = None) -> FileObject:
        """Store a file; with `file_id` (a batch's output), writing it again changes nothing."""
        now = int(time.time())
        file = FileObject(id=file_id or new_file_id(), bytes=len(content.encode()),
                          created_at=now, expires_at=now + self.retention_s, filename=filename,
                          purpose=purpose, owner=owner)
        key = self._keys.file(file.id)
        if file_id is not None and await self._aio.exists(key):
            return await self.get(file_id, owner)
        async with self._aio.pipeline(transaction=True) as pipe:
            fields: dict[Any, Any] = {**file.to_fields(), "content": content}  # (redis' key type)
            pipe.hset(key, mapping=fields)
            pipe.expire(key, self.retention_s)
            # Scored by the precise time: files made within one second still list in order.
            pipe.zadd(self._keys.files_by_owner(owner), {file.id: time.time()})
            await pipe.execute()
        return file

    async def get(self, file_id: str, owner: str) -> FileObject:
        fields = await self._aio.hmget(self._keys.file(file_id),
                                       ["id", "bytes", "created_at", "expires_at", "filename",
                                        "purpose", "owner"])
        file = _file_of(fields)
        if file is None or file.owner != owner:  # another key's files read as missing
            raise NotFoundError(f"No file with id '{file_id}'", param="file_id", code="file_not_found")
        return file

    async def content(self, file_id: str, owner: str) -> str:
        await self.get(file_id, owner)
        content = await self._aio.hget(self._keys.file(file_id), "content")
        if content is None:
            raise NotFoundError(f"No file with id '{file_id}'", param="file_id", code="file_not_found")
        return str(content)

    async def page(self, owner: str, purpose: str | None, limit: int,
                   after: str | None) -> tuple[list[FileObject], bool]:
        """The owner's files (of `purpose`), newest first, after the file id `after`; and
        whether more follow."""
        async def load(file_id: str) -> FileObject | None:
            try:
                return await self.get(file_id, owner)
            except NotFoundError:
                return None  # expired

        return await index_page(self._aio, self._keys.files_by_owner(owner), after, limit,
                                one_by_one(load),
                                keep=lambda file: purpose is None or file.purpose == purpose)

    async def delete(self, file_id: str, owner: str) -> None:
        await self.get(file_id, owner)
        async with self._aio.pipeline(transaction=True) as pipe:
            pipe.delete(self._keys.file(file_id))
            pipe.zrem(self._keys.files_by_owner(owner), file_id)
            await pipe.execute()


def _file_of(fields: list[Any]) -> FileObject | None:
    if fields[0] is None:
        return None
    names = ("id", "bytes", "created_at", "expires_at", "filename", "purpose", "owner")
    return FileObject.from_fields({name: str(value or "") for name, value in zip(names, fields)})
