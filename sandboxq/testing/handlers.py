"""A catalogue of misbehaving handlers, for testing timeout, kill and retry handling.

Use them as processors by path, e.g. ``Pool("sandboxq.testing.handlers:sleep_forever")``.
Each docstring states the outcome it must produce. "soft" means a soft timeout is set
(``soft_timeout_s``), "hard" a hard timeout.

| handler                   | soft + hard      | hard only      |
|---------------------------|------------------|----------------|
| sleep_forever             | soft_timeout     | hard_timeout   |
| cpu_spin                  | soft_timeout     | hard_timeout   |
| hold_gil                  | hard_timeout     | hard_timeout   |
| catastrophic_regex        | soft_timeout     | hard_timeout   |
| swallow_soft_timeout      | hard_timeout     | hard_timeout   |
| ignore_signals            | hard_timeout     | hard_timeout   |
| grandchild_hang           | soft_timeout     | hard_timeout   |
| setsid_grandchild_hang    | soft_timeout     | hard_timeout   |
| daemonize_grandchild      | soft_timeout     | hard_timeout (the daemon dies too) |
| daemonize_grandchild(hang=False) / setsid_helper_return | ok (their helper is gone after) |
| fork_burst(n)             | soft_timeout     | hard_timeout (all n die too) |
| fork_bomb(limit)          | error ForkRefused at a pids limit below ``limit``, else hard_timeout |
| block_in_syscall          | soft_timeout     | hard_timeout   |
| os_exit(n) / sys_exit(n)  | exit (code n)    | exit (code n)  |
| segfault                  | crashed SIGSEGV  | crashed        |
| abort                     | crashed SIGABRT  | crashed (and no core file) |
| grow_memory               | memory_limit (with max_memory_mb)  |
| cpu_spin with cpu_time_s  | cpu_limit        | cpu_limit      |
| raise_unpicklable         | error (type and message still arrive) |
| return_unserializable     | error (the result cannot be encoded)  |
| return_int_keys           | error with JSON (its keys would arrive as strings); ok with pickle |
| return_huge(mb)           | error over max_result_bytes, else ok  |
| succeed_after(s, value)   | ok               | ok             |
| recorded_sleep(f, k, s)   | ok (logs start/end with its pid to f) |
| spin_gil_for(s)           | ok (holds the GIL in C calls for s seconds) |

Handlers that start processes take an optional ``pid_file``: they append each pid they
start to it, so a test can check that nothing outlived the kill.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from sandboxq.errors import SoftTimeout

_SLEEPER = [sys.executable, "-c", "import time\nwhile True: time.sleep(1)"]


def _record(pid_file: str | None, pid: int) -> None:
    if pid_file:
        with open(pid_file, "a") as f:
            f.write(f"{pid}\n")


def echo(*args: Any, **kwargs: Any) -> Any:
    """ok: returns its arguments (``[args, kwargs]``), or the single argument."""
    if len(args) == 1 and not kwargs:
        return args[0]
    return [list(args), kwargs]


def succeed_after(seconds: float, value: Any = None) -> Any:
    """ok after ``seconds``: returns ``value``."""
    time.sleep(seconds)
    return value


def recorded_sleep(log_file: str, key: str, seconds: float) -> str:
    """ok after ``seconds``; appends ``start``/``end`` lines (pid, key, time) to ``log_file``
    so a test can check that no two executions of one job ever overlapped."""
    with open(log_file, "a") as f:
        f.write(f"start {os.getpid()} {key} {time.time():.6f}\n")
    time.sleep(seconds)
    with open(log_file, "a") as f:
        f.write(f"end {os.getpid()} {key} {time.time():.6f}\n")
    return key


def sleep_forever() -> None:
    """Sleeps in Python: the soft signal interrupts it (soft_timeout), else hard_timeout."""
    while True:
        time.sleep(3600)


def cpu_spin() -> None:
    """A pure-Python CPU loop: signal handlers still run between bytecodes."""
    n = 0
    while True:
        n += 1


def hold_gil() -> int:
    """One long C call that holds the GIL and keeps Python signal handlers from running,
    so SoftTimeout can never be raised: only the hard kill ends it."""
    return sum(range(10**13))


def spin_gil_for(seconds: float) -> bool:
    """Holds the GIL inside C calls (``sum(range(n))``) for about ``seconds`` in all,
    burning a core; signal handlers only run between the calls: ok."""
    t0 = time.perf_counter()
    sum(range(2_000_000))
    per_call = max(time.perf_counter() - t0, 1e-4)
    n = int(2_000_000 * min(seconds, 2.0) / per_call)  # each call holds the GIL ~2 s at most
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(range(max(1, int(n * min(1.0, (end - time.monotonic()) / min(seconds, 2.0))))))
    return True


def catastrophic_regex() -> bool:
    """Exponential backtracking. The regex engine checks for signals (soft_timeout works)
    but starves every other thread of this process."""
    return re.match(r"(a+)+$", "a" * 64 + "b") is not None


def swallow_soft_timeout() -> None:
    """Catches SoftTimeout and keeps going: hard_timeout."""
    while True:
        try:
            time.sleep(3600)
        except SoftTimeout:
            continue


def ignore_signals() -> None:
    """Ignores SIGTERM, SIGUSR1 and SIGINT, then hangs: hard_timeout."""
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    while True:
        time.sleep(3600)


def grandchild_hang(pid_file: str | None = None) -> None:
    """Starts a grandchild (same process group) and hangs; the kill takes both."""
    proc = subprocess.Popen(_SLEEPER)
    _record(pid_file, proc.pid)
    sleep_forever()


def setsid_grandchild_hang(pid_file: str | None = None) -> None:
    """Starts a grandchild that leaves the process group (setsid) and hangs; the kill
    still finds it by walking the process tree."""
    proc = subprocess.Popen(_SLEEPER, start_new_session=True)
    _record(pid_file, proc.pid)
    sleep_forever()


def daemonize_grandchild(pid_file: str | None = None, hang: bool = True) -> str:
    """Daemonises a grandchild the classic way (fork, setsid, fork, the middle process
    exits): the daemon belongs to no process group or session of the child, and its parent
    is gone. Then hangs (``hang``), or returns ``"daemonized"``: ok, and the daemon must
    not outlive the attempt either way."""
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:  # the middle process: never returns into the handler
        try:
            os.close(r)
            os.setsid()
            daemon = subprocess.Popen(_SLEEPER, start_new_session=True)
            os.write(w, str(daemon.pid).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        daemon_pid = int(f.read())
    os.waitpid(middle, 0)
    _record(pid_file, daemon_pid)
    if hang:
        sleep_forever()
    return "daemonized"


def setsid_helper_return(pid_file: str | None = None) -> str:
    """Starts a helper in a session of its own and returns at once: ok, and the helper must
    be gone once the outcome is known."""
    proc = subprocess.Popen(_SLEEPER, start_new_session=True)
    _record(pid_file, proc.pid)
    proc.returncode = 0  # never waited for: keeps Popen's finaliser from warning
    return "returned"


def fork_burst(count: int = 200) -> None:
    """Forks ``count`` processes at once (each sleeps, none leaves the process group), then
    hangs: the hard kill must take all of them."""
    for _ in range(count):
        if os.fork() == 0:
            while True:  # never returns into the handler
                time.sleep(3600)
    sleep_forever()


class ForkRefused(RuntimeError):
    """A fork bomb's fork was refused (EAGAIN: a pids limit)."""


