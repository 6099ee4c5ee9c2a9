"""A webhook receiver on 127.0.0.1 for tests: verifies each POST's Standard Webhooks signature
(computed here with hmac, independently of webhooks.signing) and answers from a script per path."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

SECRET = "whsec_" + base64.b64encode(bytes(range(1, 33))).decode()


def expected_signature(secret: str, webhook_id: str, timestamp: str, body: bytes) -> str:
    key = base64.b64decode(secret.removeprefix("whsec_"))
    digest = hmac.new(key, f"{webhook_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


@dataclass(slots=True)
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    verified: bool
    status: int

    @property
    def payload(self) -> dict[str, Any]:
        return json.loads(self.body)


@dataclass
class Receiver:
    """`answers[path]`: the statuses to give, in order; the last repeats. Default 204."""

    port: int = 0
    answers: dict[str, list[int]] = field(default_factory=dict)
    received: list[Received] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def on(self, path: str) -> list[Received]:
        with self.lock:
            return [r for r in self.received if r.path == path]

    def _answer(self, path: str) -> int:
        script = self.answers.get(path, [204])
        return script.pop(0) if len(script) > 1 else script[0]


@contextmanager
def running_receiver(secret: str = SECRET) -> Iterator[Receiver]:
    receiver = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = self.rfile.read(int(self.headers.get("content-length", "0")))
            headers = {k.lower(): v for k, v in self.headers.items()}
            signature = expected_signature(secret, headers.get("webhook-id", ""),
                                           headers.get("webhook-timestamp", ""), body)
            verified = signature in headers.get("webhook-signature", "").split(" ")
            with receiver.lock:
                status = receiver._answer(self.path) if verified else 401
                receiver.received.append(Received(self.path, headers, body, verified, status))
            self.send_response(status)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    receiver.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
