"""rq's worker commands (rq.command), heard on the worker's own Pub/Sub channel.

rq's tools reach a worker by publishing on `rq:pubsub:<worker name>`: `send_shutdown_command`
(stop the worker: Carpool drains, as on SIGTERM), `send_stop_job_command` and
`send_stop_execution_command` (stop one job it runs: Carpool cancels it, so it ends `canceled`
at the next step boundary), `send_kill_horse_command` (rq's forked job process, which Carpool
does not have: logged and ignored). Messages are pushed to the subscribed connection; the worker
reads what arrived at each iteration, without a request to Redis.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rq.command import PUBSUB_CHANNEL_TEMPLATE

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RQCommand:
    name: str  # shutdown, stop-job, stop-execution, kill-horse, or what a newer rq sends
    job_id: str = ""


class RQCommands:
    def __init__(self, redis: Redis, worker_name: str) -> None:
        self.channel = PUBSUB_CHANNEL_TEMPLATE % worker_name
        # Subscription confirmations come back as messages too (an ignored one would read as
        # "nothing more" and leave the commands behind it for the next iteration).
        self._pubsub = redis.pubsub()
        self._subscribed = False

    def subscribe(self) -> None:
        """Before the worker takes jobs: a command sent earlier is not heard (as with rq)."""
        self._pubsub.subscribe(self.channel)
        self._subscribed = True

    def received(self) -> list[RQCommand]:
        """The commands pushed since the last call (never blocks; none while Redis is away: the
        subscription is renewed on the connection's return)."""
        if not self._subscribed:
            return []
        commands = []
        try:
            while (message := self._pubsub.get_message(timeout=0.0)) is not None:
                if message.get("type") != "message":
                    continue
                command = _parse(message.get("data"))
                if command is not None:
                    commands.append(command)
        except (RedisConnectionError, RedisTimeoutError) as exc:
            log.debug("rq command channel unreachable: %s", exc)
        return commands

    def close(self) -> None:
        try:
            self._pubsub.close()
        except (RedisConnectionError, RedisTimeoutError):
            pass


def _parse(data: object) -> RQCommand | None:
    try:
        payload = json.loads(data.decode() if isinstance(data, bytes) else str(data))
        return RQCommand(name=str(payload["command"]), job_id=str(payload.get("job_id", "")))
    except (ValueError, KeyError, TypeError, AttributeError):
        log.warning("unreadable rq command ignored: %r", data)
        return None
