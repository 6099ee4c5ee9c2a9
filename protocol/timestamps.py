"""Epoch seconds as the RFC 3339 UTC text the wire formats show (Standard Webhooks' `timestamp`,
Anthropic's `created_at`): `1970-01-01T00:00:01Z`, with microseconds only when there are some."""

from __future__ import annotations

from datetime import UTC, datetime


def rfc3339_utc(epoch_seconds: float) -> str:
    return datetime.fromtimestamp(epoch_seconds, tz=UTC).isoformat().replace("+00:00", "Z")
