"""A Redis URL as logs and consoles show it: its password replaced, since `redis://:secret@host`
is how Redis' credentials are usually given (CARPOOL_REDIS_URL and the stream shards' URLs)."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


def shown_url(url: str) -> str:
    """`url` with any password as `***`: `redis://user:***@host:6379/0`."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 address keeps its brackets
        host = f"[{host}]"
    port = f":{parts.port}" if parts.port is not None else ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}{port}"))
