"""Lease renewal on its own thread (design invariants 2 and 5).

    every renew_interval_s:  backend.renew(owned leases)  ── its own connection
        renewed  ──► pool.extend_fence: its attempt's fence moves to
                     renew_started + lease_s - margin
        rejected ──► on_lost(lease): the child is killed (outcome lease_lost), no ack

Renewals keep a fixed schedule (one every ``interval_s`` from the start of the last, not
from its end), and the worker registry refresh (``RegistryRefresh``, on the main
connection) runs on a thread of its own: a slow link or a slow server stretches neither
into a late renewal.

The heartbeat never kills on a timer of its own: each attempt carries a fence deadline
in the pool's supervisor, which enforces it like any other deadline. So if Redis hangs,
this thread may block in ``renew`` for as long as it likes; the fence still falls on
time and the child dies before the lease can expire on the server. A renewal that lands
after its attempt's fence has come (the worker was stopped with it on the way) moves
nothing: the fence's kill stands, and the job is recovered as a lost lease.

Handlers run in other processes, so nothing they do (GIL-holding C calls, CPU spin) can
delay this thread: it competes only with the worker's own threads for the parent's GIL.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from sandboxq.backends.base import Backend
from sandboxq.errors import BackendError
from sandboxq.text import guarded_logger
from sandboxq.worker.threads import BackgroundThread

log = guarded_logger("sandboxq.heartbeat")

#: How many recent renewal times a heartbeat keeps: about 3 hours at the default 10 s
#: interval, some 30 kB.
RENEWAL_HISTORY = 1024


def fence_margin_s(lease_s: float) -> float:
    """How long before the lease would expire on the server the child is killed.

    Covers the kill itself (milliseconds) and drift between our monotonic clock and the
    server's: a tenth of the lease, at most one second.
    """
    return min(1.0, lease_s * 0.1)


class Lease:
    """A job this worker owns: its lease token and the pool attempt running it."""

    __slots__ = ("job_id", "lease_token", "renewed_at", "task_id")

    def __init__(self, job_id: str, lease_token: str, task_id: int, renewed_at: float):
        self.job_id = job_id
        self.lease_token = lease_token
        self.task_id = task_id
        self.renewed_at = renewed_at  # monotonic time just before the claim/renew call


class Heartbeat(BackgroundThread):
    def __init__(
        self,
        backend: Backend,
        worker_id: str,
        lease_s: float,
        interval_s: float,
        leases: Callable[[], list[Lease]],
        extend_fence: Callable[[int, float], None],
        on_lost: Callable[[Lease, str], None],
    ) -> None:
        super().__init__("heartbeat")
        self._backend = backend
        self._worker_id = worker_id
        self._lease_s = lease_s
        self._interval_s = interval_s
        self._leases = leases
        self._extend_fence = extend_fence
        self._on_lost = on_lost
        #: Longest gap between two successful renewals, for tests and benchmarks.
        self.max_gap_s = 0.0
        #: ``time.monotonic()`` of the latest successful renewals, oldest first, so a
        #: benchmark can plot the gaps over time; bounded, so a long-lived worker stays small.
        self.renewed_at: deque[float] = deque(maxlen=RENEWAL_HISTORY)
        self.renewals = 0

    def loop(self) -> None:
        last_ok = next_at = time.monotonic()
        while True:
            next_at += self._interval_s
            if self.stopped.wait(max(0.0, next_at - time.monotonic())):
                return
            if self.renew_now():
                now = time.monotonic()
                self.max_gap_s = max(self.max_gap_s, now - last_ok)
                self.renewed_at.append(now)
                last_ok = now
            # After a call longer than the interval, renew at once, then keep the schedule
            # from now rather than firing a burst of catch-up renewals.
            next_at = max(next_at, time.monotonic() - self._interval_s)

    def renew_now(self) -> bool:
        """Renew every owned lease once; False if the backend could not be reached."""
        leases = self._leases()
        if not leases:
            return True
        started = time.monotonic()
        # The backend answers with job ids: one call per lease of the same job, so a
        # rejected old lease of a job never condemns its current one (rare: a job held
        # again while its earlier attempt is still being killed).
        batches: list[dict[str, Lease]] = []
        for lease in leases:
            for batch in batches:
                if lease.job_id not in batch:
                    batch[lease.job_id] = lease
                    break
            else:
                batches.append({lease.job_id: lease})
        try:
            losts = [
                set(
                    self._backend.renew(
                        self._worker_id,
                        [(x.job_id, x.lease_token) for x in batch.values()],
                        self._lease_s,
                    )
                )
                for batch in batches
            ]
        except BackendError as exc:
            # No kill here: each attempt's fence deadline falls on its own if this lasts.
            log.warning("could not renew %d lease(s): %s", len(leases), exc)
            return False
        self.renewals += 1
        fence = started + self._lease_s - fence_margin_s(self._lease_s)
        for batch, lost in zip(batches, losts, strict=True):
            for lease in batch.values():
                if lease.job_id in lost:
                    self._on_lost(lease, "the lease renewal was rejected")
                else:
                    lease.renewed_at = started
                    self._extend_fence(lease.task_id, fence)
        return True


class RegistryRefresh(BackgroundThread):
    """Publishes the worker's record every ``interval_s``, on the main connection and a
    thread of its own, so a slow registry write never delays a renewal; and, when the jobs
    it holds change, ``SETTLE_S`` later (the attempt has a child by then), at most every
    ``MIN_GAP_S``: ``sandboxq info`` shows a job half a second after it starts, not up to
    ``interval_s`` later."""

    #: After a change, wait this long (more changes come together; the child starts).
    SETTLE_S = 0.2
    #: At least this long between two records written for changes: a few writes a second
    #: whatever the job rate, so that a job's pid is in Redis soon after it starts (a
    #: lease-lost attempt's record takes it from there).
    MIN_GAP_S = 0.3

    def __init__(self, interval_s: float, refresh: Callable[[], None]) -> None:
        super().__init__("registry")
        self._interval_s = interval_s
        self._refresh = refresh
        self._changed = threading.Event()

    def changed(self) -> None:
        """The held jobs changed (any thread; costs a read when already told)."""
        if not self._changed.is_set():
            self._changed.set()

    def stop(self, timeout_s: float | None = None) -> None:
        self._changed.set()  # wakes the loop; it sees ``stopped`` then
        super().stop(timeout_s)

    def loop(self) -> None:
        last = time.monotonic()
        while True:
            self._changed.wait(max(0.0, last + self._interval_s - time.monotonic()))
            if self._changed.is_set():
                settle_until = max(time.monotonic() + self.SETTLE_S, last + self.MIN_GAP_S)
                if self.stopped.wait(max(0.0, settle_until - time.monotonic())):
                    return
                self._changed.clear()  # before the read: a later change is published too
            elif self.stopped.is_set():
                return
            elif time.monotonic() < last + self._interval_s:
                continue
            try:
                self._refresh()
            except Exception:
                log.exception("the registry refresh failed")
            last = time.monotonic()
