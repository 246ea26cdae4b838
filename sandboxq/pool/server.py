"""The fork server as the supervisors see it: which of its children are pool children,
the orphans it holds, and its death.

    launch (spawn) ──► register(pid) ─┐        a pool child dies on its own (os._exit, a
                                      ▼        segfault): what it started is re-parented
    fork server (a subreaper) ── children ──►  to the fork server → sweep_orphans() kills
                                      ▲        every child of the fork server that no pool
    forget(pid) ◄── the child ended ──┘        of this process registered; so does
                                               sweep_escaped(), after each attempt in the
                                               process-tree mode, when it finds one (a
                                               handler's clone(CLONE_PARENT)), and
                                               kill_escaped() at a deadline kill

One fork server serves every pool of a process, so the registry is module-wide and a
spawn holds its lock from the fork until the pid is registered: an orphan sweep running
in another pool's supervisor never mistakes a child being born for an orphan. A process
that uses multiprocess's forkserver context for its own processes, beside sandboxq, shares
this fork server and would see those processes swept as orphans: the fork server is the
pool's. Processes the fork server started itself before its first pool child (a helper a
preloaded module starts at import) are its own, and left alone.

``watch()`` gives a pidfd that becomes readable when the fork server dies, so a supervisor
notices in its select, within milliseconds, and can start a fresh one.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from multiprocess import forkserver

from sandboxq.pool.kill import children_of, ended, kill_stopped, state, sweep
from sandboxq.pool.waits import readable

_lock = threading.Lock()
_pool_children: set[int] = set()
#: Per fork server, the processes it had started itself (a preloaded module may start a
#: helper at import) before its first pool child: never orphans.
_own: dict[int, set[int]] = {}
#: How long ``sweep_orphans`` goes on sweeping while orphans are still alive (a process in
#: an uninterruptible wait dies only when that wait returns).
ORPHAN_WAIT_S = 1.0


@contextmanager
def spawning() -> Iterator[None]:
    """Hold while a child is forked and until ``register`` has recorded it."""
    with _lock:
        yield


def register(child: int) -> None:
    """Record a pool child (call inside ``spawning``)."""
    _pool_children.add(child)
    server = pid()
    if server is not None and server not in _own:
        _own[server] = set(children_of(server)) - _pool_children


def forget(pid: int) -> None:
    with _lock:
        _pool_children.discard(pid)


def pid() -> int | None:
    """The running fork server's pid, if this process started one."""
    found: int | None = forkserver._forkserver._forkserver_pid
    return found


def forget_the_parents() -> None:
    """In a process forked from one that holds pools: the fork server, and the pool
    children it lists, are the parent's. multiprocess would go on using that server,
    whose children are not ours to wait for, and every Pool made here was broken
    ("no child could be started: ChildProcessError"); forgotten, the first Pool made
    here starts a fork server of its own. The parent's server is left running."""
    global _list_fd, _clean_list, _lock
    server = forkserver._forkserver
    # Right after a fork this thread is the only one: a lock another thread of the
    # parent held at the fork would stay held here for good, so each is made anew.
    server._lock, _lock = threading.Lock(), threading.Lock()
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)  # our copy: the parent keeps its own
    server._forkserver_address = server._forkserver_alive_fd = None
    server._forkserver_pid = None
    _pool_children.clear()
    _own.clear()
    if _list_fd is not None:
        os.close(_list_fd[1])
    _list_fd = _clean_list = None


def sweep_orphans() -> int:
    """Kill every process below the fork server that is not a registered pool child (what
    children that died on their own left behind), and wait (up to ``ORPHAN_WAIT_S``, plus
    the last sweep's own wait) until none is left alive. Returns how many were killed."""
    server = pid()
    if server is None:
        return 0
    killed = clean = 0
    deadline = time.monotonic() + ORPHAN_WAIT_S
    with _lock:
        own = _own.get(server, set())
        # Why a loop: a sweep waits only for the processes its walk found, and an orphan
        # that dies (a killed fork bomb dies from the top) hands its children to the fork
        # server, possibly after we read its list and before the walk reached them: they
        # were left dying, still running when the outcome was reported (design invariant
        # 10). A process hands its children over before it becomes a zombie, so once the
        # fork server's list holds nothing alive, nothing of the attempt is. The list is
        # read one entry at a time while the fork server reaps, which can skip one: two
        # clean reads in a row.
        while clean < 2 and time.monotonic() < deadline:
            orphans = [
                orphan
                for orphan in children_of(server)
                if orphan not in _pool_children and orphan not in own and not ended(orphan)
            ]
            clean = 0 if orphans else clean + 1
            for orphan in orphans:
                killed += sweep(orphan)
    return killed


