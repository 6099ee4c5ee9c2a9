"""Server-Sent Events: the wire format, and a response that always closes its event source."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

SSE_HEADERS = {
    "Cache-Control": "no-cache",
    "Connection": "keep-alive",
    # nginx buffers responses by default; an SSE stream must reach the client token by token.
    "X-Accel-Buffering": "no",
}


def sse_event(data: str, *, event: str | None = None, event_id: str | None = None,
              retry_ms: int | None = None) -> bytes:
    lines = []
    if event_id is not None:
        lines.append(f"id: {event_id}")
    if event is not None:
        lines.append(f"event: {event}")
    if retry_ms is not None:
        lines.append(f"retry: {retry_ms}")
    # A data value may not hold a line break: each line becomes its own data field.
    lines.extend(f"data: {line}" for line in data.split("\n"))
    return ("\n".join(lines) + "\n\n").encode()


def typed_event(payload: dict[str, Any]) -> bytes:
    """A JSON event named by its payload's `type`, as the Responses API's and Anthropic's
    streams send each of theirs."""
    return sse_event(json.dumps(payload, ensure_ascii=False, separators=(",", ":")),
                     event=payload["type"])


def sse_comment(text: str = "keep-alive") -> bytes:
    return f": {text}\n\n".encode()


# The keep-alive of the streams that OpenAI's and TGI's clients read: one empty line. It keeps a
# quiet connection (a job waiting in a long queue) open through proxies as a comment does, and
# SSE parsers skip it (the standard's empty line dispatches nothing while no data is buffered). A
# comment is not so safe there: vLLM's benchmark client (`vllm bench serve`) strips the
# whitespace off each network read before it looks for the blank line that ends an event, so a
# comment read alone loses its ending, swallows every event after it and the request counts as
# failed ("Never received a valid chunk").
SSE_KEEPALIVE = b"\n"


class EventStreamResponse(StreamingResponse):
    """A `text/event-stream` response that knows whether its client stayed to the end.

    Whatever way the response ends (the client hung up, ASGI 2.3 cancels the task, ASGI 2.4
    raises ClientDisconnect), its generator is closed at once rather than left to the garbage
    collector, and `on_abandon` runs when the body was not sent to its end.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], headers: dict[str, str] | None = None,
                 on_abandon: Callable[[], Awaitable[None]] | None = None) -> None:
        super().__init__(content, headers={**SSE_HEADERS, **(headers or {})})
        self._source = content
        self._on_abandon = on_abandon
        self._is_complete = False

    async def stream_response(self, send: Send) -> None:
        await super().stream_response(send)
        self._is_complete = True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except ClientDisconnect:
            pass  # the client left mid-stream: there is nobody to answer
        finally:
            # Shielded: on ASGI 2.3 this runs inside the task the disconnect is cancelling.
            with anyio.CancelScope(shield=True):
                aclose = getattr(self._source, "aclose", None)
                if aclose is not None:
                    await aclose()
                if not self._is_complete and self._on_abandon is not None:
                    await self._on_abandon()
