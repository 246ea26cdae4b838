"""What a child's next attempt relies on, as the child was set up: put back or checked
after every attempt, so that one attempt's changes to its process reach no other job.

    child start ── record(): the descriptors 1 and 2 (which file each is, their
                   flags), the ``sys.std*`` objects and encodings, the handlers of the
                   signals the parent sends and of SIGCHLD and SIGPIPE, the rlimits, the
                   working directory, umask, nice value and CPU affinity
    each attempt's end ── restore(): what the pool can set back, set back (interval
                   timers off, the pool's signal handlers installed again, the stdio
                   flags, the wakeup fd, SIGCHLD and SIGPIPE, the working directory, the
                   umask, the CPU affinity, the nice value where privileged)
                       ── changed(): what it cannot, or None ──► the child is replaced
                          before its next task (child.py: ``shared[STATE_CHANGED]``)

Why these: each was a handler's change that broke the next job on its child. Closed
``sys.stdout``: every later job failed printing. Ignored, blocked, or (through ctypes,
``siginterrupt``, ``faulthandler.unregister``) quietly changed the soft signal: the next
job got no ``SoftTimeout`` and was killed at its hard deadline, its cleanup never run,
or died of the dump signal. A pending ``alarm`` or ``setitimer``: the next job was killed
by SIGALRM, SIGVTALRM or SIGPROF and reported ``crashed``. A lowered RLIMIT_CPU: the next
job failed ``cpu_limit``. Stdout made non-blocking: the next job's output was lost. A
wakeup fd set on the channel: the next job's reply was garbage. SIGCHLD ignored: a
later job's ``subprocess.run`` returned 0 for an exit code of 3. ``os.chdir``: the next
job's relative paths named other files; ``os.umask(0o777)``: its files were unreadable;
``os.nice``: it ran slower; ``os.sched_setaffinity``: it ran on one core.

What cannot be set back is checked instead (a hard limit lowered cannot be raised by a
child without privileges; a stream object replaced is the handler's), and replacing the
child is the answer: it is only worth its start time saved while it is as it was. What a
handler's modules keep between jobs (a cache, a connection, an environment variable) is
its own, as in any pool that reuses its processes.

Cost: about 16 us a job in the child (some twenty-five system calls; the two ``fstat`` of
the descriptors, 3.5 us, are the most; the working directory, umask, nice value and
affinity add 2.0-2.7 us of it, best of 30 runs), after its reply: off the job's own path,
not off the next one's. A no-op job is where it shows: with two children on two cores,
15,400 against 17,500 jobs a second before any of these checks, measured before the last
four (medians of 5 alternated runs); with one child, 12,500 against 15,500. A job of 10 ms
pays 0.1 %.
"""

from __future__ import annotations

# The C module: ``signal``'s wrappers turn every handler and signal number into an enum
# member, which made a check 8 us instead of 5.
import _signal  # type: ignore[import-not-found]
import fcntl
import os
import resource
import signal
import sys
from collections.abc import Callable
from typing import Any

#: Per descriptor 1 and 2: (device, inode) of its file, or None when it was closed.
_Files = tuple[tuple[int, int] | None, ...]

#: The limits the pool sets (limits.py) or a handler could lower for the next attempt.
_LIMITS = (resource.RLIMIT_CPU, resource.RLIMIT_AS, resource.RLIMIT_NOFILE, resource.RLIMIT_FSIZE)
_TIMERS = (signal.ITIMER_REAL, signal.ITIMER_VIRTUAL, signal.ITIMER_PROF)
#: Signals whose handlers are put back (not the pool's, but a change breaks the next job).
_PUT_BACK = (signal.SIGCHLD, signal.SIGPIPE)

_files: _Files = ()
_file_flags: tuple[int | None, ...] = ()
_streams: tuple[Any, ...] = ()
_encodings: tuple[Any, ...] = ()
_handlers: dict[int, Any] = {}
_put_back: dict[int, Any] = {}
_limits: dict[int, tuple[int, int]] = {}
_cpu_budget = False
_rearm: Callable[[], None] | None = None
_cwd = ""
_umask = 0
_priority = 0
_affinity: set[int] = set()
_not_restored: str | None = None  # what restore() could not set back


def _open_files() -> _Files:
    found: list[tuple[int, int] | None] = []
    for fd in (1, 2):
        try:
            st = os.fstat(fd)
        except OSError:
            found.append(None)
        else:
            found.append((st.st_dev, st.st_ino))
    return tuple(found)


def _flags(fd: int) -> int | None:
    try:
        return fcntl.fcntl(fd, fcntl.F_GETFL)
    except OSError:
        return None


def _stream_encodings() -> tuple[Any, ...]:
    # Spelled out: a generator over the three made this check 1.4 us instead of 0.5.
    i, o, e = sys.stdin, sys.stdout, sys.stderr
    return (
        getattr(i, "encoding", None),
        getattr(i, "errors", None),
        getattr(o, "encoding", None),
        getattr(o, "errors", None),
        getattr(e, "encoding", None),
        getattr(e, "errors", None),
    )


