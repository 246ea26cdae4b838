"""Process-tree kill and memory sampling: the pool's only use of psutil.

``sweep`` is the one place a tree is killed, whoever asks: the supervisor at a deadline or
kill (the child and its tree), the child itself after every attempt (its own tree, then it
reaps), the supervisor after a child died on its own (the orphans it left, now below the
fork server), and the fork server when the worker died (everything below it). Where each
child has a control group of its own (containment.py), the group is killed instead of the
child's tree: the supervisor's kills go to ``cgroups.Group.kill`` (every process in the
group, wherever it moved in the tree), and the child empties its group after each attempt
(``limits.wrap``) before its own sweep. The orphan sweeps still walk trees here.

How a sweep cannot be outrun: every process found is sent SIGSTOP, and the tree is walked
again until a walk finds nothing new. A stopped process cannot fork, so the walk ends even
under a fork bomb; then every process found gets SIGKILL, group leader or not, and the
sweep waits (bounded) until each one is dead or a zombie, so a caller that reports an
outcome after it reports one whose processes are gone. A fork already in progress when
SIGSTOP arrives does complete, its child not stopped (measured on Linux 6.18: a process
forking in a loop, stopped, then listed, had a child more once it was stopped in 132 of
300 tries): the next walk finds that child. After the last walk, a fork still in progress
is abandoned once its parent's SIGKILL is pending; one that completes between the last
read of its parent's list and that SIGKILL is missed. Such a child is still killed when it
is in the root's process group (killed whole); a process that left that group and forks at
that very moment is the case left (not seen in 20 tries of a setsid'd process forking in
a loop beside 300 others).

Escapees stay findable: a pool child is a subreaper (``PR_SET_CHILD_SUBREAPER``), so a
daemonised grandchild (setsid, fork, the middle exits) is re-parented to the child and
still walks as its descendant; if the child itself dies first, they are re-parented to
the fork server (a subreaper too), where the supervisor's orphan sweep finds them.

The walk reads ``/proc/<pid>/task/<tid>/children`` for the tree's own members where the
kernel has it: psutil's ``children()`` reads every process on the machine to find a
parent's, which took 2 to 3 ms here, most of a hard kill's delay and of a memory sample.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable

import psutil

#: Whether this kernel keeps per-thread children lists (CONFIG_PROC_CHILDREN).
_CHILDREN_LISTS = os.path.exists(f"/proc/self/task/{os.getpid()}/children")


def _read(path: str) -> bytes:
    # os.open/os.read: a file object costs more than the read (measured below). Until an
    # empty read: a children list gives at most a page a read (some 800 pids).
    fd = os.open(path, os.O_RDONLY)
    try:
        data = b""
        while chunk := os.read(fd, 65536):
            data += chunk
        return data
    finally:
        os.close(fd)


def _own_children(pid: int) -> list[int]:
    """The direct children of ``pid`` from the kernel's per-thread lists ([] if gone).

    ``/proc/<pid>/task``'s link count is 2 plus the process's threads: a process with one
    thread has one list, read without listing the directory. (A first thread that exited
    while others live on still counts until the process ends: its directory stays, and
    the others' lists are read.) Per process of a 200-fork burst here, a walk took 26 us
    with a listing and file objects, 18 us without either.
    """
    try:
        threads = os.stat(f"/proc/{pid}/task").st_nlink - 2
    except OSError:
        return []  # gone: its children, if any, were re-parented
    if threads == 1:
        try:
            return [int(p) for p in _read(f"/proc/{pid}/task/{pid}/children").split()]
        except OSError:
            pass  # it ended meanwhile: the listing below finds that out
    found: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tids:
        try:
            found += [int(p) for p in _read(f"/proc/{pid}/task/{tid}/children").split()]
        except OSError:
            continue  # the thread or the process ended while we looked
    return found


def children_of(pid: int) -> list[int]:
    """The direct children of ``pid`` (zombies included)."""
    if not _CHILDREN_LISTS:
        try:
            return [p.pid for p in psutil.Process(pid).children()]
        except psutil.Error:
            return []
    return _own_children(pid)


def descendant_pids(pid: int) -> list[int]:
    """Pids below ``pid``, read from the kernel's per-thread children lists."""
    found: list[int] = []
    todo = [pid]
    while todo:
        kids = _own_children(todo.pop())
        found += kids
        todo += kids
    return found


def descendants(pid: int) -> list[psutil.Process]:
    """The processes below ``pid`` (children, grandchildren...), alive when looked at."""
    if not _CHILDREN_LISTS:
        try:
            return psutil.Process(pid).children(recursive=True)
        except psutil.Error:
            return []
    procs = []
    for child in descendant_pids(pid):
        try:
            procs.append(psutil.Process(child))
        except psutil.Error:
            pass  # ended while we looked
    return procs


#: How long a sweep waits for the processes it killed to be gone: SIGKILL is delivered at
#: once, but a process in an uninterruptible wait (disk, NFS) ends only when that returns.
SWEEP_WAIT_S = 1.0


def _stat(pid: int) -> list[bytes]:
    """The fields of /proc/<pid>/stat after the name (state, parent pid, ...); empty
    when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return []
    # the name in parentheses may hold anything, spaces and parentheses too
    return stat[stat.rindex(b")") + 2 :].split()


def state(pid: int) -> bytes:
    """The process's state letter from /proc (R, S, D, T, t, Z, X; b"" when it is gone)."""
    fields = _stat(pid)
    return fields[0] if fields else b""


def stopped_state(pid: int) -> str | None:
    """``"T"`` if the process is stopped by a signal (SIGSTOP, SIGTSTP...), ``"t"`` if by a
    tracer, else None (running, sleeping, or gone)."""
    now = state(pid)
    return now.decode() if now in (b"T", b"t") else None


def parent(pid: int) -> int | None:
    """The process's parent pid from /proc (None when it is gone)."""
    fields = _stat(pid)
    return int(fields[1]) if fields else None


def ended(pid: int) -> bool:
    """Gone, or a zombie (dead; only its exit status is left for its parent to reap)."""
    return state(pid) in (b"", b"Z", b"X")


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def stop(pid: int, timeout_s: float = 0.5) -> bool:
    """SIGSTOP ``pid`` and wait until it is stopped (False if it did not stop in time: it
    is then resumed). It takes a scheduled moment of the process, so on a loaded machine
    the bound is generous; a process in an uninterruptible wait does not stop at all."""
    _signal(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = state(pid)
        if not now:
            return False
        if now in (b"T", b"t"):
            return True
        time.sleep(0.0002)
    resume(pid)
    return False


def resume(pid: int) -> None:
    _signal(pid, signal.SIGCONT)


def sweep(root: int, *, include_root: bool = True, known: Iterable[psutil.Process] = ()) -> int:
    """Stop, then SIGKILL, every process below ``root`` (and ``root`` itself when
    ``include_root``), and ``known`` processes; wait until they are gone. Returns how many
    processes were killed (``root`` included).

    ``known`` are descendants seen earlier (by memory sampling) that may have been
    re-parented since. psutil refuses to signal a process whose pid was reused, so a
    stale entry can never hit an unrelated process.
    """
    if not _CHILDREN_LISTS:  # no per-thread children lists: psutil's slower walk, unfrozen
        _kill_known((*descendants(root), *known))
        if include_root:
            _signal(root, signal.SIGKILL)
        return 0
    stopped = kill_stopped(root, include_root=include_root, known=known)
    _wait_ended(list(stopped))
    return len(stopped)


def kill_stopped(
    root: int, *, include_root: bool, known: Iterable[psutil.Process] = ()
) -> set[int]:
    """``stop_tree``, then SIGKILL every process it stopped, each of ``known`` not among
    them (re-parented out of the tree since it was seen), and, with ``root``, its process
    group (a member not yet forked when walked). Returns the pids stopped; none waited for."""
    stopped = stop_tree(root, include_root)
    for pid in stopped:
        _signal(pid, signal.SIGKILL)
    # psutil checks each known process's start time before it signals (a read of /proc
    # each): the ones stopped above were killed already
    _kill_known(proc for proc in known if proc.pid not in stopped)
    if include_root:
        try:
            os.killpg(root, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return stopped


def stop_tree(root: int, include_root: bool) -> set[int]:
    """SIGSTOP ``root`` (when included) and every process below it, walking again until a
    walk finds nobody new: a stopped process forks no more. Returns the pids stopped."""
    stopped: set[int] = set()
    if include_root:
        _signal(root, signal.SIGSTOP)
        stopped.add(root)
    while new := [pid for pid in descendant_pids(root) if pid not in stopped]:
        for pid in new:
            _signal(pid, signal.SIGSTOP)
        stopped.update(new)
    return stopped


def _kill_known(procs: Iterable[psutil.Process]) -> None:
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass


def _wait_ended(waiting: list[int]) -> None:
    """Wait (up to ``SWEEP_WAIT_S``) until every pid in ``waiting`` has ended."""
    # One process at a time: re-reading every /proc entry on each turn would take the CPU
    # that the kernel needs to tear the 200 processes of a burst down.
    deadline = time.monotonic() + SWEEP_WAIT_S
    while waiting and time.monotonic() < deadline:
        if ended(waiting[-1]):
            waiting.pop()
        else:
            time.sleep(0.0005)


def kill_tree(pid: int, known: Iterable[psutil.Process] = ()) -> None:
    """SIGKILL ``pid`` and its whole tree (``sweep``), and ``known`` processes."""
    sweep(pid, include_root=True, known=known)


def sweep_own_tree() -> int:
    """Kill and reap every process below this one (a subreaper): what an attempt left.

    The common case, no child at all, costs one ``waitpid``. Returns how many were killed.
    """
    killed = 0
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return killed  # nothing below us, alive or zombie
        if pid:
            continue  # reaped one: look again
        killed += sweep(os.getpid(), include_root=False)
        # Everything found is dead now; the zombies are reaped on the next turns. A child
        # stuck past the sweep's wait is swept again rather than waited for blindly.


def tree_rss(pid: int) -> tuple[int, list[psutil.Process]]:
    """Resident memory of ``pid`` and its descendants in bytes, and the descendants seen."""
    try:
        root = psutil.Process(pid)
        tree = descendants(pid)
    except psutil.Error:
        return 0, []
    total = 0
    for proc in (root, *tree):
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            pass
    return total, tree
