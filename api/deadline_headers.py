"""The deadline headers of the OpenAI routes, whose bodies stay OpenAI's own: the same limits as
the jobs API's `queue_timeout_s` and `deadline_s` fields (api/fields.py)."""

from __future__ import annotations

import math
from typing import TypedDict

from starlette.datastructures import Headers

from api.errors import InvalidRequestError
from api.fields import MAX_DEADLINE_S

DEADLINE_HEADER = "X-Carpool-Deadline-S"
QUEUE_TIMEOUT_HEADER = "X-Carpool-Queue-Timeout-S"


class Deadlines(TypedDict):
    """GenerationRequest's fields of the same names."""

    queue_timeout_s: float | None
    deadline_s: float | None


def deadlines_of(headers: Headers) -> Deadlines:
    return Deadlines(queue_timeout_s=_seconds(headers, QUEUE_TIMEOUT_HEADER),
                     deadline_s=_seconds(headers, DEADLINE_HEADER))


def _seconds(headers: Headers, name: str) -> float | None:
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or not 0 < value <= MAX_DEADLINE_S:
        raise InvalidRequestError(
            f"'{name}' must be a number of seconds, more than 0 and at most {MAX_DEADLINE_S:.0f} "
            f"(got {raw!r})", param=name, location="header")
    return value
