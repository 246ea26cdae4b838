"""The worker's background threads: one skeleton for the heartbeat, the registry refresh,
the reaper, the fetcher and the progress writer.

    start() ─► loop() on a daemon thread ─┬─ returns once stop() is asked
                                          └─ raises ─► died = the cause, logged once
    dead_thread() ─► the cause, when the thread ended before stop(): the dispatcher's
                     watch fails the worker with it (and hands its jobs back)

Daemons, because a thread blocked in a hung backend cannot be interrupted: the worker's
exit deadline is kept by joining with a timeout, and what is left ends with the process.
"""

from __future__ import annotations

import threading

from sandboxq.text import guarded_logger

log = guarded_logger("sandboxq.worker")


class BackgroundThread:
    """Subclasses give ``loop``; it returns when ``stopped`` is set (or, for a thread that
    ends on purpose, ``ended_on_purpose`` says so)."""

    def __init__(self, name: str, stopped: threading.Event | None = None) -> None:
        self.name = name
        #: Set by ``stop()``; ``loop`` waits on it between rounds. It may be shared: the
        #: fetcher's is the worker's own stop request, so it ends when the worker stops.
        self.stopped = stopped or threading.Event()
        #: Why the thread died (``repr`` of what it raised), or None.
        self.died: str | None = None
        self._thread = threading.Thread(target=self._run, name=f"sandboxq-{name}", daemon=True)

    def loop(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float | None = None) -> None:
        """Ask the thread to end and wait at most ``timeout_s`` for it."""
        self.stopped.set()
        self.join(timeout_s)

    def join(self, timeout_s: float | None = None) -> None:
        if self._thread.ident is not None:
            self._thread.join(timeout_s)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def ended_on_purpose(self) -> bool:
        return self.stopped.is_set()

    def dead_thread(self) -> str | None:
        """The cause, if the thread was started and ended without being asked to."""
        if self._thread.ident is None or self._thread.is_alive() or self.ended_on_purpose():
            return None
        return f"the {self.name} thread died: {self.died or 'it returned'}"

    def _run(self) -> None:
        try:
            self.loop()
        except BaseException as exc:
            log.exception("the %s thread crashed", self.name)
            self.died = repr(exc)
            self.crashed()

    def crashed(self) -> None:
        """Called on the thread after ``loop`` raised (``died`` is set)."""
