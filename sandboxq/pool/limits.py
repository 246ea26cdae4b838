"""What a child applies to itself at start: its control group and its rlimits. Runs in the
child; the parent only builds the ``ChildSetup`` it is handed.

    parent: ChildSetup(procs files, rlimits, cpu_time_s, privileges) ──► child_main
    child:  enter(setup)         join the group, set rlimits, drop privileges, turn
                                 undumpable (privileges.py; all before the processor loads)
            wrap(processor)      per attempt: a fresh CPU budget; after it, undumpable
                                 again and nothing the attempt started left in the group

Only rlimits that cannot hurt numpy are set by default: no core dumps. ``cpu_time_s``
(RLIMIT_CPU) counts the child's own CPU time; the kernel counts it per process from its
start, so before each attempt the soft limit is moved to what the child used so far plus
the budget, in whole seconds (RLIMIT_CPU has a one-second grain). Going over sends SIGXCPU,
which ends the child: outcome ``cpu_limit`` (a handler that ignores SIGXCPU runs on to its
hard timeout). RLIMIT_AS is opt-in only: OpenBLAS reserves address space per thread, one
thread per core, at import, so on a many-core machine numpy fails under an address-space
limit set near the memory really needed.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sandboxq.pool import descriptors
from sandboxq.pool.privileges import NO_CHANGE, Privileges, drop, undumpable

#: How long the sweep after an attempt waits for the processes it killed to exit.
SWEEP_WAIT_S = 2.0


@dataclass(frozen=True, slots=True)
class ChildSetup:
    """Sent to each child at start (pickled once, with the process's other arguments)."""

    procs_files: tuple[str, ...] = ()  # cgroup.procs of the child's group (empty: none)
    pids_current: str | None = None  # the group's pids.current: the sweep's fast check
    core_dumps: bool = False
    cpu_time_s: float | None = None
    max_open_files: int | None = None
    max_file_size_mb: float | None = None
    max_address_space_mb: float | None = None
    privileges: Privileges = NO_CHANGE  # what the child gives up (privileges.py)


def _set(limit: int, soft: int, *, hard: int | None = None) -> None:
    _, old_hard = resource.getrlimit(limit)
    hard = old_hard if hard is None else hard
    if old_hard != resource.RLIM_INFINITY:
        soft = min(soft, old_hard) if soft != resource.RLIM_INFINITY else old_hard
        hard = min(hard, old_hard) if hard != resource.RLIM_INFINITY else old_hard
    resource.setrlimit(limit, (soft, hard))


def enter(setup: ChildSetup) -> None:
    """Join the control group, set the rlimits and drop privileges: the child's first
    act."""
    global _own_pid
    _own_pid = os.getpid()
    me = str(_own_pid)
    for path in setup.procs_files:
        with open(path, "w") as f:
            f.write(me)
    if not setup.core_dumps:
        _set(resource.RLIMIT_CORE, 0, hard=0)
    if setup.max_open_files is not None:
        _set(resource.RLIMIT_NOFILE, setup.max_open_files, hard=setup.max_open_files)
    if setup.max_file_size_mb is not None:
        size = int(setup.max_file_size_mb * 2**20)
        _set(resource.RLIMIT_FSIZE, size, hard=size)
    if setup.max_address_space_mb is not None:
        size = int(setup.max_address_space_mb * 2**20)
        _set(resource.RLIMIT_AS, size, hard=size)
    drop(setup.privileges)  # last: joining the group and the rlimits needed them
    if not setup.core_dumps:  # a core dump needs the process dumpable
        undumpable()  # before any job's data is in it (privileges.py says why)


_own_pid = 0  # the child's pid (in its PID namespace, when it has one), from ``enter``


def leave_if_a_copy() -> None:
    """In a process the handler forked that came back out of the handler (returned,
    raised, sys.exit), end it there, as a Python program would end: it is not the child.
    It must not sweep the child's group (that killed the child, reported as a crash),
    nor answer on its channel (it answered the next jobs in the child's place)."""
    if os.getpid() == _own_pid:
        return
    exc = sys.exc_info()[1]
    if isinstance(exc, SystemExit):
        code = exc.code
        status = code & 0xFF if isinstance(code, int) else 0 if code is None else 1
    elif exc is not None:
        traceback.print_exception(exc)
        status = 1
    else:
        status = 0
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def wrap(
    processor: Callable[..., Any], setup: ChildSetup, *, sweep: bool = True
) -> Callable[..., Any]:
    """``processor``, with a fresh CPU budget before each call and the group swept after
    (``sweep=False``: the pool keeps strays on purpose, ``keep_strays``), undumpable
    during each call and after it unless core dumps are wanted: an attempt may have made
    its process dumpable again, and the next one must not run so.

    Unwrapped when none applies, so a pool without them pays nothing per attempt.
    """
    budget = setup.cpu_time_s
    group_sweep = sweep and bool(setup.procs_files and setup.pids_current)
    sweep_group = _Sweep(setup) if group_sweep else None
    guard_memory = not setup.core_dumps
    if budget is None and sweep_group is None and not guard_memory:
        return processor

    def contained(*args: Any, **kwargs: Any) -> Any:
        if budget is not None:
            used = resource.getrusage(resource.RUSAGE_SELF)
            soft = math.ceil(used.ru_utime + used.ru_stime + budget)
            _set(resource.RLIMIT_CPU, soft)
        try:
            return processor(*args, **kwargs)
        finally:
            leave_if_a_copy()  # first: a copy's sweep would kill the child
            if guard_memory:
                undumpable()  # 1.2 us (a prctl): set back whatever the handler set
            if sweep_group is not None:
                descriptors.make_room()  # the sweep opens a file (descriptors.py)
                sweep_group()

    return contained


class _Sweep:
    """After an attempt: kill whatever the attempt left in the child's group.

    The fast check reads ``pids.current`` (about 3 µs): the count of tasks (threads
    included) when the group last held only this process. Only when it differs are the
    group's processes listed (about 15 µs) and any but this one killed.
    """

    __slots__ = ("_clean", "_fd", "_procs")

    def __init__(self, setup: ChildSetup) -> None:
        assert setup.pids_current is not None
        self._fd = os.open(setup.pids_current, os.O_RDONLY | os.O_CLOEXEC)
        self._procs = setup.procs_files[0]
        self._clean = b""

    def __call__(self) -> None:
        if os.pread(self._fd, 32, 0) == self._clean:
            return
        # The soft signal must not cut the sweep short; it is re-raised when unblocked.
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
        try:
            self._kill_leftovers()
            self._clean = os.pread(self._fd, 32, 0)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    def _kill_leftovers(self) -> None:
        me = os.getpid()
        killed: set[int] = set()
        deadline = time.monotonic() + SWEEP_WAIT_S
        while True:
            with open(self._procs) as f:
                others = [int(p) for p in f.read().split() if int(p) != me]
            for pid in others:
                if pid not in killed:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
            _reap()
            if not others or time.monotonic() >= deadline:
                return
            time.sleep(0.0005)


def _reap() -> None:
    """Collect this process's own dead children (the others are the subreaper's)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
