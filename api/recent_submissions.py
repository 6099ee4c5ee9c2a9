"""The jobs this API process submitted lately, so that following one's stream from the start
need not read its state first.

[redis-cost] `GET /v1/jobs/{id}/stream` read the job's state hash before its first byte: is there
such a job, is it the caller's, has it generated anything (then the stream hub reads the stream
at once). For a job this process submitted moments ago the answers are known: it exists for at
least its retention after the submission (its state's TTL starts at its end, and nothing else
deletes it), it is its submitter's, and it had nothing generated when its submission was sent.
That read was a request of its own for every job submitted through `POST /v1/jobs` and followed
through the same process: about a fifth of the requests a 50-token job costs Redis
(README, "Fleet scale").

Bounded in time (`window_s`) and entries (`max_entries`, oldest out first); a job submitted
through another API process, or longer ago, has its state read as before. The route skips the
read only while Redis was heard serving a moment ago (`StreamHub.heard_within`): the read is also
how a stream request learns that Redis is down, and answers 503.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

# Long enough for a client's stream request to follow its submission on a loaded API (the fleet
# bench saw 3-6 s), short enough that the record stays small: 1,000 submissions a second keep
# some 60,000 entries of about 200 bytes.
DEFAULT_WINDOW_S = 60.0
DEFAULT_MAX_ENTRIES = 65_536


@dataclass(frozen=True, slots=True)
class _Submitted:
    owner: str
    fresh_since: float  # monotonic, before its submission was sent: nothing generated then
    kept_until: float  # monotonic: its state surely exists until then


class RecentSubmissions:
    def __init__(self, window_s: float = DEFAULT_WINDOW_S,
                 max_entries: int = DEFAULT_MAX_ENTRIES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._window_s = window_s
        self._max_entries = max_entries
        self._clock = clock
        self._jobs: OrderedDict[str, _Submitted] = OrderedDict()

    def __len__(self) -> int:
        return len(self._jobs)

    def add(self, job_id: str, owner: str, fresh_since: float, retention_s: float) -> None:
        """`job_id` was queued by a submission sent after `fresh_since` (monotonic); its records
        are kept `retention_s` after it ends (the shorter of its result and failure TTLs)."""
        kept_until = fresh_since + min(retention_s, self._window_s)
        self._jobs[job_id] = _Submitted(owner, fresh_since, kept_until)
        self._jobs.move_to_end(job_id)
        self._drop_old(self._clock())

    def fresh_since(self, job_id: str, owner: str) -> float | None:
        """When `job_id` had nothing generated for sure, if this process submitted it for
        `owner` and its state surely still exists; None otherwise (then read its state)."""
        submitted = self._jobs.get(job_id)
        if submitted is None or submitted.owner != owner \
                or self._clock() >= submitted.kept_until:
            return None
        return submitted.fresh_since

    def _drop_old(self, now: float) -> None:
        # Entries go in submission order, so the old ones are at the front.
        while self._jobs:
            oldest = next(iter(self._jobs.values()))
            if len(self._jobs) <= self._max_entries and now < oldest.fresh_since + self._window_s:
                return
            self._jobs.popitem(last=False)
