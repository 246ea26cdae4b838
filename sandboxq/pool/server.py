"""The fork server as the supervisors see it: which of its children are pool children,
the orphans it holds, and its death.

    launch (spawn) ──► register(pid) ─┐        a pool child dies on its own (os._exit, a
                                      ▼        segfault): what it started is re-parented
    fork server (a subreaper) ── children ──►  to the fork server → sweep_orphans() kills
                                      ▲        every child of the fork server that no pool
    forget(pid) ◄── the child ended ──┘        of this process registered

One fork server serves every pool of a process, so the registry is module-wide and a
spawn holds its lock from the fork until the pid is registered: an orphan sweep running
in another pool's supervisor never mistakes a child being born for an orphan. A process
that uses multiprocess's forkserver context for its own processes, beside sandboxq, shares
this fork server and would see those processes swept as orphans: the fork server is the
pool's.

``watch()`` gives a pidfd that becomes readable when the fork server dies, so a supervisor
notices in its select, within milliseconds, and can start a fresh one.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from sandboxq.pool.kill import children_of, sweep

_lock = threading.Lock()
_pool_children: set[int] = set()


@contextmanager
def spawning() -> Iterator[None]:
    """Hold while a child is forked and until ``register`` has recorded it."""
    with _lock:
        yield


def register(pid: int) -> None:
    """Record a pool child (call inside ``spawning``)."""
    _pool_children.add(pid)


def forget(pid: int) -> None:
    with _lock:
        _pool_children.discard(pid)


def pid() -> int | None:
    """The running fork server's pid, if this process started one."""
    from multiprocess import forkserver

    found: int | None = forkserver._forkserver._forkserver_pid
    return found


def sweep_orphans() -> int:
    """Kill every process below the fork server that is not a registered pool child (what
    children that died on their own left behind). Returns how many were killed."""
    server = pid()
    if server is None:
        return 0
    killed = 0
    with _lock:
        for orphan in children_of(server):
            if orphan not in _pool_children:
                killed += sweep(orphan)
    return killed


def watch(server: int) -> int | None:
    """A pidfd that becomes readable when ``server`` exits (None where the kernel has no
    pidfd_open, or the process is already gone)."""
    try:
        return os.pidfd_open(server)
    except (AttributeError, OSError):
        return None
