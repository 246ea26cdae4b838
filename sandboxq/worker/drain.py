"""A graceful stop (design invariant 9), step by step, over the jobs still running.

    stop() ─► begin: no more claims; attempts not yet in a child end `interrupted`
          ─► until a grace before stop_timeout_s: running jobs may finish normally
          ─► then: each gets its soft signal (SoftTimeout raised in the handler)
          ─► at stop_timeout_s: killed (the grace: half of it, at most MAX_SOFT_GRACE_S)
    stop(now=True), or a second SIGTERM/SIGINT, at any point: killed at once.

Every attempt that ends `interrupted` is requeued without charging an attempt (acks.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from sandboxq.models import Outcome
from sandboxq.pool.pool import Pool
from sandboxq.worker.inflight import Held

#: Longest wait between the soft signal and the kill.
MAX_SOFT_GRACE_S = 5.0


class Drain:
    """One graceful stop, begun when the dispatcher's main thread sees it; that thread
    calls ``advance`` until nothing is held."""

    def __init__(
        self,
        pool: Pool,
        held: Callable[[], list[Held]],
        stop_timeout_s: float,
        stop_now: threading.Event,
    ) -> None:
        self._pool = pool
        self._held = held
        self._stop_now = stop_now
        # Everything is over by stop_timeout_s: the soft signal comes a grace before it.
        now = time.monotonic()
        self._kill_at = now + stop_timeout_s
        self._soft_at = self._kill_at - min(MAX_SOFT_GRACE_S, stop_timeout_s / 2)
        pool.end_unstarted(Outcome.INTERRUPTED, "the worker is stopping")
        self.advance()

    def advance(self) -> None:
        """Take whatever step is due now; call again until nothing is held."""
        now = time.monotonic()
        if self._stop_now.is_set() or now >= self._kill_at:
            for held in self._held():
                self._pool.kill(held.lease.task_id, Outcome.INTERRUPTED, "the worker stopped")
        elif now >= self._soft_at:
            for held in self._held():
                self._pool.soft_stop(held.lease.task_id)
