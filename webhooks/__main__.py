"""`python -m webhooks`: the webhook dispatcher process (settings from CARPOOL_* variables)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
from types import FrameType

from pydantic import ValidationError
from redis import Redis

from protocol.keys import Keys
from protocol.redis_urls import shown_url
from webhooks.dispatcher import WebhookDispatcher
from webhooks.settings import DispatcherSettings


def main() -> int:
    try:
        settings = DispatcherSettings()  # type: ignore[call-arg]  # the secret comes from the env
    except ValidationError as exc:
        print(f"webhook dispatcher: bad settings (CARPOOL_* variables):\n{exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    consumer = settings.consumer_name or f"{socket.gethostname()}-{os.getpid()}"
    stop = threading.Event()

    def request_stop(signum: int, frame: FrameType | None) -> None:
        stop.set()  # the round in progress finishes and records its outcomes

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    redis = Redis.from_url(settings.redis_url)
    dispatcher = WebhookDispatcher(redis, settings, consumer, Keys(settings.keys_prefix))
    logging.getLogger("webhooks").info("webhook dispatcher %s on %s", consumer,
                                       shown_url(settings.redis_url))
    try:
        dispatcher.run(stop)
    finally:
        dispatcher.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
