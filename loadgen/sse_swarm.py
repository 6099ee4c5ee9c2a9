"""Many SSE subscribers from one process: the 10,000-subscriber test of one API process.

httpx holds some 50 KB and a few objects per open stream; a swarm of thousands would measure the
client. Each subscriber here is one asyncio connection speaking just enough HTTP/1.1: a GET, the
status line, then the lines of the (chunked) body, of which it keeps the SSE `id:` of each token
event and the final `done`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from urllib.parse import urlsplit


@dataclass(slots=True)
class SubscriberResult:
    job_id: str
    status: int = 0
    token_ids: list[str] = field(default_factory=list)  # the SSE ids of the token events, in order
    is_done: bool = False
    error: str = ""


async def subscribe(base_url: str, job_id: str, connected: asyncio.Event | None = None,
                    headers: dict[str, str] | None = None) -> SubscriberResult:
    """Follow `/v1/jobs/{job_id}/stream` to its `done` event (or the connection's end)."""
    url = urlsplit(base_url)
    result = SubscriberResult(job_id)
    try:
        reader, writer = await asyncio.open_connection(url.hostname, url.port or 80)
    except OSError as exc:
        result.error = f"connect: {exc}"
        return result
    try:
        extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
        writer.write(f"GET /v1/jobs/{job_id}/stream HTTP/1.1\r\nHost: {url.netloc}\r\n"
                     f"Accept: text/event-stream\r\n{extra}\r\n".encode())
        await writer.drain()
        status_line = await reader.readline()
        result.status = int(status_line.split()[1]) if status_line else 0
        if connected is not None:
            connected.set()
        last_id = ""
        event = ""
        while line := await reader.readline():
            text = line.rstrip(b"\r\n").decode(errors="replace")
            if text.startswith("id: "):
                last_id = text[4:]
            elif text.startswith("event: "):
                event = text[7:]
            elif text.startswith("data: "):
                if event == "token":
                    result.token_ids.append(last_id)
                elif event == "done":
                    result.is_done = True
                    break
            elif text == "0" and result.status != 200:
                break  # the end of a chunked error body
    except (OSError, ValueError, IndexError) as exc:
        result.error = repr(exc)
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass
    return result
