"""Handlers that change their child's process for the next attempt: its stdio, or the
signals the pool sends (the child is replaced before its next task: baseline.py)."""

from __future__ import annotations

import _thread
import ctypes
import faulthandler
import os
import resource
import signal
import sys
import time


def close_stdout() -> int:
    sys.stdout.close()
    return os.getpid()


def close_fd_1() -> int:
    os.close(1)
    return os.getpid()


def ignore_every_signal() -> int:
    for sig in signal.valid_signals():
        try:
            signal.signal(sig, signal.SIG_IGN)
        except (OSError, ValueError):  # SIGKILL, SIGSTOP
            pass
    return os.getpid()


def block_every_signal() -> int:
    signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    return os.getpid()


def siginterrupt_soft() -> int:
    signal.siginterrupt(signal.SIGUSR1, False)  # the soft signal: its handler kept, SA_RESTART
    return os.getpid()


def unregister_dump() -> int:
    from sandboxq.pool.stacks import DUMP_SIGNAL

    faulthandler.unregister(DUMP_SIGNAL)  # below Python's view of the handlers
    return os.getpid()


def libc_ignores_soft() -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.restype = ctypes.c_void_p
    libc.signal(int(signal.SIGUSR1), ctypes.c_void_p(1))  # SIG_IGN, unseen by Python
    return os.getpid()


def pending_alarm() -> int:
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    return os.getpid()


def pending_cpu_timer() -> int:
    signal.setitimer(signal.ITIMER_PROF, 0.2)
    return os.getpid()


def lower_cpu_limit() -> int:
    used = resource.getrusage(resource.RUSAGE_SELF)
    spent = int(used.ru_utime + used.ru_stime)
    resource.setrlimit(resource.RLIMIT_CPU, (spent + 1, spent + 2))
    return os.getpid()


def nonblocking_stdout() -> int:
    os.set_blocking(1, False)
    return os.getpid()


def reconfigure_stdout() -> int:
    try:  # on a pipe it raises (no seek) after the encoding changed
        sys.stdout.reconfigure(encoding="utf-16")  # type: ignore[union-attr]
    except OSError:
        pass
    return os.getpid()


def ignore_sigchld() -> int:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    return os.getpid()


def raw_thread() -> int:
    _thread.start_new_thread(time.sleep, (3600,))  # unseen by threading's count
    return os.getpid()


def chdir_elsewhere() -> int:
    os.chdir("/")
    return os.getpid()


def umask_everything() -> int:
    os.umask(0o777)  # the next job's files would be created unreadable
    return os.getpid()


#: CAP_SYS_NICE's bit in /proc's capability masks: who holds it may lower a nice value.
CAP_SYS_NICE = 23


def renice() -> tuple[int, bool]:
    """Raises its nice value; returns its pid and whether it may lower it again."""
    os.nice(5)
    with open("/proc/self/status") as status:
        caps = next(int(line.split()[1], 16) for line in status if line.startswith("CapEff:"))
    return os.getpid(), bool(caps >> CAP_SYS_NICE & 1)


def pin_to_one_cpu() -> int:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    return os.getpid()


def pid() -> int:
    return os.getpid()


def _umask() -> int:
    mask = os.umask(0o22)
    os.umask(mask)
    return mask


def probe() -> dict[str, object]:
    """What the next job finds: what each breaker above changes."""
    return {
        "cwd": os.getcwd(),
        "umask": _umask(),
        "priority": os.getpriority(os.PRIO_PROCESS, 0),
        "affinity": sorted(os.sched_getaffinity(0)),
        "stdout blocking": os.get_blocking(1),
        "stdout encoding": sys.stdout.encoding,
        "SIGCHLD": str(signal.getsignal(signal.SIGCHLD)),
        "timers": [signal.getitimer(t) for t in (signal.ITIMER_REAL, signal.ITIMER_PROF)],
        "cpu limit": resource.getrlimit(resource.RLIMIT_CPU),
        "threads": _thread._count(),  # type: ignore[attr-defined]
    }


def print_and_wait_for_soft() -> str:
    """Prints, then waits in a read of a silent pipe (a call the kernel restarts under
    SA_RESTART): the soft signal raises SoftTimeout out of it, else the hard kill ends
    it."""
    print("still printing")
    r, w = os.pipe()
    try:
        os.read(r, 1)
        return "the pipe spoke"
    finally:
        os.close(r)
        os.close(w)


def call(name: str, *args: float) -> object:
    """The handler the pool runs: one of the above by name, so they share a child."""
    return globals()[name](*args)
