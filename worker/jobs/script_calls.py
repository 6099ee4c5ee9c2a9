"""What a worker's round trips are made of: Lua script calls queued for one MULTI/EXEC (to the
main Redis or a stream shard), the tokens as the scripts take them, and the rerun of the calls a
restarted Redis no longer had the scripts for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from redis import Redis
from redis.exceptions import NoScriptError
from redis.typing import EncodableT

from protocol.generation import TokenEntry
from protocol.redis_errors import REDIS_REFUSES_WRITES
from worker.jobs.job_scripts import JobScripts


@dataclass(frozen=True, slots=True)
class EndMarker:
    """A sharded job's final stream entry, written to its shard after its end on the main Redis."""

    shard: int
    job_id: str
    token: str
    ttl_s: int
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    error: str
    cached_tokens: int = 0


@dataclass(slots=True)
class ScriptCall:
    kind: str  # append | finish | requeue | recover | end
    job_id: str
    name: str
    keys: list[str]
    args: list[EncodableT]
    end: EndMarker | None = None  # finish of a sharded job: its final entry, reason as asked


def token_args(tokens: list[TokenEntry]) -> list[str]:
    """Each token's (index, token_id, text, logprobs or ''), flat: a notification's part."""
    args: list[str] = []
    for token in tokens:
        logprobs = token.logprobs.encode() if token.logprobs is not None else ""
        args += [str(token.index), str(token.token_id), token.text, logprobs]
    return args


def raise_refused_writes(replies: list[Any]) -> None:
    """A script that Redis stopped at its first write, refusing writes for now (at its maxmemory,
    or unable to save to disk: protocol/redis_errors.py), is no bug of the script's: the error is
    raised, and the flush waited out and sent again whole, as when Redis is out of reach. (Every
    write of a transaction is refused alike, so nothing of it was written.)"""
    for reply in replies:
        if isinstance(reply, REDIS_REFUSES_WRITES):
            raise reply


def retry_missing_scripts(scripts: JobScripts, client: Redis, calls: list[ScriptCall],
                          replies: list[Any]) -> list[Any]:
    """After a Redis restart or SCRIPT FLUSH no script ran: load them and rerun just those."""
    missing = [i for i, reply in enumerate(replies[:len(calls)])
               if isinstance(reply, NoScriptError)]
    if not missing:
        return replies
    scripts.load(client)
    pipe = client.pipeline(transaction=True)
    for i in missing:
        scripts.call(pipe, calls[i].name, calls[i].keys, calls[i].args)
    for i, reply in zip(missing, pipe.execute(raise_on_error=False)):
        replies[i] = reply
    return replies
