"""Reading a job back: its JobState, its token stream and its result (used by api and worker).

Sync redis-py. The parsing helpers (`parse_entries`, `entry_index`) take what XRANGE/XREAD
return, so an asyncio client can reuse them on its own replies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from redis import Redis

from protocol.generation import PromptLogprobs
from protocol.keys import Keys
from protocol.messages import JobResult, JobState, StreamEntry
from protocol.stream_ids import STREAM_START, entry_index
from protocol.token_runs import RawEntry, expand_runs

# The state hash field the worker sets with the first token (worker/jobs/job_scripts.APPEND).
PROMPT_LOGPROBS_FIELD = "prompt_logprobs"

XReadReply = list[tuple[Any, list[RawEntry]]]  # [(stream key, entries)] per stream read


@dataclass(frozen=True, slots=True)
class StreamRead:
    """Entries read from a job's stream, with the id to resume after (`last_id`)."""

    entries: list[StreamEntry]
    last_id: str

    @property
    def is_done(self) -> bool:
        return bool(self.entries) and self.entries[-1].kind == StreamEntry.DONE

    @property
    def tokens(self) -> list[StreamEntry]:
        return [entry for entry in self.entries if entry.kind == StreamEntry.TOKEN]

    @property
    def done(self) -> StreamEntry | None:
        return self.entries[-1] if self.is_done else None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def count_tokens(last: Sequence[RawEntry]) -> int:
    """How many tokens a stream holds, from its last entry as `XREVRANGE key + - COUNT 1` gives
    it: a token's or a run's id is its last token's (`0-(index+1)`), the final entry's one past."""
    if not last:
        return 0
    entry_id, fields = last[0]
    kind = fields.get(b"kind", fields.get("kind"))
    is_done = kind is not None and _text(kind) == StreamEntry.DONE
    return entry_index(_text(entry_id)) + (0 if is_done else 1)


def parse_entries(raw: Sequence[RawEntry], last_id: str = STREAM_START) -> StreamRead:
    """Turn XRANGE's reply (or one stream's part of XREAD's) after entry id `last_id` into
    StreamEntry objects, one per token (runs expanded: protocol.token_runs)."""
    expanded = expand_runs(raw, after=last_id)
    entries = [StreamEntry.from_fields(fields) for _, fields in expanded]
    return StreamRead(entries, _text(expanded[-1][0]) if expanded else last_id)


class JobReader:
    """Read-only view of jobs in Redis, by job id."""

    def __init__(self, redis: Redis, keys: Keys = Keys()) -> None:
        self.redis = redis
        self.keys = keys

    def state(self, job_id: str) -> JobState | None:
        """The JobState hash, or None for an unknown (or expired) job."""
        fields = self.redis.hgetall(self.keys.state(job_id))
        return JobState.from_fields(fields) if fields else None

    def prompt_logprobs(self, job_id: str) -> PromptLogprobs | None:
        """The prompt logprobs a job asked for, once its first token is out; else None. A field
        of the state hash, read alone: it is as long as the prompt, and only such jobs have it."""
        payload = self.redis.hget(self.keys.state(job_id), PROMPT_LOGPROBS_FIELD)
        return PromptLogprobs.decode(_text(payload)) if payload else None

    def result(self, job_id: str) -> JobResult | None:
        """The final result once the job has ended (finished, failed or canceled), else None."""
        state = self.state(job_id)
        if state is None or not state.status.is_final:
            return None
        return state.result()

    def read(self, job_id: str, after: str = STREAM_START, count: int | None = None,
             block_ms: int | None = None) -> StreamRead:
        """Entries after entry id `after` ("0-0": from the start). With `block_ms`, waits up to
        that long for new entries (XREAD BLOCK) when none are there yet."""
        key = self.keys.stream(job_id)
        if block_ms is None:
            start = "-" if after == "0-0" else f"({after}"
            return parse_entries(cast("list[RawEntry]", self.redis.xrange(key, start, "+", count=count)),
                                 after)
        reply = cast(XReadReply, self.redis.xread({key: after}, count=count, block=block_ms))
        raw = reply[0][1] if reply else []
        return parse_entries(raw, after)

    def tokens(self, job_id: str) -> list[StreamEntry]:
        """Every token entry published so far, in index order."""
        return self.read(job_id).tokens

    def num_tokens(self, job_id: str) -> int:
        """How many tokens the stream holds, from its last entry's id (one entry may hold several
        tokens: protocol/token_runs.py; the final entry's id is one past the last token's)."""
        return count_tokens(cast("list[RawEntry]",
                                 self.redis.xrevrange(self.keys.stream(job_id), count=1)))

    def token_ids(self, job_id: str) -> list[int]:
        return [entry.token_id for entry in self.tokens(job_id)]
