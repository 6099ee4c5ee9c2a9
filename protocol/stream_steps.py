"""Step notifications: what token streams got, one Pub/Sub message per worker step on the channel
`Keys.stream_steps`, published by the same script or transaction that wrote the streams.

A stream hub (api/stream_hub.py) subscribes to this one channel instead of blocking on every stream
it follows (Redis paid for each of those at every read: registering and unregistering them as
blocked keys, then re-running the read over all of them, whichever had changed). [redis-cost] It
was a stream the hub blocked on with XREAD: a request from every hub at every step, half the
requests Redis served (README, "Requests a job sends"); a message costs Redis a write to each
subscriber in the publisher's own turn. A message is one letter, then its value:

- `e`: the tokens themselves, as `encode_tokens` writes them: a JSON list [stream key, [index,
  token_id, text, logprobs ('' for none), ...], stream key, ...]. The worker encodes its step's
  tokens and the append script (worker/jobs/shard_scripts.XADD_TOKEN) adds them as they are, after
  its fence checks and XADDs, and only when every one of them was written; the hub hands them out
  without reading the streams (reading them cost Redis about as much as writing them).
- `f`: one final entry itself, as a JSON list [stream key, entry id, field, value, ...]: from the
  finish script, which decides the entry's fields (a cancel turns a finish into `canceled`) and
  writes them in the same turn. [redis-cost] The hub hands it out as it does an `e`'s tokens: a
  job's end costs the hub no read (with a `k` it cost one XREAD a job, about a ninth of the
  requests a 50-token job sent Redis).
- `k`: stream keys to read (space-separated): from the append script when it did not write every
  token it got (a refused job, a resent round trip), and from `notify_steps` for the final entries
  other writers add (a shard's, a queued job's cancel), after them in the same transaction.

Live tokens ([redis-cost], `CARPOOL_DURABLE_INTERVAL_MS`, worker/jobs/settings.py): a worker may
write a job's tokens into its stream only every so often (one entry for several tokens: Redis'
cost goes by entries) while its `e` notifications still carry every step's tokens, so subscribers
get each token at its step. Such an `e` may carry tokens its stream does not hold yet; they follow
within the live window (`LIVE_WINDOW_MS`): the append script refuses to notify a job's tokens once
its stream was last complete longer ago than that, and the worker writes the stream first. The
same notification goes to the worker's live journal (`Keys.live_journal`), from which recovery
writes a dead worker's live tokens into their streams before its jobs go back to a queue, so what
a subscriber got live is what the stream says, crash or not. A job streaming to a stream shard
works the same way on its shard (the worker's live fence and journal there); the main Redis'
recovery cannot reach a shard, so the next claim's adoption of the stream writes them in
(worker/jobs/shard_scripts.py).

The streams stay the truth: a hub that finds a gap between what it delivered and an `e` message
reads the stream, and its full read of every watched stream each block interval makes up for a
notification it never saw (published before it subscribed, or a writer that sends none). A hub
whose subscription lost its connection fails its subscribers, who resume after their last event.
A reader that catches up from the stream to where the hub is waits for the stream to get there
(api/job_stream.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from redis import Redis
from redis.asyncio.client import Pipeline as AsyncPipeline
from redis.client import Pipeline

from protocol.keys import Keys
from protocol.messages import StreamEntry
from protocol.stream_ids import token_entry_id
from protocol.token_runs import RawEntry

# The longest a job's live tokens may run ahead of its stream (from the last time its stream held
# every token notified, by Redis' clock), and so the history a worker's live journal keeps (twice
# this). A protocol constant, not a setting: recovery, run by any worker, reads the journals that
# every worker writes under it.
LIVE_WINDOW_MS = 5_000
# How long a worker's live journal outlives its last write: recovery must still find it after a
# whole fleet was down (a single worker restarting takes minutes). It holds 2 * LIVE_WINDOW_MS of
# steps at most; a worker that stops cleanly deletes its own.
LIVE_JOURNAL_TTL_MS = 24 * 3600 * 1000
_STREAMS_FIELD = "k"
_TOKENS_FIELD = "e"
_FINAL_FIELD = "f"


def notify_steps(pipe: Redis | Pipeline | AsyncPipeline, keys: Keys, job_ids: Iterable[str]) -> None:
    """The notification for `job_ids` (nothing for none), on `pipe` after the streams' writes
    (or on a client, once they are done), to the Redis that holds those streams."""
    listed = " ".join(dict.fromkeys(keys.stream(job_id) for job_id in job_ids))
    if listed:
        pipe.publish(keys.stream_steps(), _STREAMS_FIELD + listed)


def note_fields(payload: bytes | str) -> dict[object, object]:
    """One notification's message (the field's letter, then its value) as the fields
    `notified_streams` and `notified_tokens` read."""
    text = payload.decode() if isinstance(payload, bytes) else payload
    return ({text[:1]: text[1:]} if text[:1] in (_STREAMS_FIELD, _TOKENS_FIELD, _FINAL_FIELD)
            else {})


def encode_tokens(runs: list[tuple[str, list[str]]]) -> str:
    """A step's tokens for `e` (the append script publishes 'e' and then this): per stream key,
    its new tokens' (index, token_id, text, logprobs) flat, as strings (those the append script
    takes); '' when there are none."""
    if not runs:
        return ""
    return json.dumps([part for stream, values in runs for part in (stream, values)],
                      ensure_ascii=False, separators=(",", ":"))


def _field(fields: dict[object, object], name: str) -> str:
    raw = fields.get(name, fields.get(name.encode(), ""))
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def notified_streams(fields: dict[object, object]) -> list[str]:
    """The stream keys one notification names to read (`k`)."""
    return _field(fields, _STREAMS_FIELD).split()


def notified_final(fields: dict[object, object]) -> tuple[str, RawEntry] | None:
    """The final entry one notification carries (`f`): its stream key and the entry as XREAD
    returns it (id and fields, strings); None for a notification of another kind."""
    raw = _field(fields, _FINAL_FIELD)
    if not raw:
        return None
    stream, entry_id, *flat = json.loads(raw)
    return stream, (entry_id, dict(zip(flat[::2], flat[1::2])))


def notified_tokens(fields: dict[object, object]) -> list[tuple[str, list[RawEntry]]]:
    """The token entries one notification carries (`e`), per stream key, as XREAD returns them
    (ids and fields, strings)."""
    raw = _field(fields, _TOKENS_FIELD)
    if not raw:
        return []
    notes = json.loads(raw)
    runs = []
    for stream, values in zip(notes[::2], notes[1::2]):
        entries: list[RawEntry] = []
        for a in range(0, len(values), 4):
            index, token_id, text, logprobs = values[a:a + 4]
            entry = {"kind": StreamEntry.TOKEN, "index": str(index), "token_id": str(token_id),
                     "text": text}
            if logprobs:
                entry["lp"] = logprobs
            entries.append((token_entry_id(int(index)), entry))
        runs.append((stream, entries))
    return runs
