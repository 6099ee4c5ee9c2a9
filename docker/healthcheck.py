#!/usr/bin/env python3
"""Container health probes, installed as /usr/local/bin/carpool-healthcheck (exit 0 = healthy).

  carpool-healthcheck api              liveness: the API answers /healthz with 200 (Redis reachable)
  carpool-healthcheck ready [MODEL]    readiness: /healthz says status ok and a live worker serves
                                       MODEL (default $CARPOOL_MODEL or smollm2)
  carpool-healthcheck worker           liveness: a worker started in this container (its name
                                       begins with the container's hostname) has a fresh stats
                                       hash in Redis; it is refreshed every engine iteration and
                                       expires after CARPOOL_STATS_TTL_SECONDS, so a hung or dead
                                       worker fails the probe

Standard library plus the redis client, and the worker probe reads key names from `protocol`
(the one place that spells Carpool's keys), so it stays cheap enough for a probe every few seconds.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import urllib.error
import urllib.request


def _healthz() -> tuple[int, dict]:
    port = os.environ.get("CARPOOL_PORT", "8000")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=3) as reply:
            return reply.status, json.load(reply)
    except urllib.error.HTTPError as exc:
        return exc.code, {}
    except (OSError, ValueError) as exc:
        print(f"no answer from the API: {exc}")
        return 0, {}


def api() -> int:
    status, body = _healthz()
    print(f"/healthz {status} {body}")
    return 0 if status == 200 else 1


def ready(model: str) -> int:
    status, body = _healthz()
    serving = status == 200 and body.get("status") == "ok" and model in body.get("models", [])
    print(f"/healthz {status} {body}; ready for {model}: {serving}")
    return 0 if serving else 1


def worker() -> int:
    import redis

    from protocol import Keys
    from protocol.rq_keys import RQKeys

    keys = Keys(os.environ.get("CARPOOL_KEYS_PREFIX", "carpool"))
    client = redis.Redis.from_url(os.environ.get("CARPOOL_REDIS_URL", "redis://127.0.0.1:6379/0"),
                                  socket_timeout=3, socket_connect_timeout=3)
    mine = RQKeys.worker(socket.gethostname() + "-")
    try:
        names = [m.decode()[len(RQKeys.worker("")):] for m in client.smembers(RQKeys.workers_set())
                 if m.decode().startswith(mine)]
        alive = [name for name in names if client.exists(keys.worker_stats(name))]
    except redis.RedisError as exc:
        print(f"Redis unreachable: {exc}")
        return 1
    print(f"live workers in this container: {alive or 'none'}")
    return 0 if alive else 1


def main(argv: list[str]) -> int:
    probe = argv[1] if len(argv) > 1 else "api"
    if probe == "api":
        return api()
    if probe == "ready":
        return ready(argv[2] if len(argv) > 2 else os.environ.get("CARPOOL_MODEL", "smollm2"))
    if probe == "worker":
        return worker()
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
