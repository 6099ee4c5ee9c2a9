"""Step notifications: which token streams changed, one entry per worker step (`Keys.stream_steps`).

A writer adds, after a step's stream entries and in the same transaction, one entry listing the
job ids whose streams it wrote to; a stream hub (api/stream_hub.py) blocks on this one key and then
reads only those streams. Without it the hub blocked on every stream it follows, and Redis paid for
each of them at every read (registering and unregistering the blocked keys, then re-running the
read over all of them), whichever had changed. A notification is a hint, never the data: the
streams stay the truth, so a spurious one (an append the fence refused) costs one empty read, and
a lost one is made up by the hub's periodic full read.
"""

from __future__ import annotations

from collections.abc import Iterable

from redis import Redis
from redis.asyncio.client import Pipeline as AsyncPipeline
from redis.client import Pipeline

from protocol.keys import Keys

# About this many steps are kept: at 100 worker steps/s, over a minute and a half, far more than
# a hub falls behind before its periodic full read catches it up anyway.
STREAM_STEPS_MAXLEN = 10_000
_FIELD = "j"


def notify_steps(pipe: Redis | Pipeline | AsyncPipeline, keys: Keys, job_ids: Iterable[str]) -> None:
    """The notification for `job_ids` (nothing for none), on `pipe` after the streams' writes
    (or on a client, once they are done), to the Redis that holds those streams."""
    listed = " ".join(dict.fromkeys(job_ids))
    if listed:
        pipe.xadd(keys.stream_steps(), {_FIELD: listed}, maxlen=STREAM_STEPS_MAXLEN,
                  approximate=True)


def notified_job_ids(fields: dict[object, object]) -> list[str]:
    """The job ids one notification entry lists."""
    raw = fields.get(_FIELD, fields.get(_FIELD.encode(), ""))
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return text.split()
