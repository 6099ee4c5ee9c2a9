"""`rq suspend` and `rq resume` as one worker follows them (rq.suspension's flag).

While the flag is set no worker starts a job; the running ones go on to their ends. The worker
learns of it from a claim the claim script refused, or from its idle wait (JobQueue raises
WorkersSuspended), and looks for `rq resume` (or the end of `--duration`) at most once a second,
as rq's own worker does.
"""

from __future__ import annotations

import logging
import time

from worker.jobs.job_queue import JobQueue

log = logging.getLogger(__name__)

# How often a suspended worker looks for `rq resume` (rq's own worker: every second).
POLL_S = 1.0


class Suspension:
    def __init__(self, queue: JobQueue, worker_name: str) -> None:
        self._queue = queue
        self._worker_name = worker_name
        self.is_held = False
        self._read_at = 0.0  # monotonic

    def hold(self, num_running: int) -> None:
        """A claim or wait found the flag set."""
        if not self.is_held:
            log.info("worker %s: suspended (rq suspend): its %d running jobs go on, no new job "
                     "starts until `rq resume`", self._worker_name, num_running)
        self.is_held = True
        self._read_at = time.monotonic()

    @property
    def is_read_due(self) -> bool:
        """Held, and POLL_S since the flag was last read."""
        return self.is_held and time.monotonic() - self._read_at >= POLL_S

    def has_lifted(self) -> bool:
        """Reads the flag: whether it is gone (Redis' errors go to the caller)."""
        self._read_at = time.monotonic()
        if self._queue.is_suspended():
            return False
        self.is_held = False
        log.info("worker %s: resumed, taking jobs again", self._worker_name)
        return True
