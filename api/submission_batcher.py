"""The submissions of one API process, group-committed: at most `max_in_flight` requests to Redis
are out at once, and the submissions that arrive while they are go together in the next one.

[redis-cost] On these VMs a request costs Redis more CPU than a submission's script (README,
"Fleet scale": 20-46 us a request against about 60 us of commands), and every submission was a
request of its own, from a worker thread of its own. Now a submission that finds a request slot
free goes at once, alone, as before (so at ordinary rates nothing changes, not even a loop turn);
one that finds every slot taken waits, and whichever request returns first takes everything
waiting (up to `max_batch` a request) in one pipeline from one worker thread
(protocol.send_submissions: each script still atomic and checked on its own), then hands each
caller its own outcome. Under a burst the requests are as many as the slots' round trips, not as
many as the submissions. 32 slots, not fewer: with 8, a saturated (slow to answer) Redis kept
more submissions out than that, and the wait for a slot cost more than the batching saved
(README, "Fleet scale").
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import cast

import anyio.to_thread
from redis import Redis
from rq.job import Job

from protocol.job_submission import PreparedSubmission, send_submissions

Prepare = Callable[[], PreparedSubmission]
_Waiting = tuple[Prepare, "asyncio.Future[list[Job]]"]


class SubmissionBatcher:
    def __init__(self, redis: Redis, max_in_flight: int = 32, max_batch: int = 64) -> None:
        self._redis = redis
        self._max_in_flight = max_in_flight
        self._max_batch = max_batch
        self._in_flight = 0  # request slots taken
        self._waiting: list[_Waiting] = []  # only while every slot is taken
        self._senders: set[asyncio.Task[None]] = set()
        # Pipelines sent to Redis (for tests and bench_submission), counted here on the event
        # loop, not in the worker threads that send them (a += there could miss one).
        self.requests_sent = 0

    async def submit(self, prepare: Prepare) -> list[Job]:
        """Build (`prepare`, in a worker thread) and send one submission, alone when a request
        slot is free, else with those waiting beside it: its jobs, or the exception it ended in
        (DuplicateSubmission, SubmissionRefused, a Redis error)."""
        if self._in_flight < self._max_in_flight:
            self._in_flight += 1
            try:
                (outcome,) = await self._send_in_thread([prepare])
            finally:
                self._release()
            if isinstance(outcome, Exception):
                raise outcome
            return outcome
        future: asyncio.Future[list[Job]] = asyncio.get_running_loop().create_future()
        # Read its outcome even when its caller is gone (no "exception never retrieved").
        future.add_done_callback(lambda done: done.cancelled() or done.exception())
        self._waiting.append((prepare, future))
        # A caller that goes away (a closed connection) leaves its submission to be sent: as
        # with a request already out, whether it is queued does not depend on the caller.
        return await asyncio.shield(future)

    def _release(self) -> None:
        """A request returned: its slot goes to the submissions waiting, if any."""
        if self._waiting:
            sender = asyncio.get_running_loop().create_task(self._send_waiting())
            self._senders.add(sender)  # a reference until it is done
            sender.add_done_callback(self._senders.discard)
        else:
            self._in_flight -= 1

    async def _send_waiting(self) -> None:
        """Holding a slot: send everything waiting, `max_batch` a request, then free it."""
        try:
            while self._waiting:
                batch = self._waiting[:self._max_batch]
                del self._waiting[:self._max_batch]
                try:
                    outcomes = await self._send_in_thread([p for p, _ in batch])
                except Exception as exc:  # a Redis error: every submission of it hears so
                    outcomes = [exc] * len(batch)
                except BaseException:  # canceled (the API stops): its callers hear so
                    stopped = RuntimeError("the API stopped before this submission was sent")
                    waiting, self._waiting = self._waiting, []
                    self._settle(batch + waiting, [stopped] * (len(batch) + len(waiting)))
                    raise
                self._settle(batch, outcomes)
        finally:
            self._in_flight -= 1

    async def _send_in_thread(self, prepares: list[Prepare]) -> list[list[Job] | Exception]:
        outcomes, sent = await anyio.to_thread.run_sync(self._send, prepares)
        self.requests_sent += sent
        return outcomes

    def _send(self, prepares: list[Prepare]) -> tuple[list[list[Job] | Exception], int]:
        """In a worker thread: build each submission, send those built in one request. Each
        submission's outcome (its jobs, or its own failure to build or to get in), and the
        requests sent (0 when none could be built)."""
        outcomes: list[list[Job] | Exception | None] = []
        built: list[PreparedSubmission] = []
        for prepare in prepares:
            try:
                built.append(prepare())
                outcomes.append(None)  # filled in from the request's replies below
            except Exception as exc:  # that submission's own failure
                outcomes.append(exc)
        if not built:
            return [cast(Exception, outcome) for outcome in outcomes], 0
        replies = iter(send_submissions(self._redis, built))
        return [next(replies) if outcome is None else outcome for outcome in outcomes], 1

    @staticmethod
    def _settle(batch: list[_Waiting], outcomes: list[list[Job] | Exception]) -> None:
        for (_, future), outcome in zip(batch, outcomes):
            if future.done():
                continue
            if isinstance(outcome, Exception):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)
