"""The `Idempotency-Key` header every submitting route takes (as Stripe's and OpenAI's own APIs
name it): a retried submission with the same key, by the same API key, gets the first job."""

from __future__ import annotations

import re

from starlette.datastructures import Headers

from api.errors import InvalidRequestError

IDEMPOTENCY_HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"  # "true" on an answer that is the first job's
MAX_KEY_CHARS = 255
_KEY = re.compile(r"[\x21-\x7e]+")  # visible ASCII: a UUID, a hash, a request id


def idempotency_key_of(headers: Headers) -> str | None:
    raw = headers.get(IDEMPOTENCY_HEADER)
    if raw is None:
        return None
    if not 1 <= len(raw) <= MAX_KEY_CHARS or not _KEY.fullmatch(raw):
        raise InvalidRequestError(
            f"'{IDEMPOTENCY_HEADER}' must be 1 to {MAX_KEY_CHARS} visible ASCII characters, no "
            f"spaces (got {raw!r})", param=IDEMPOTENCY_HEADER, location="header")
    return raw
