"""A graceful stop (design invariant 9), step by step, over the jobs still running.

    stop() ─► begin: no more claims; attempts not yet in a child end `interrupted`
          ─► until a grace before stop_timeout_s: running jobs may finish normally
          ─► then: each gets its soft signal (SoftTimeout raised in the handler)
          ─► at stop_timeout_s: killed (the grace: half of it, at most MAX_SOFT_GRACE_S)
    stop(now=True), or a second SIGTERM/SIGINT/SIGHUP, at any point: killed at once
          (asked for its stack first, killed 50 ms later: pool.kill's stack_first).

Every attempt that ends `interrupted` is requeued without charging an attempt
(outcomes.py). ``StopRequest`` is what every part of the worker reads of the stop: whether
it was asked, whether at once, and the deadline by which ``run()`` must have returned.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

from sandboxq.models import Outcome
from sandboxq.pool.pool import Pool
from sandboxq.worker.inflight import Held

#: Longest wait between the soft signal and the kill.
MAX_SOFT_GRACE_S = 5.0
#: How long after its stop deadline the dispatcher may still wait for the acks of what
#: it interrupted; ``run()``'s last steps (pool shutdown, deregistration: under 0.1 s with
#: Redis hung) then fit in what is left of the promised second.
STOP_SLACK_S = 0.6
#: The worker's deregistration gets at least this long, even past the deadline: a record
#: removed at once beats one that lingers in ``sandboxq info`` until its time to live.
DEREGISTER_MIN_S = 0.05


class StopRequest:
    """Whether the worker was asked to stop, and when; set from any thread or a signal
    handler, read by every part."""

    def __init__(self, stop_timeout_s: float) -> None:
        self._stop_timeout_s = stop_timeout_s
        #: Set by ``stop()``: claim nothing more, drain what runs.
        self.asked = threading.Event()
        #: Set by ``stop(now=True)`` or a second signal: kill what runs now.
        self.now = threading.Event()
        self._asked_at: float | None = None  # monotonic, the first time each was asked
        self._now_at: float | None = None

    def ask(self, now: bool = False) -> None:
        at = time.monotonic()
        if now:
            self._now_at = self._now_at or at
            self.now.set()
        self._asked_at = self._asked_at or at
        self.asked.set()

    def deadline(self) -> float:
        """When ``run()`` must have returned (monotonic; inf until a stop is asked)."""
        ends = [math.inf]
        if self._asked_at is not None:
            ends.append(self._asked_at + self._stop_timeout_s + STOP_SLACK_S)
        if self._now_at is not None:
            ends.append(self._now_at + STOP_SLACK_S)
        return min(ends)

    def time_left(self, at_least_s: float = 0.0) -> float | None:
        """Seconds left before the deadline, for a join (None: no deadline yet), or
        ``at_least_s`` when less is left. The steps after the deadline each get only what
        they ask for here: a floor on every one of them (50 ms each) once added up past the
        promised bound when the backend hung."""
        deadline = self.deadline()
        return None if deadline == math.inf else max(at_least_s, deadline - time.monotonic())


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
                # with its stack: where a job was when a stop cut it short
                self._pool.kill(
                    held.lease.task_id, Outcome.INTERRUPTED, "the worker stopped", stack_first=True
                )
        elif now >= self._soft_at:
            for held in self._held():
                self._pool.soft_stop(held.lease.task_id)
