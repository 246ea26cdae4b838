"""A PID namespace per child (``pid_namespace=True``): whatever a handler starts, the
kernel ends when its child ends, and every child ends with its fork server.

    fork server ─► outer: the process the pool started (its pid is the guard's, its
                   │      sentinel and exit code the pool's); unshare(CLONE_NEWPID), fork
                   ▼
                   reaper: pid 1 of the new namespace, in a mount namespace whose /proc
                   │       is that namespace's (privileges.own_proc); fork
                   ▼
                   child: pid 2; child_main goes on here and runs the handler

    the child ends (returns, exit N, a signal) ──► the reaper reaps it, hands its wait
        status to the outer and exits: the kernel kills every other process of the
        namespace before the reaper is gone ──► the outer ends the same way (exit N, or
        the same signal), so the pool reads the child's ending as it always did
    the outer dies (SIGKILL, its fork server's death: parent-death signal) ──► the reaper
        gets SIGKILL (its own parent-death signal) ──► the namespace ends, all of it

Why three processes: a process that unshared its PID namespace for its children can no
longer start a thread (the kernel refuses CLONE_THREAD there), so the handler must run
inside the namespace; and not as its first process, which ignores every signal its own
namespace sends it without a handler installed (a handler's
``os.kill(os.getpid(), SIGKILL)`` would do nothing).

A worker that is not root gets the namespace inside a user namespace the outer makes
(privileges.new_pid_namespace: its uid and gid map to themselves), and the child gives up
the capabilities that user namespace gave it.

After each attempt the child kills whatever else lives in its namespace but the reaper
(``sweep_namespace``): what a handler started with ``clone(CLONE_PARENT)`` is the
reaper's child, outside the child's own tree.

The parent learns the child's pid in its own namespace at ``Ready`` (``inner_pid``):
signals (soft timeout, stack dumps, withdrawals) and memory sampling go there; kills of
the child's tree, and the guard's of the outer's, reach the same processes. Inside, the
handler sees the namespace's pids (its own is 2) and a /proc that holds only those.
"""

from __future__ import annotations

import os
import resource
import signal
import struct
import time
from typing import NoReturn

from sandboxq.pool import linux
from sandboxq.pool.kill import SWEEP_WAIT_S, children_of, ended, sweep
from sandboxq.pool.privileges import Privileges, drop, new_pid_namespace, own_proc
from sandboxq.pool.waits import readable

_STATUS = struct.Struct("i")  # a wait status, from the reaper to the outer
#: Whether this process is the child of a namespace of its own (``enter`` returned).
_inside = False


def enter() -> None:
    """In the process the pool started, first thing: make the namespace, its reaper and
    the child. Returns in the child only (pid 2 of the namespace); the outer and the
    reaper end in here."""
    new_pid_namespace()
    try:
        watch: int | None = os.pidfd_open(os.getpid())  # the reaper's view of the outer
    except OSError:  # before Linux 5.3: the outer's death before the fork goes unseen
        watch = None
    readable, writable = os.pipe()
    reaper = os.fork()
    if reaper:
        if watch is not None:
            os.close(watch)
        os.close(writable)
        _outer(reaper, readable)
    os.close(readable)
    _reap(watch, writable)


def _outer(reaper: int, status_pipe: int) -> NoReturn:
    """Wait for the reaper, then end as the child ended."""
    try:
        # Only SIGKILL and SIGSTOP reach it: a stray signal meant for the child must not
        # end the namespace.
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        if not linux.die_with_parent(signal.SIGKILL):
            os._exit(1)  # the fork server is gone already: so is everything below
        _close_all_but(status_pipe)  # the child's channel and pipes end with the child
        _, reaper_status = os.waitpid(reaper, 0)
        said = os.read(status_pipe, _STATUS.size)
        _end_as(_STATUS.unpack(said)[0] if len(said) == _STATUS.size else reaper_status)
    finally:
        os._exit(1)


def _end_as(status: int) -> NoReturn:
    """Exit with ``status``'s code, or die of its signal."""
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a core was the child's to write
        if signum not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
        os.kill(os.getpid(), signum)
        os._exit(128 + signum)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


def _reap(watch: int | None, status_pipe: int) -> None:
    """The reaper: start the child (which returns from here), then reap whatever the
    namespace hands it until the child ends."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    linux.die_with_parent(signal.SIGKILL)
    # getppid() is 0 here (the outer is outside the namespace): ask the outer's pidfd
    # whether it died before the death signal was armed.
    if watch is not None:
        if readable(watch):
            os._exit(1)
        os.close(watch)
    try:
        own_proc()
    except OSError as exc:
        os.write(2, f"sandboxq: the child's PID namespace could not be set up: {exc}\n".encode())
        os._exit(1)
    child = os.fork()
    if child == 0:
        os.close(status_pipe)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if os.geteuid() != 0:
            # Every capability of the user namespace it came with (they reach only what
            # that namespace owns, but the handler needs none of them).
            drop(Privileges(drop_capabilities=True))
        global _inside
        _inside = True
        return
    try:
        _close_all_but(status_pipe)
        while True:
            while (reaped := os.waitpid(-1, os.WNOHANG))[0]:
                if reaped[0] == child:
                    os.write(status_pipe, _STATUS.pack(reaped[1]))
                    os._exit(0)  # the kernel now kills the rest of the namespace
            signal.sigwait({signal.SIGCHLD})
    finally:
        os._exit(1)


def _close_all_but(fd: int) -> None:
    os.closerange(0, fd)
    os.closerange(fd + 1, os.sysconf("SC_OPEN_MAX"))


def sweep_namespace() -> int:
    """In the child, after its attempt's own sweep: kill every process of the namespace
    but the reaper and this one. A process a handler started with ``clone(CLONE_PARENT)``
    is the reaper's child, not ours, out of the subreaper's reach; what it starts goes to
    the reaper too. The common case, the reaper's only child is us, costs one read of its
    children list. Returns how many were killed (0 outside a namespace of our own)."""
    if not _inside:
        return 0
    killed = 0
    deadline = time.monotonic() + SWEEP_WAIT_S
    me = os.getpid()
    while escaped := [p for p in children_of(1) if p != me and not ended(p)]:
        for pid in escaped:
            killed += sweep(pid)
        if time.monotonic() >= deadline:  # one that cannot die (an uninterruptible wait)
            break
    return killed


def inner_pid(outer: int) -> int | None:
    """Parent side: the pid, in the caller's namespace, of the child below ``outer`` (pid
    2 of its namespace); None when there is none (it ended)."""
    for reaper in children_of(outer):
        for pid in children_of(reaper):
            try:
                with open(f"/proc/{pid}/status") as f:
                    nspid = next((line for line in f if line.startswith("NSpid:")), "")
            except OSError:
                continue
            if nspid.split()[-1:] == ["2"]:
                return pid
    return None