def record(signals: tuple[int, ...], rearm: Callable[[], None], cpu_budget: bool) -> None:
    """In the child, once set up: what ``restore`` and ``changed`` go by. ``signals``:
    those the parent sends it (the soft timeout, the stack dump); ``rearm`` installs
    their handlers again; ``cpu_budget``: the pool sets RLIMIT_CPU's soft limit before
    each attempt (``cpu_time_s``), so that one is not compared."""
    global _files, _streams, _encodings, _handlers, _put_back, _limits, _cpu_budget, _rearm
    global _file_flags, _cwd, _umask, _priority, _affinity
    _files = _open_files()
    _file_flags = (_flags(1), _flags(2))
    _streams = (sys.stdin, sys.stdout, sys.stderr)
    _encodings = _stream_encodings()
    _handlers = {int(sig): _signal.getsignal(sig) for sig in signals}
    _put_back = {int(sig): _signal.getsignal(sig) for sig in _PUT_BACK}
    _limits = {limit: resource.getrlimit(limit) for limit in _LIMITS}
    _cpu_budget, _rearm = cpu_budget, rearm
    _cwd = os.getcwd()
    _umask = os.umask(0o022)
    os.umask(_umask)
    _priority = os.getpriority(os.PRIO_PROCESS, 0)
    _affinity = os.sched_getaffinity(0)


def restore() -> None:
    """Set back what an attempt may have changed and the pool can set back (after the
    attempt's sweep, before ``changed``)."""
    global _not_restored
    for timer in _TIMERS:  # a pending alarm would kill or interrupt the next job
        signal.setitimer(timer, 0)
    _signal.set_wakeup_fd(-1)  # the child sets none; a handler's could be the channel
    for fd, was in zip((1, 2), _file_flags, strict=True):
        now = _flags(fd)
        if was is not None and now is not None and now != was:
            fcntl.fcntl(fd, fcntl.F_SETFL, was)  # O_NONBLOCK had lost the next output
    for sig, handler in _put_back.items():
        if _signal.getsignal(sig) is not handler:
            _signal.signal(sig, handler)
    os.umask(_umask)  # 0o777 had made every file the next job wrote unreadable
    _not_restored = _restore_place()


def _restore_place() -> str | None:
    """The working directory, nice value and CPU affinity set back; what could not be, or
    None."""
    if os.getpriority(os.PRIO_PROCESS, 0) != _priority:  # the next job ran slower
        try:
            os.setpriority(os.PRIO_PROCESS, 0, _priority)
        except OSError:  # a raised nice value: only a privileged process may lower it
            return "raised its nice value (os.nice, os.setpriority)"
    try:  # a relative path of the next job's would have named another file
        if os.getcwd() != _cwd:
            os.chdir(_cwd)
    except OSError:
        return "left a working directory the pool could not enter again"
    if os.sched_getaffinity(0) != _affinity:  # pinned to one core, the next job too
        try:
            os.sched_setaffinity(0, _affinity)
        except OSError:  # a CPU taken from the pool meanwhile (cpuset)
            return "changed its CPU affinity beyond what the pool could set back"
    return None


def changed() -> str | None:
    """What the attempt changed that cannot be set back, in a few words; None if nothing.
    Called after ``restore``; then the pool's own signals are armed again (a change to
    them made below Python's view, with ctypes or ``siginterrupt``, is undone so)."""
    why = _why_changed()
    if why is None and _rearm is not None:
        _rearm()
    return why


def _why_changed() -> str | None:
    if _open_files() != _files:
        return "closed or replaced its stdout or stderr descriptor"
    stdin, stdout, stderr = _streams
    if (
        sys.stdin is not stdin
        or sys.stdout is not stdout
        or sys.stderr is not stderr
        or getattr(stdin, "closed", False)
        or getattr(stdout, "closed", False)
        or getattr(stderr, "closed", False)
    ):
        return "closed or replaced sys.stdin, sys.stdout or sys.stderr"
    if _stream_encodings() != _encodings:
        return "reconfigured the encoding of sys.stdin, sys.stdout or sys.stderr"
    blocked = _signal.pthread_sigmask(_signal.SIG_BLOCK, [])
    for sig, handler in _handlers.items():
        if sig in blocked or _signal.getsignal(sig) is not handler:
            return f"blocked signal {sig} or changed its handler"
    for limit, (soft, hard) in _limits.items():
        now_soft, now_hard = resource.getrlimit(limit)
        managed = limit == resource.RLIMIT_CPU and _cpu_budget
        if now_hard != hard or (now_soft != soft and not managed):
            return f"changed its resource limit {limit} (resource.RLIMIT_*)"
    return _not_restored