def fork_bomb(limit: int = 100_000) -> None:
    """Every process forks again and again, children included, until ``limit`` processes
    were started in all (counted in memory shared by the whole bomb) or a fork is refused.
    A refusal raises ``ForkRefused`` in the handler (error); without one it hangs
    (hard_timeout). The bomb's processes sleep until they are killed."""
    count = mmap.mmap(-1, 8)  # anonymous and shared: every fork counts in the same place
    refused_r, refused_w = os.pipe()
    root = os.getpid()
    while True:
        started = int.from_bytes(count[:8], "little")
        if started >= limit:
            break
        count[:8] = (started + 1).to_bytes(8, "little")  # racy, by a few: a bound, not a tally
        try:
            pid = os.fork()
        except OSError as exc:
            os.write(refused_w, f"{exc.strerror} after {started} processes\n".encode())
            break
        if pid == 0:
            continue  # the new process forks too
    if os.getpid() != root:
        while True:  # a bomb process never returns into the handler
            time.sleep(3600)
    select.select([refused_r], [], [])
    raise ForkRefused(f"fork refused: {os.read(refused_r, 200).decode().strip()}")


def block_in_syscall() -> None:
    """Blocks in read() on a pipe nobody writes to."""
    r, _w = os.pipe()
    os.read(r, 1)


def os_exit(code: int = 3) -> None:
    """Ends the child at once with ``code``: outcome exit."""
    os._exit(code)


def sys_exit(code: int = 3) -> None:
    """Raises SystemExit(code): outcome exit with that code."""
    sys.exit(code)


def segfault() -> None:
    """Reads address 0: crashed with SIGSEGV."""
    ctypes.string_at(0)


def abort() -> None:
    """Calls abort(): crashed with SIGABRT."""
    os.abort()


def grow_memory(step_mb: int = 32, pause_s: float = 0.01) -> None:
    """Allocates ``step_mb`` MB every ``pause_s`` forever: memory_limit."""
    hoard = []
    while True:
        hoard.append(bytearray(step_mb * 1024 * 1024))  # bytearray touches every page
        time.sleep(pause_s)


class _Unpicklable(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()  # locks cannot be pickled


def raise_unpicklable() -> None:
    """Raises an exception that cannot be pickled: error, type and message still arrive."""
    raise _Unpicklable("this exception holds a lock")


def return_unserializable() -> Any:
    """Returns a value no codec can encode (a lock): error."""
    return threading.Lock()


def return_int_keys() -> dict[int, str]:
    """Returns ``{1: "one"}``: JSON would turn the key into ``"1"``, so the json codec
    refuses it (error); pickle carries it (ok)."""
    return {1: "one"}


def return_huge(mb: int = 64) -> bytes | str:
    """Returns ``mb`` MB: error when over ``max_result_bytes``, else ok."""
    return "x" * (mb * 1024 * 1024)


def progress_steps(steps: int = 4) -> int:
    """Reports progress ``steps`` times, then returns ``steps``: ok."""
    from sandboxq.pool.child import current_job

    for i in range(1, steps + 1):
        current_job().progress(i / steps, f"step {i}")
    return steps


def cleanup_on_soft_timeout(marker_file: str) -> None:
    """Sleeps; its ``finally`` writes ``marker_file``, proving cleanup ran at the soft timeout."""
    try:
        sleep_forever()
    finally:
        with open(marker_file, "w") as f:
            f.write("cleaned up")