def _escaped() -> list[int]:
    """The fork server's children that are neither pool children nor its own: what left
    a child's tree (a handler's clone(CLONE_PARENT), or a daemon once it turned its
    subreaper flag off). The common case costs one read of the fork server's children
    list, from a descriptor held open, the same bytes as at the last look that found only
    pool children (about 2 us; opening the file each time cost 8, and parsing it each
    time lowered the pool's no-op throughput by 8 %); a list that changed is read twice."""
    global _clean_list
    server = pid()
    if server is None:
        return []
    listed = _children_list(server)
    if listed is not None and listed == _clean_list:
        return []  # nobody came or went since the last look found no one of the kind
    # A list read while it changes can skip an entry: the kernel's children lists hold
    # only for stopped children, and one reaped as the list is read (the child a deadline
    # kill just killed) can hide the next, the very process that escaped. So a changed
    # list is read twice, and what either read holds is looked at.
    again = _children_list(server)
    with _lock:  # a child being forked is registered before this can look
        own = _own.get(server, set())
        reads = (listed, again)
        whole = all(r is not None and len(r) < _LIST_MAX for r in reads)  # else a page, or none
        found = {int(p) for r in reads if r for p in r.split()} if whole else children_of(server)
        escaped = sorted(p for p in found if p not in _pool_children and p not in own)
        if not escaped and whole and listed == again:
            _clean_list = listed
    return escaped


def sweep_escaped() -> int:
    """After an attempt in the process-tree mode: kill what escaped its child's tree, and
    wait until it is gone. Returns how many were killed."""
    if not any(not ended(p) for p in _escaped()):
        return 0
    return sweep_orphans()


def kill_escaped() -> None:
    """At a deadline kill in the process-tree mode: SIGKILL what escaped the child's tree,
    stopping each tree first and waiting for nothing (teardown.py says why). A process
    already stopped is left alone: the tree of a child killed a moment before, handed to
    the fork server as that child died, its SIGKILLs pending; sweeping it again made
    another child's deadline kill 85 ms late."""
    for orphan in _escaped():
        if state(orphan) not in (b"T", b"t", b"Z", b"X", b""):
            kill_stopped(orphan, include_root=True)


#: How much of a children list one read takes (the kernel gives at most a page a read).
_LIST_MAX = 4096
#: The fork server whose children list is held open, and the descriptor.
_list_fd: tuple[int, int] | None = None
#: The last children list ``sweep_escaped`` found holding only pool children.
_clean_list: bytes | None = None


def _children_list(server: int) -> bytes | None:
    """The fork server's children list, read from a descriptor kept open for it; None
    when it cannot be read. Under ``_lock``: the supervisors of every pool of the process
    share the descriptor, and one may close it (a new fork server) while another reads."""
    global _list_fd
    with _lock:
        if _list_fd is None or _list_fd[0] != server:
            if _list_fd is not None:
                os.close(_list_fd[1])
                _list_fd = None
            try:
                path = f"/proc/{server}/task/{server}/children"
                _list_fd = (server, os.open(path, os.O_RDONLY | os.O_CLOEXEC))
            except OSError:
                return None
        try:
            return os.pread(_list_fd[1], _LIST_MAX, 0)
        except OSError:  # that fork server is gone (its pid may come back): open anew then
            os.close(_list_fd[1])
            _list_fd = None
            return None


def watch(server: int) -> int | None:
    """A pidfd that becomes readable when ``server`` exits (None where the kernel has no
    pidfd_open, or the process is already gone)."""
    try:
        return os.pidfd_open(server)
    except (AttributeError, OSError):
        return None


#: The fork server may die this many times within DEATH_WINDOW_S, with no attempt running
#: to blame, before a pool gives up (``PoolBroken``): an OOM killer that picks it on every
#: restart must not loop forever. A death under running attempts is charged to their jobs
#: instead (design invariant 11), which stops a job that keeps causing it.
MAX_DEATHS = 3
DEATH_WINDOW_S = 60.0


class Watch:
    """One supervisor's view of the fork server its children come from: a pidfd on it
    (``fd``, for the supervisor's select) and the recent deaths."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self.fd: int | None = None
        self._deaths: list[float] = []
        #: Fork servers followed after the first: each one replaced a dead one.
        self.restarts = 0

    def follow(self) -> int | None:
        """Watch the current fork server; returns a new fd to select on, when it changed."""
        current = pid()
        if current is None or current == self.pid:
            return None
        self.close()
        if self.pid is not None:
            self.restarts += 1
        self.pid, self.fd = current, watch(current)
        return self.fd

    def is_dead(self, wait_s: float = 0.0) -> bool:
        """Whether the watched fork server has exited (waiting up to ``wait_s`` for it)."""
        if self.fd is None:
            return False
        return readable(self.fd, wait_s)

    def how(self) -> str:
        """How the watched fork server ended, in words (read without reaping it: that is
        multiprocess's to do when it starts the next one)."""
        try:
            assert self.fd is not None
            info = os.waitid(os.P_PIDFD, self.fd, os.WEXITED | os.WNOWAIT | os.WNOHANG)
        except (AssertionError, AttributeError, OSError):
            return "died"
        if info is None:
            return "died"
        if info.si_code == os.CLD_EXITED:
            return f"exited with code {info.si_status}"
        try:
            name = signal.Signals(info.si_status).name
        except ValueError:
            name = f"signal {info.si_status}"
        return f"was killed by {name}"

    def died(self, now: float) -> int:
        """Record a death no attempt is to blame for at ``now``; returns how many fell
        within the window."""
        self._deaths = [t for t in self._deaths if now - t < DEATH_WINDOW_S] + [now]
        return len(self._deaths)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
        self.fd = None
