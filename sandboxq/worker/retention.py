"""What retention removed from the queue, told by the worker: a log line when the count cap
trimmed (rate-limited) and the counts ``sandboxq_jobs_trimmed_total{reason}`` reads.

    finish / cancel scripts ── trim ──► trims hash (common.lua; memory: Store.trims)
    Reaper (every stall_check_s) ── TrimWatch.check() ── retention_trims() ──► deltas
        ├─► log.warning  cap trims: a queue meeting its count cap is a runaway queue, and
        │                jobs a user may still read went earlier than their time to live
        └─► trimmed      {"cap": n, "age": n} since this worker started

The scripts trim; this only reads what they recorded (one HMGET per check), so finishing a
job costs nothing more. The counts are the queue's (every worker of it sees the same
trims): across several workers, read them with ``max by (queue)``, not ``sum``.
"""

from __future__ import annotations

import math
import time

from sandboxq.backends.base import Backend
from sandboxq.errors import BackendError
from sandboxq.finished import Trims
from sandboxq.text import guarded_logger

log = guarded_logger("sandboxq.retention")

#: At most one log line about count-cap trims per this many seconds; the trims between
#: two lines are summed into the next one.
LOG_EVERY_S = 60.0


class TrimWatch:
    """Turns the queue's trim record into log lines and counts (see the module docstring)."""

    def __init__(self, backend: Backend, log_every_s: float = LOG_EVERY_S) -> None:
        self._backend = backend
        self._log_every_s = log_every_s
        self._last_log = -math.inf
        #: Jobs removed since this worker started: by the count cap, by age.
        self.trimmed: dict[str, int] = {"cap": 0, "age": 0}
        self._unlogged: dict[str, int] = {}
        self._seen: Trims | None = None
        self.check()  # what was trimmed before this worker started is not its news

    def check(self) -> None:
        """Read the trims; count what is new; log new cap trims unless one was just logged."""
        try:
            now = self._backend.retention_trims()
        except BackendError as exc:
            log.debug("could not read what retention removed: %s", exc)
            return
        seen, self._seen = self._seen, now
        if seen is None:
            return
        capped = 0
        for state, n in now.capped.items():
            new = n - seen.capped.get(state, 0)
            if new > 0:
                capped += new
                self._unlogged[state] = self._unlogged.get(state, 0) + new
        self._log_due(now)
        # Counted after the line: whoever sees the count finds the line written (a scrape
        # once read the count, and the log had no line yet).
        self.trimmed["cap"] += capped
        self.trimmed["age"] += max(0, now.expired - seen.expired)

    def _log_due(self, now: Trims) -> None:
        """Log the cap trims not logged yet, unless a line was logged within log_every_s."""
        if self._unlogged and time.monotonic() - self._last_log >= self._log_every_s:
            self._last_log = time.monotonic()
            told = Trims(
                capped=self._unlogged, caps=now.caps, capped_newest_ms=now.capped_newest_ms
            )
            self._unlogged = {}
            log.warning(
                "retention trimmed finished jobs by the queue's count cap, before their "
                "time to live: %s (raise retain_completed / retain_failed if they are "
                "still wanted)",
                told.describe(),
            )
