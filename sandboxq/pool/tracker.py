"""multiprocess's resource tracker, seen from a pool: reaped as soon as it dies.

The worker process starts the tracker (with the first fork server) and is its parent.
Killed, it stayed a zombie under the worker until multiprocess next started a child, which
in a pool whose children live long may be never. So each supervisor selects on a pidfd
of it and reaps it when it dies, and has multiprocess forget it. Starting another is left
to multiprocess, which does so the next time anything registers with it:

    Spawner.follow_tracker() (after each start of a child, and at each wake of the
        supervisor) ──► a new tracker: the old pidfd out of the select, the new one in;
                        every other pool of the process woken to do the same
    supervisor select ──► that pidfd readable ──► reap(): waitid on the pidfd, one line
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import weakref
from collections.abc import Callable

from multiprocess import resource_tracker

from sandboxq.pool.kill import state
from sandboxq.pool.server import watch
from sandboxq.pool.waits import readable
from sandboxq.text import guarded_logger

log = guarded_logger("sandboxq.pool")


def tracker_pid() -> int | None:
    """The resource tracker this process started (None: it started none)."""
    pid = getattr(resource_tracker._resource_tracker, "_pid", None)
    return pid if isinstance(pid, int) else None


#: Every pool's watch in this process. The tracker is the process's, not one pool's: when
#: a start of one pool's child brings a new tracker, every pool follows it, as a pool
#: that is idle starts nothing and would never see it.
_watches: weakref.WeakSet[TrackerWatch] = weakref.WeakSet()
_watches_lock = threading.Lock()


def forget_the_parents() -> None:
    """In a process forked from one that holds pools: their watches are the parent's (and
    the lock another thread of the parent held at the fork would stay held here)."""
    global _watches, _watches_lock
    _watches, _watches_lock = weakref.WeakSet(), threading.Lock()


class TrackerWatch:
    """A pidfd on the resource tracker (``fd``, for the supervisor's select); ``wake``
    asks the supervisor to look again (``Spawner.follow_tracker``), from any thread."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self.pid: int | None = None
        self.fd: int | None = None
        self._wake = wake
        with _watches_lock:
            _watches.add(self)

    def changed(self) -> int | None:
        """The tracker's pid when it is not the one watched (None: the same, or none)."""
        current = tracker_pid()
        return current if current is not None and current != self.pid else None

    def follow(self, pid: int) -> int | None:
        """Watch tracker ``pid`` instead (the caller has taken the old fd out of its
        select); returns the fd to select on, and wakes every other pool to follow."""
        self.close()
        self.pid, self.fd = pid, watch(pid)
        with _watches_lock:
            others = [w for w in _watches if w is not self]
        for other in others:
            other._wake()
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

    def retire(self) -> None:
        """Close, and leave the pools woken on a new tracker: this one's supervisor is
        ending, and its wake pipe closes after it. A tracker someone stopped is continued
        first: stopped, it would never see its pipe end when the worker exits, and would
        stay behind, stopped, under init."""
        if self.fd is not None and self.pid is not None and state(self.pid) in (b"T", b"t"):
            with contextlib.suppress(OSError):  # through its pidfd: never a reused pid
                signal.pidfd_send_signal(self.fd, signal.SIGCONT)
        self.close()
        with _watches_lock:
            _watches.discard(self)
