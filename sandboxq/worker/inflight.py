"""The jobs a worker holds, and the slots it may still fill.

    fetcher thread ── wait_for_room, reserve ─► claim ─► add ─► unreserve what is left
    main thread ── reserve(finishing) ─► finish + claim ─► discard acked, add claimed,
                   unreserve what is left
                ── get(token) per event of an attempt; discard what ended unacked
    cancellation watch ── get(token)        heartbeat, registry, drain ── leases, snapshot

Held jobs are keyed by *lease token*, never by job id alone: one worker may hold a job
again while an outcome of its earlier attempt is still on its way (a cancel followed at
once by a retry, or its own stall recovery after a freeze), and that outcome must find
its own lease or none, never the new one.

Slots are reserved under the lock *before* a claim goes out, so the fetcher and the main
thread never hold more than ``_capacity()`` jobs between them, whichever claims first.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable

from sandboxq.backends.base import Claimed
from sandboxq.worker.heartbeat import Lease


class Held:
    """A job this worker owns: the claim (with its parsed options) and its lease."""

    __slots__ = ("job", "lease")

    def __init__(self, job: Claimed, lease: Lease) -> None:
        self.job = job
        self.lease = lease


#: With the default (adaptive) prefetch, claim ahead about this much work per child...
PREFETCH_WORK_S = 0.02
#: ...but never more than this many jobs beyond the children.
MAX_PREFETCH = 256


class InFlight:
    def __init__(self, children: int, prefetch: int | None, stopping: threading.Event) -> None:
        self._children = children
        self._prefetch = prefetch
        self._stopping = stopping
        self._held: dict[str, Held] = {}  # lease token → held job
        self._reserved = 0
        self._cond = threading.Condition()
        self._recent_job_s = 1.0  # moving average of attempt run times
        #: Told (any thread, holding no lock of ours) that the held jobs changed: the
        #: registry refresh publishes them soon (``RegistryRefresh.changed``).
        self.on_change: Callable[[], None] = _nothing

    def _capacity(self) -> int:
        """Jobs this worker may hold: one per child, plus the prefetch.

        A prefetched job waits here while its lease runs, so for long jobs the prefetch
        stays at one (or what was configured): another worker may be idle. For short jobs
        a claim's round trip outlasts the job, so the adaptive default claims enough to
        cover ``PREFETCH_WORK_S`` of work per child.
        """
        if self._prefetch is not None:
            return self._children + self._prefetch
        ahead = math.ceil(self._children * PREFETCH_WORK_S / max(self._recent_job_s, 1e-6))
        return self._children + max(1, min(MAX_PREFETCH, ahead))

    def record_runtime(self, seconds: float) -> None:
        """An attempt ran this long: it tunes the adaptive prefetch."""
        self._recent_job_s += (seconds - self._recent_job_s) * 0.2

    def __len__(self) -> int:
        return len(self._held)

    def wait_for_room(self) -> None:
        """Block until a slot is free or the worker stops."""
        with self._cond:
            while not self._stopping.is_set() and (
                len(self._held) + self._reserved >= self._capacity()
            ):
                self._cond.wait()

    def wait_for_fewer(self, held: int, timeout_s: float) -> None:
        """Block until fewer than ``held`` jobs are held, the worker stops, or ``timeout_s``
        passes. A job that ends frees a slot nobody refills: that wakes this wait."""
        with self._cond:
            self._cond.wait_for(
                lambda: len(self._held) < held or self._stopping.is_set(), timeout_s
            )

    def reserve(self, finishing: int = 0) -> int:
        """Reserve every free slot (``finishing`` jobs about to be acked count as free);
        none once the worker stops."""
        with self._cond:
            if self._stopping.is_set():
                return 0
            free = max(0, self._capacity() - len(self._held) - self._reserved + finishing)
            self._reserved += free
            return free

    def unreserve(self, count: int) -> None:
        with self._cond:
            self._reserved -= count
            self._wake_if_room()

    def add(self, held: Held) -> None:
        """Hold a claimed job in one of the caller's reserved slots. The slot stops being
        reserved in the same step: a finish that reserves while the claimer is still
        starting its jobs would otherwise count the slot twice, and claim nothing."""
        with self._cond:
            self._held[held.job.token] = held
            self._reserved -= 1
        self.on_change()

    def get(self, token: str) -> Held | None:
        """The job held under lease ``token`` (None: that lease is not held any more)."""
        with self._cond:
            return self._held.get(token)

    def discard(self, tokens: Iterable[str]) -> None:
        """Forget leases that are no longer ours (acked, lost, cancelled); frees their slots."""
        with self._cond:
            for token in tokens:
                self._held.pop(token, None)
            self._wake_if_room()
        self.on_change()

    def _wake_if_room(self) -> None:
        """Wake ``wait_for_room`` only when a slot is free (the caller holds the lock).

        A finish reserves the slots it frees and refills them in the same round trip, so
        most discards and unreserves leave no room: waking the fetcher for them cost a
        thread switch (and the GIL) twice per job, for a check that found nothing.
        """
        if len(self._held) + self._reserved < self._capacity():
            self._cond.notify_all()

    def snapshot(self) -> list[Held]:
        with self._cond:
            return list(self._held.values())

    def leases(self) -> list[Lease]:
        return [held.lease for held in self.snapshot()]

    def wake(self) -> None:
        """Wake ``wait_for_room`` (the worker is stopping)."""
        with self._cond:
            self._cond.notify_all()


def _nothing() -> None:
    pass
