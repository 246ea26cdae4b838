"""The fetcher thread: claims jobs into the slots the main thread's finishes left empty.

    wait_for_room ─► reserve(free slots) ─► backend.claim(count, wait_s) ─┬─► start(job) ─► pool
         ▲                                                  once stopping ├─► give_back
         └──────────────────────────── unreserve ◄────────────────────────┘
    burst: an empty claim, nothing held, none waiting/delayed/active ─► QueueEmpty; it ends

An idle fetcher waits inside the backend's claim, which returns as soon as a job arrives
(no polling), for ``IDLE_WAIT_S`` at most; a stop ends that wait at once (``stop_waiting``).
A claim that fails is tried again after a backoff (2 s at most). In burst mode the first
empty claim returns at once, so the empty check can end the run; after that it waits like
any other.
``start`` and ``give_back`` are the dispatcher's (dispatch.py); a crash of this thread
fails the worker (``fail``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from sandboxq.backends.base import Backend, Claimed
from sandboxq.errors import BackendError
from sandboxq.models import JobState
from sandboxq.text import guarded_logger
from sandboxq.worker.events import DispatchEvent, FetcherEnded, QueueEmpty
from sandboxq.worker.inflight import InFlight
from sandboxq.worker.threads import BackgroundThread

log = guarded_logger("sandboxq.worker")

#: How long an idle fetcher blocks in one claim (a stop ends the wait at once; this bounds
#: how late a stop is seen when that cannot reach the backend).
IDLE_WAIT_S = 0.5


class Fetcher(BackgroundThread):
    """Claims on a thread of its own until the worker stops, or a burst finds no work."""

    def __init__(
        self,
        worker_id: str,
        lease_s: float,
        backend: Backend,
        inflight: InFlight,
        stopping: threading.Event,
        burst: bool,
        *,
        start: Callable[[Claimed], bool],
        give_back: Callable[[list[Claimed]], None],
        report: Callable[[DispatchEvent], None],
        fail: Callable[[str], None],
    ) -> None:
        super().__init__("fetcher", stopping)
        self._id = worker_id
        self._lease_s = lease_s
        self._backend = backend
        self._inflight = inflight
        self._burst = burst
        self._start = start
        self._give_back = give_back
        self._report = report
        self._fail = fail
        #: The burst fetcher found the queue empty: it ended on purpose.
        self.found_empty = False
        self._ended = False  # the loop returned

    def ended_on_purpose(self) -> bool:
        return self.found_empty or super().ended_on_purpose()

    def stop_waiting(self) -> None:
        """Once the worker stops: end the claim this thread may be waiting in now, rather
        than at its wait's end (``Backend.stop_waiting``). On a thread of its own, since
        the round trip it may take must not hold up a stop while the backend hangs."""

        def unblock() -> None:
            try:
                self._backend.stop_waiting(self._id)
            except BackendError as exc:  # the wait then ends within IDLE_WAIT_S, as ever
                log.debug("could not end the fetcher's wait: %s", exc)

        threading.Thread(target=unblock, name="sandboxq-unblock", daemon=True).start()

    def crashed(self) -> None:
        self._fail(f"the fetcher thread died: {self.died}")

    def fetching(self) -> bool:
        """True until the loop has returned (no claim under way)."""
        return self.is_alive() and not self._ended

    def loop(self) -> None:
        try:
            self._fetch()
        finally:
            self._ended = True
            self._report(FetcherEnded())

    def _fetch(self) -> None:
        failures = 0
        idle = False  # the last claim found nothing
        while not self.stopped.is_set():
            self._inflight.wait_for_room()
            count = self._inflight.reserve()
            if not count:
                continue
            # After an empty claim, block in the backend until a job arrives. In burst mode
            # a first empty claim returns at once, so the empty check below can end it.
            wait_s = IDLE_WAIT_S if idle or not self._burst else 0.0
            if idle and self._burst and (held := len(self._inflight)):
                # Nothing left to claim but jobs of ours still run: their ends (and the
                # retries they may bring) are what can change that, so wait for one,
                # then look again at once, rather than block in the backend a whole
                # IDLE_WAIT_S past the last job before the burst can see it is done.
                self._inflight.wait_for_fewer(held, IDLE_WAIT_S)
                wait_s = 0.0
            try:
                claimed = self._backend.claim(self._id, count, self._lease_s, wait_s)
                if failures:  # the end of an outage: its warnings were held back (quiet.py)
                    log.warning("claims go through again, after %d failed", failures)
                failures = 0
            except BackendError as exc:
                self._inflight.unreserve(count)
                failures += 1
                log.warning("claim failed (%s); retrying", exc)
                self.stopped.wait(min(2.0, 0.05 * 2**failures))
                continue
            if self.stopped.is_set():
                # A waiting claim can return after stop(): hand those back untouched.
                self._give_back(claimed)
            else:
                for job in claimed:
                    count -= self._start(job)
                # Let the pool's thread, just woken to assign these, take the GIL now
                # rather than after this thread's next claim blocks.
                time.sleep(0)
            self._inflight.unreserve(count)
            idle = not claimed
            if idle and self._burst and self._queue_is_empty():
                self.found_empty = True
                self._report(QueueEmpty())
                return

    def _queue_is_empty(self) -> bool:
        if len(self._inflight):
            return False
        try:
            counts = self._backend.counts()
        except BackendError as exc:  # not empty as far as we know: the next claim waits
            log.warning("could not count jobs (%s); still working", exc)
            return False
        # Another worker's active job may still come back here (a retry, a recovery).
        waiting = (JobState.WAITING, JobState.DELAYED, JobState.ACTIVE)
        return not any(counts[state] for state in waiting)
