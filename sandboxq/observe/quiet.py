"""Warnings about an unreachable backend, at most one line per cause per ``WINDOW_S``.

    fetcher / heartbeat / reaper / registry ── log.warning("claim failed (%s)", exc)
        ──► OutageFilter on the worker's loggers: the first of a cause passes; the same
            cause again within WINDOW_S is counted, not printed; the first after the
            window passes with "(N more like this in the last 10 s)"

Why: with Redis down the fetcher retries with a short backoff, the heartbeat renews every
few seconds and the registry refreshes too, each logging its own line: the log filled
with the same sentence many times a second and buried the one line that said what broke.
A *cause* is the message template with the exceptions among its arguments (their class and
text), so "job X stalled" lines for different jobs, which carry no exception, are never
held back, and a new kind of failure is printed at once.
"""

from __future__ import annotations

import logging
import threading
import time

#: One line per distinct cause per this many seconds.
WINDOW_S = 10.0
#: The loggers of the worker's parts that report backend failures.
LOGGERS = (
    "sandboxq.worker",
    "sandboxq.heartbeat",
    "sandboxq.reaper",
    "sandboxq.backends.redis.listen",  # the cancellation watch retries every 0.5 s
)
#: Causes remembered at most (the oldest is forgotten first): outages have few causes.
MAX_CAUSES = 256


class OutageFilter(logging.Filter):
    """Lets one WARNING record per cause through per ``window_s``; counts the rest."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        super().__init__()
        self.window_s = window_s
        self._lock = threading.Lock()
        self._causes: dict[tuple[object, ...], list[float | int]] = {}  # [since, held back]

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING:
            return True
        args = record.args if isinstance(record.args, tuple) else ()
        errors = tuple(f"{type(a).__name__}: {a}" for a in args if isinstance(a, BaseException))
        if not errors:
            return True
        cause = (record.name, record.msg, errors)
        now = time.monotonic()
        with self._lock:
            seen = self._causes.get(cause)
            if seen is not None and now - seen[0] < self.window_s:
                seen[1] += 1
                return False
            held = int(seen[1]) if seen is not None else 0
            self._causes.pop(cause, None)
            self._causes[cause] = [now, 0]
            while len(self._causes) > MAX_CAUSES:
                del self._causes[next(iter(self._causes))]
        if held:
            record.msg = f"{record.msg} ({held} more like this in the last {self.window_s:g} s)"
        return True


_installed: OutageFilter | None = None
_install_lock = threading.Lock()


def install(loggers: tuple[str, ...] = LOGGERS) -> OutageFilter:
    """Put the one filter of this process on ``loggers`` (the worker's by default; the
    dashboard adds its own). Idempotent."""
    global _installed
    with _install_lock:
        if _installed is None:
            _installed = OutageFilter()
        for name in loggers:
            logger = logging.getLogger(name)
            if _installed not in logger.filters:
                logger.addFilter(_installed)
        return _installed
