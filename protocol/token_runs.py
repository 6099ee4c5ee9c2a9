"""Stream entries that carry several tokens (a *run*), and how readers take them apart.

A worker with a stream interval (`CARPOOL_STREAM_INTERVAL_MS`, worker/jobs/settings.py) sends a
job's tokens of several steps in one publish. Redis' cost goes by entries, not by tokens (an XADD
from Lua costs about the same for one token as for eight), so they go as one entry, encoded by
the worker (`run_fields`, through worker/jobs/stream_publisher) and written as it is by the
append scripts (worker/jobs/shard_scripts.XADD_TOKEN):

    kind=tokens, index=<first token's index>, token_ids="<id> <id> ...",
    text=<JSON list of the tokens' texts>, lp=<JSON list of their encoded logprobs> (when asked)

at the id of its LAST token, `0-(last index + 1)`, so Redis still refuses a duplicate or an
out-of-order append and the last id still tells how many tokens a stream holds. A publish with
one token for a job writes the one-token entry as before.

Readers expand a run into one token entry per token, each with the id it would have had alone
(`0-(index + 1)`): SSE event ids, `Last-Event-ID`, the hub's cursors and everything downstream
see one entry per token whatever the interval was. A run is written whole or not at all (a resent
round trip sends the same run, which Redis then refuses by its id), and expanding drops a token
already seen, so a reader that gets a run after some of its tokens skips those.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from protocol.messages import StreamEntry
from protocol.stream_ids import entry_id_key, token_entry_id

RUN = "tokens"  # the kind of a run entry

# One stream entry as XRANGE/XREAD return it on Carpool's (RESP2) connections: (entry id, fields).
# redis-py's own reply types also cover RESP3 and pipelined replies, which these calls never get.
RawEntry = tuple[Any, dict[Any, Any]]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def run_fields(first_index: int, token_ids: list[int], texts: list[str],
               logprobs: list[str] | None = None) -> dict[str, str]:
    """A run's fields, as the worker sends them to the append script, which writes them as they
    are; `logprobs`: each token's encoded TokenLogprobs, or None when the job asked for none."""
    fields = {"kind": RUN, "index": str(first_index),
              "token_ids": " ".join(str(token_id) for token_id in token_ids),
              "text": json.dumps(texts, ensure_ascii=False, separators=(",", ":"))}
    if logprobs is not None:
        fields["lp"] = json.dumps(logprobs, ensure_ascii=False, separators=(",", ":"))
    return fields


def run_entry_id(first_index: int, num_tokens: int) -> str:
    """A run's id: its last token's (`0-(last index + 1)`)."""
    return token_entry_id(first_index + num_tokens - 1)


def expand_runs(raw: Iterable[RawEntry], after: str | None = None) -> list[RawEntry]:
    """`raw` with each run replaced by its tokens' own entries (str ids, str fields); other
    entries pass as they are. A token at or before one already passed, or at or before the id
    `after` (what a read asked to start after: a run read from there may begin earlier), is
    dropped."""
    out: list[RawEntry] = []
    last = entry_id_key(after) if after is not None else None
    for entry_id, fields in raw:
        kind = fields.get("kind", fields.get(b"kind"))
        if kind is None or _text(kind) != RUN:
            out.append((entry_id, fields))
            last = entry_id_key(_text(entry_id))
            continue
        for token_id_, token_fields in _run_tokens(fields):
            key = entry_id_key(token_id_)
            if last is not None and key <= last:
                continue
            out.append((token_id_, token_fields))
            last = key
    return out


def _run_tokens(fields: dict[Any, Any]) -> list[tuple[str, dict[str, str]]]:
    f = {_text(k): _text(v) for k, v in fields.items()}
    first = int(f["index"])
    token_ids = f["token_ids"].split()
    texts = json.loads(f["text"])
    logprobs = json.loads(f["lp"]) if f.get("lp") else [""] * len(token_ids)
    if not len(token_ids) == len(texts) == len(logprobs):
        raise ValueError(f"a run entry at index {first} holds {len(token_ids)} token ids, "
                         f"{len(texts)} texts and {len(logprobs)} logprobs")
    tokens = []
    for offset, (token_id, text, lp) in enumerate(zip(token_ids, texts, logprobs)):
        index = first + offset
        entry = {"kind": StreamEntry.TOKEN, "index": str(index), "token_id": token_id,
                 "text": text}
        if lp:
            entry["lp"] = lp
        tokens.append((token_entry_id(index), entry))
    return tokens
