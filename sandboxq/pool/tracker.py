"""multiprocess's resource tracker, seen from a pool: reaped as soon as it dies.

The worker process starts the tracker (with the first fork server) and is its parent.
Killed, it stayed a zombie under the worker until multiprocess next started a child, which
in a pool whose children live long may be never. So each supervisor selects on a pidfd
of it and reaps it when it dies, and has multiprocess forget it. Starting another is left
to multiprocess, which does so the next time anything registers with it:

    Spawner.follow_server() ──► TrackerWatch.follow(): a pidfd, when the tracker changed
    supervisor select ──► that pidfd readable ──► reap(): waitid on the pidfd, one line
"""

from __future__ import annotations

import os

from multiprocess import resource_tracker

from sandboxq.pool.server import watch
from sandboxq.pool.waits import readable
from sandboxq.text import guarded_logger

log = guarded_logger("sandboxq.pool")


def tracker_pid() -> int | None:
    """The resource tracker this process started (None: it started none)."""
    pid = getattr(resource_tracker._resource_tracker, "_pid", None)
    return pid if isinstance(pid, int) else None


class TrackerWatch:
    """A pidfd on the resource tracker (``fd``, for the supervisor's select)."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self.fd: int | None = None

    def follow(self) -> int | None:
        """Watch the current tracker; returns a new fd to select on, when it changed."""
        current = tracker_pid()
        if current is None or current == self.pid:
            return None
        self.close()
        self.pid, self.fd = current, watch(current)
        return self.fd

    def dead(self) -> bool:
        return self.fd is not None and readable(self.fd, 0.0)

    def reap(self) -> None:
        """Reap the dead tracker, that process and no other, and stop watching it.

        multiprocess is told to forget it too: at its next start it would wait for that
        pid again, which by then may number another child of ours (a wait that blocks
        the start for as long as that child lives), and warn, which under ``-W error``
        failed that start of a child. Forgotten, it starts a new tracker with neither."""
        assert self.fd is not None
        tracker = resource_tracker._resource_tracker
        with tracker._lock:
            try:
                os.waitid(os.P_PIDFD, self.fd, os.WEXITED | os.WNOHANG)
            except ChildProcessError:
                pass  # not ours (a forked copy's view of its parent's), or reaped already
            else:
                if tracker._pid == self.pid:
                    if tracker._fd is not None:
                        os.close(tracker._fd)
                    tracker._fd = tracker._pid = None
                log.warning(
                    "the resource tracker (pid %s) died; reaped: another starts with the "
                    "pool's next child",
                    self.pid,
                )
        self.close()

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
        self.fd = None
