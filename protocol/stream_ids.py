"""Stream entry ids: the one place that knows how a job's token stream numbers its entries.

Token i of a job is entry `0-(i+1)` and the final entry follows the last token, so Redis itself
refuses a duplicate or out-of-order append. (The Lua scripts that append write the same ids.)
"""

from __future__ import annotations

import re

STREAM_START = "0-0"  # read "after the start": every entry
# ASCII digits only: \d would also take "１-２", which Python's int() reads and Redis refuses.
_ENTRY_ID = re.compile(r"([0-9]{1,20})-([0-9]{1,20})", re.ASCII)
_MAX_ID_PART = 2**64 - 1  # each half of a Redis stream id is an unsigned 64-bit integer


def token_entry_id(index: int) -> str:
    return f"0-{index + 1}"


def done_entry_id(num_tokens: int) -> str:
    return f"0-{num_tokens + 1}"


def entry_index(entry_id: str | bytes) -> int:
    """The position an entry id stands for: `0-(i+1)` is token i (the final entry follows)."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.split("-", 1)[1]) - 1


def is_entry_id(value: str) -> bool:
    """Whether Redis takes `value` as a stream id (XREAD refuses '0-99999999999999999999')."""
    match = _ENTRY_ID.fullmatch(value)
    return match is not None and all(int(part) <= _MAX_ID_PART for part in match.groups())


def entry_id_key(entry_id: str) -> tuple[int, int]:
    """An id as a sortable pair (Redis orders ids by milliseconds, then sequence)."""
    ms, seq = entry_id.split("-")
    return int(ms), int(seq)


def next_entry_id(entry_id: str) -> str:
    """The smallest id after `entry_id`."""
    ms, seq = entry_id_key(entry_id)
    return f"{ms}-{seq + 1}"
