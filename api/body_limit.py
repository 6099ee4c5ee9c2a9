"""BodyLimitMiddleware: a request body past the limit is answered 413 before anything parses it.

uvicorn accepts bodies of any size and FastAPI reads a whole body into memory before validating
it, so without a cap one 10 MB request would be read, JSON-decoded and tokenized in full.
"""

from __future__ import annotations

from collections.abc import Sequence

from starlette.requests import Request
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import PayloadTooLargeError, error_response


class BodyLimitMiddleware:
    """Reads a request body up to `max_body_bytes` and replays it to the app, or answers 413.

    A declared Content-Length over the limit is refused unread; a chunked body is counted as it
    arrives. Buffering first costs nothing extra (FastAPI buffers the whole body anyway) and keeps
    the app from ever seeing a partial body, so no parser has to tell "too large" from "broken".
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int, routes: Sequence[BaseRoute],
                 path_limits: dict[str, tuple[int, str]] | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self._routes = routes  # to answer in the error shape of the route that was asked
        # Exact paths with a limit of their own (file uploads), and the setting that sets it.
        self._path_limits = path_limits or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _has_body(scope):
            await self.app(scope, receive, send)
            return
        limit, setting = self._path_limits.get(scope.get("path", ""),
                                               (self.max_body_bytes, "CARPOOL_MAX_BODY_BYTES"))
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await self._refuse(scope, receive, send, f"is {declared} bytes", limit, setting)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left while sending: nobody is waiting for an answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self._refuse(scope, receive, send, f"is over {limit} bytes", limit, setting)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, size: str, limit: int,
                      setting: str) -> None:
        fix = ("send a shorter prompt or fewer messages" if setting == "CARPOOL_MAX_BODY_BYTES"
               else "split the content into smaller files")
        error = PayloadTooLargeError(
            f"The request body {size}; the limit is {limit} bytes ({setting}): {fix}")
        # Matched here because routing has not run yet; error_response picks the shape by route.
        route = next((r for r in self._routes if r.matches(scope)[0] is Match.FULL), None)
        request = Request({**scope, "route": route} if route else scope, receive)
        response = error_response(request, error)
        # The unread rest of the body makes the connection unusable for another request.
        response.headers["Connection"] = "close"
        await response(scope, receive, send)


def _has_body(scope: Scope) -> bool:
    for name, value in scope["headers"]:
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0"):
            return True
    return False


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server refuses a malformed length before we see it
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that gives the buffered body once, then the server's own messages (a
    disconnect, which streaming responses wait for)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
