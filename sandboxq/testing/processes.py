"""Finding processes a test left behind: the pytest-free half of the plugin's orphan check.

    snapshot = descendants()          # before the test
    ... the test runs workers, pools, children, grandchildren ...
    leaked = survivors(snapshot)      # after: new descendants still alive, after a grace

Shared helpers that outlive every test on purpose are not counted: the fork server (one
per process, started by the first pool; the children it forks *are* counted), the
resource tracker, and the redis-servers ``RedisServer`` started (by pid: a process that
only names redis-server is counted). Orphaned grandchildren stay visible: the fork server
is a child subreaper (see ``sandboxq.pool.forkserver_hooks``), so a grandchild whose
parent died is re-parented to it and still descends from this process; the plugin makes
this process one too while it checks a test (a daemon the test itself double-forked).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable

import psutil

from sandboxq.pool.kill import descendants as _tree
from sandboxq.pool.kill import ended
from sandboxq.pool.linux import become_subreaper
from sandboxq.testing import redis_server

#: Long-lived helpers started by the test process itself (directly, not by a child).
_SHARED_DIRECT = ("multiprocess.forkserver", "multiprocessing.forkserver", "resource_tracker")


def _is_shared(pid: int, cmdline: str, ppid: int) -> bool:
    if pid in redis_server.started_pids():  # a server the suite keeps for the session
        return True
    # A pool child forked by the fork server carries the fork server's command line, so
    # only the fork server itself, a direct child of ours, is shared.
    return ppid == os.getpid() and any(name in cmdline for name in _SHARED_DIRECT)


def descendants() -> dict[int, str]:
    """Live descendants of this process (pid → command line), shared helpers excluded."""
    found: dict[int, str] = {}
    for proc in _tree(os.getpid()):
        try:
            if proc.status() == "zombie":
                continue  # dead already; only its parent's bookkeeping is left
            cmdline = " ".join(proc.cmdline()) or proc.name()
            ppid = proc.ppid()
        except Exception:  # it ended while we looked: not a survivor
            continue
        if not _is_shared(proc.pid, cmdline, ppid):
            found[proc.pid] = cmdline
    return found


def survivors(
    before: dict[int, str] | set[int], grace_s: float = 5.0, ignoring: Iterable[str] = ()
) -> dict[int, str]:
    """Descendants that were not in ``before`` and are still alive after ``grace_s``,
    except those whose command line contains one of ``ignoring``.

    The grace covers processes already being killed or reaped when the test ended; it is
    only spent when something is still there, so a clean test pays nothing.
    """
    ignoring = tuple(ignoring)
    deadline = time.monotonic() + grace_s
    while True:
        left = {
            pid: cmd
            for pid, cmd in descendants().items()
            if pid not in before and not any(name in cmd for name in ignoring)
        }
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def reap_adopted(before: dict[int, str] | set[int]) -> None:
    """After a check: reap the children of this process that ended and were not there
    ``before`` (daemons re-parented here while it was a subreaper, killed or exited), and
    stop being a subreaper."""
    try:
        children = psutil.Process().children()
    except psutil.Error:
        children = []
    for child in children:
        if child.pid in before:
            continue
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                os.waitpid(child.pid, os.WNOHANG)
        except (psutil.Error, ChildProcessError):
            pass
    become_subreaper(on=False)


def still_running(pids: Iterable[int]) -> list[int]:
    """Those of ``pids`` that can still run an instruction of their own: not a zombie, not
    exiting, no SIGKILL pending (a killed process, frozen or stopped until the kernel gets
    to it, runs no more code: a deadline kill reports its outcome then, teardown.py)."""
    return [pid for pid in pids if not ended(pid) and not _doomed(pid)]


#: /proc/<pid>/stat flags: the task is exiting.
_PF_EXITING = 0x4


def _doomed(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        with open(f"/proc/{pid}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return True  # gone
    pending = int(status["SigPnd"], 16) | int(status["ShdPnd"], 16)
    return bool(int(fields[6]) & _PF_EXITING or pending & (1 << (signal.SIGKILL - 1)))


def describe(leaked: dict[int, str]) -> str:
    """A readable list of leaked processes, one per line."""
    return "\n".join(f"  pid {pid}: {cmd[:200]}" for pid, cmd in sorted(leaked.items()))


def frozen_order(worker: int) -> list[int]:
    """``worker`` and every process below it, in the order a test freezes a whole worker
    (SIGSTOP to each): the pool's guards first, since they act on the others, then the
    worker, then the rest. Stopped one by one, a tree is not frozen at once: a guard still
    running while its worker is stopped would stop the children and fence them at their
    deadline, which is its job, but not what a test of a whole frozen machine asks."""
    below = _tree(worker)
    guards = [p.pid for p in below if "guard_process" in _cmdline(p)]
    return [*guards, worker, *(p.pid for p in below if p.pid not in guards)]


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def in_namespace_of(pid: int, inner: Iterable[int]) -> list[int]:
    """The pids, as this process sees them, of ``inner``: pids in ``pid``'s own PID
    namespace (what a handler sees and records with ``pid_namespace=True``) of processes
    below ``pid``; those gone are left out. Found by each one's ``NSpid`` (its pid in
    every namespace it is in, its own last), readable by anyone: a child is undumpable,
    so its ``/proc/<pid>/ns`` is not, to a process without CAP_SYS_PTRACE."""
    wanted = set(inner)
    found = []
    try:
        below = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
    for proc in below:
        try:
            with open(f"/proc/{proc.pid}/status") as f:
                nspid = next(line for line in f if line.startswith("NSpid:")).split()
        except (OSError, StopIteration):
            continue
        if int(nspid[-1]) in wanted:
            found.append(proc.pid)
    return found
