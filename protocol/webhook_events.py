"""Webhook events: what is delivered, and the one way to emit one (`emit_event`, or the Lua
function `EMIT_JOB_EVENT_LUA` inside the scripts that end a job).

An event is a stream entry of `Keys.webhook_events`, written atomically with the change it
reports (the same Lua script or MULTI/EXEC), so a job never ends without its event and never
emits it twice: only the script that moves the job to a final status writes one, and each of
those refuses a job that is already final. The dispatcher (`webhooks` package) reads them with
a consumer group and POSTs `{"type", "timestamp", "data"}` signed per Standard Webhooks.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from enum import Enum
from typing import Any

from redis import Redis
from redis.client import Pipeline

from protocol.keys import Keys
from protocol.timestamps import rfc3339_utc

# How long an event waits for a dispatcher: each write trims (MINID ~, whole stream nodes) what is
# older. A failed job's records are kept as long (protocol.job_submission.DEFAULT_FAILURE_TTL,
# not imported: that module imports this one), so no event outlives the job it reports by much,
# and a Redis that no dispatcher reads keeps a week of events, not every event ever. The
# dispatcher forgets a pending event trimmed meanwhile (an empty entry).
EVENT_RETENTION_MS = 7 * 24 * 3600 * 1000


class WebhookEventType(str, Enum):
    JOB_COMPLETED = "job.completed"  # finished: stop or length
    JOB_FAILED = "job.failed"
    JOB_CANCELED = "job.canceled"
    JOB_EXPIRED = "job.expired"  # its deadline or queue timeout passed (finish reason expired)
    # A batch's final status, named as OpenAI's own webhooks name them; data: the batch object.
    BATCH_COMPLETED = "batch.completed"
    BATCH_FAILED = "batch.failed"
    BATCH_EXPIRED = "batch.expired"
    BATCH_CANCELLED = "batch.cancelled"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass(frozen=True, slots=True)
class WebhookEvent:
    """One event as the stream holds it. `data` is the JSON object text; `at` seconds since the
    epoch (when the change happened); `owner` the API key id whose job it is, for listing its
    dead letters."""

    event_id: str  # the stream entry id; the delivery's webhook-id is derived from it
    type: str
    url: str
    at: float
    data: str
    owner: str = ""

    @property
    def webhook_id(self) -> str:
        """Standard Webhooks' webhook-id: the same for every attempt of one event."""
        return f"msg_{self.event_id}"

    def body(self) -> bytes:
        """The POSTed payload, byte-identical across attempts (the signature covers it)."""
        payload = {"type": self.type,
                   "timestamp": rfc3339_utc(self.at),
                   "data": json.loads(self.data)}
        return json.dumps(payload, separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def from_entry(cls, event_id: Any, fields: dict[Any, Any]) -> WebhookEvent:
        f = {_text(k): _text(v) for k, v in fields.items()}
        return cls(event_id=_text(event_id), type=f.get("type", ""), url=f.get("url", ""),
                   at=float(f.get("at") or 0.0), data=f.get("data") or "{}",
                   owner=f.get("owner", ""))


def emit_event(target: Redis | Pipeline, type: str, data: dict[str, Any], url: str,
               owner: str = "", keys: Keys = Keys()) -> None:
    """Queue one event for delivery to `url` (nothing when `url` is ""). Pass the pipeline
    (MULTI/EXEC) that makes the change the event reports, so both land or neither.
    `type` e.g. "batch.completed"; `data` a JSON-ready object (its "id" names the subject)."""
    if not url:
        return
    now = time.time()
    target.xadd(keys.webhook_events(), {
        "type": type, "url": url, "at": repr(now), "owner": owner,
        "data": json.dumps(data, separators=(",", ":"))},
        minid=int(now * 1000) - EVENT_RETENTION_MS, approximate=True)


# Lua: one event onto `events` (Keys.webhook_events()), the entry `emit_event` writes and
# WebhookEvent.from_entry reads, stamped with Redis' own clock; for scripts that make the change
# an event reports, so both land or neither. `data`: the JSON text of its object.
EMIT_EVENT_LUA = """
local function emit_event(events, type, url, owner, data)
  local t = redis.call('TIME')
  local oldest_ms = tonumber(t[1]) * 1000 - """ + str(EVENT_RETENTION_MS) + """
  redis.call('XADD', events, 'MINID', '~', oldest_ms, '*', 'type', type, 'url', url,
             'owner', owner, 'at', string.format('%d.%06d', t[1], t[2]), 'data', data)
end
"""

# Lua: the job's final event, called by every script that moves a job to a final status (worker
# FINISH, the cancel of a queued job) right where it writes that status. `state` is the JobState
# hash (webhook_url and owner are read there), `events` Keys.webhook_events().
# `emit_hooked_job_event` takes the two fields from a script that read them already (FINISH).
# Numbers arrive as strings (ARGV or HGET); error '' becomes null.
EMIT_JOB_EVENT_LUA = EMIT_EVENT_LUA + """
local function emit_hooked_job_event(events, url, owner, job_id, status, reason, prompt_tokens,
                                     completion_tokens, err)
  if not url or url == '' then return end
  local kind = 'job.completed'
  if status == 'failed' then kind = 'job.failed'
  elseif status == 'canceled' then kind = 'job.canceled'
  elseif reason == 'expired' then kind = 'job.expired' end
  local p = tonumber(prompt_tokens) or 0
  local c = tonumber(completion_tokens) or 0
  local e = cjson.null
  if err and err ~= '' then e = err end
  local data = cjson.encode({id = job_id, object = 'job', status = status, finish_reason = reason,
                             usage = {prompt_tokens = p, completion_tokens = c,
                                      total_tokens = p + c}, error = e})
  emit_event(events, kind, url, owner or '', data)
end
local function emit_job_event(events, state, job_id, status, reason, prompt_tokens,
                              completion_tokens, err)
  local hook = redis.call('HMGET', state, 'webhook_url', 'owner')
  emit_hooked_job_event(events, hook[1], hook[2], job_id, status, reason, prompt_tokens,
                        completion_tokens, err)
end
"""


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """An event the dispatcher gave up on (`Keys.webhook_dead_letters`): its attempts spent, or
    its URL refused at delivery. `status_code` 0: no HTTP answer (timeout, refused, ...)."""

    event_id: str
    webhook_id: str
    type: str
    url: str
    owner: str
    at: float
    data: str
    attempts: int
    status_code: int
    error: str
    dead_at: float

    @classmethod
    def of(cls, event: WebhookEvent, attempts: int, status_code: int, error: str,
           dead_at: float) -> DeadLetter:
        return cls(event_id=event.event_id, webhook_id=event.webhook_id, type=event.type,
                   url=event.url, owner=event.owner, at=event.at, data=event.data,
                   attempts=attempts, status_code=status_code, error=error, dead_at=dead_at)

    def to_fields(self) -> dict[str, str]:
        return {name: repr(value) if isinstance(value, float) else str(value)
                for name in self.__dataclass_fields__ for value in (getattr(self, name),)}

    @classmethod
    def from_fields(cls, fields: dict[Any, Any]) -> DeadLetter:
        f = {_text(k): _text(v) for k, v in fields.items()}
        return cls(event_id=f.get("event_id", ""), webhook_id=f.get("webhook_id", ""),
                   type=f.get("type", ""), url=f.get("url", ""), owner=f.get("owner", ""),
                   at=float(f.get("at") or 0.0), data=f.get("data") or "{}",
                   attempts=int(f.get("attempts") or 0), status_code=int(f.get("status_code") or 0),
                   error=f.get("error", ""), dead_at=float(f.get("dead_at") or 0.0))
