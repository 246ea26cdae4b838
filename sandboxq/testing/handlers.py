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
| fork_bomb_until_refused(n) | error ForkRefused under a pids limit, else hard_timeout |
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

The attempt boundary: whatever the attempt started is dead before its outcome is
reported (``f`` is an optional pid file, ``then`` how the attempt ends: "return",
"raise", "hang", "exit"):

| handler                   | outcome                                                |
|---------------------------|--------------------------------------------------------|
| daemonize_grandchild(f, then) | ok / error / soft / hard / exit 5, as ``then`` says; |
|                           | the daemon (setsid, fork, the middle exits) dies too   |
| session_helper(f)         | ok; its helper in another session dies (kept with      |
|                           | ``keep_strays=True``, until the child ends)            |
| fork_burst(f, 200, then)  | ok (hard_timeout with "hang"); all 200 forks die       |
| fork_bomb(f, depth, then) | ok (exit 5 with "exit"); the growing tree cannot       |
|                           | outrun the sweep                                       |
| leak_memory(mb)           | ok; a later small job with a limit is not charged for  |
|                           | the leak (not memory_limit)                            |
| progress_undecodable      | error ("could not be decoded"); the child is replaced  |
| channel_garbage(kind)     | error ("could not be decoded"): bytes, a 4 GB header,  |
|                           | a crafted pickle (refused, never run)                  |
| progress_bad_arguments    | ok; returns what each bad ``progress()`` call raised   |
| exit_at_next_start        | ok; the child dies before its next task, which is not  |
|                           | charged for it (it runs again)                         |
| progress_then_hang(n, s)  | progress_timeout under ``progress_timeout_s``          |
| progress_then_deaf(n, s)  | progress_timeout, killed a grace after the soft signal |
| progress_every(n, s)      | ok, however short the watchdog, if it is above ``s``   |
| exit_once(f, code)        | exit ``code`` once, then ok                            |
| use_memory(mb, s)         | ok under a limit above ``mb``, else memory_limit       |
| grow_to(mb, ..., f, n)    | ok; several outgrow ``pool_memory_mb``: memory_pressure |
|                           | (with ``f``, ``n`` of them start growing together)     |

Handlers that start processes take an optional ``pid_file``: they append each pid they
start to it, so a test can check that nothing outlived the kill.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
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


class ForkRefused(RuntimeError):
    """A fork bomb's fork was refused (EAGAIN: a pids limit)."""


def fork_bomb_until_refused(limit: int = 100_000) -> None:
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


# -- the attempt boundary: processes that try to outlive their attempt ----------------

# setsid, fork again, and let the middle exit: the classic daemon, re-parented at once.
_DAEMON = (
    "import os, sys, time\n"
    "os.setsid()\n"
    "if os.fork():\n"
    "    os._exit(0)\n"
    "with open(sys.argv[1], 'a') as f:\n"
    "    f.write(f'{os.getpid()}\\n')\n"
    "while True:\n"
    "    time.sleep(1)\n"
)


def _end(how: str) -> Any:
    """End an attempt the way a case asks: return, raise, hang, or exit the child."""
    if how == "raise":
        raise RuntimeError("raised after starting processes")
    if how == "hang":
        sleep_forever()
    if how == "exit":
        os._exit(5)
    return how


def _wait_lines(path: str, count: int) -> None:
    """Wait until ``path`` holds ``count`` lines: the processes have recorded themselves."""
    while True:
        try:
            with open(path) as f:
                if len(f.read().split()) >= count:
                    return
        except FileNotFoundError:
            pass
        time.sleep(0.005)


@contextlib.contextmanager
def _pid_file(pid_file: str | None) -> Iterator[str]:
    """Where to record pids: the caller's file, or a fresh one of our own, removed once
    the pids were waited for (each process writes its own once, before it sleeps)."""
    if pid_file:
        yield pid_file
        return
    fd, path = tempfile.mkstemp(prefix="sandboxq-pids-")
    os.close(fd)
    try:
        yield path
    finally:
        os.unlink(path)


def daemonize_grandchild(pid_file: str | None = None, then: str = "return") -> Any:
    """Starts a daemon (setsid, fork, the middle exits), then returns (ok), raises (error),
    hangs (soft_timeout / hard_timeout) or exits the child (exit 5). Whatever the outcome,
    the daemon is dead before it is reported."""
    with _pid_file(pid_file) as pids:
        with open(pids, "a+") as f:
            f.seek(0)
            before = len(f.read().split())
        subprocess.run([sys.executable, "-c", _DAEMON, pids], check=True)
        _wait_lines(pids, before + 1)
    return _end(then)


def session_helper(pid_file: str | None = None, then: str = "return") -> Any:
    """Starts a helper in a session of its own and returns without stopping it: ok, and
    the helper is dead before the outcome is reported (unless the pool keeps strays)."""
    proc = subprocess.Popen(_SLEEPER, start_new_session=True)
    _record(pid_file, proc.pid)
    return _end(then)


def _forked(body: Any) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            body()
        finally:
            os._exit(0)
    return pid


def _fork_sleepers(pid_file: str, count: int) -> None:
    """Forks ``count`` processes that record their pid in ``pid_file`` and sleep forever;
    returns once every one has recorded itself."""

    def sleeper() -> None:
        _record(pid_file, os.getpid())
        while True:
            time.sleep(1)

    for _ in range(count):
        _forked(sleeper)
    _wait_lines(pid_file, count)


def fork_burst(pid_file: str | None = None, count: int = 200, then: str = "return") -> Any:
    """Forks ``count`` sleeping processes at once (each records its pid), then ends as
    ``then`` says: all of them are dead before the outcome is reported."""
    with _pid_file(pid_file) as pids:
        _fork_sleepers(pids, count)
    return _end(then)


def fork_bomb(pid_file: str | None = None, depth: int = 7, then: str = "return") -> Any:
    """A bounded fork bomb: every process forks two more down to ``depth`` (2**(depth+1)-2
    processes), and the attempt ends while the tree is still growing: the kill must not be
    outrun."""

    def node(level: int) -> None:
        _record(pid_file, os.getpid())
        if level < depth:
            _forked(lambda: node(level + 1))
            _forked(lambda: node(level + 1))
        while True:
            time.sleep(1)

    _forked(lambda: node(1))
    _forked(lambda: node(1))
    return _end(then)


_leaked: list[bytearray] = []


def leak_memory(mb: int = 120) -> int:
    """Keeps ``mb`` MB alive in the child after it returns (ok): a later small job must
    not be charged for it."""
    _leaked.append(bytearray(mb * 1024 * 1024))
    return mb


def progress_undecodable() -> None:
    """Writes a progress message the parent cannot decode (it names a class that exists
    only in this child), then hangs: error, and the child is replaced."""
    from sandboxq.pool.child import current_job
    from sandboxq.pool.messages import Progress

    job = current_job()
    only_here = type("OnlyInTheChild", (), {"__module__": __name__})
    globals()["OnlyInTheChild"] = only_here
    job._conn.send(Progress(job.task_id, 0.5, only_here()))
    sleep_forever()


def channel_garbage(kind: str = "bytes", path: str = "/nonexistent/sandboxq-crafted") -> None:
    """Writes straight to the child's channel, then hangs: ``bytes`` a frame that is not a
    pickle, ``huge`` a header announcing a 4 GB frame, ``crafted`` a pickle that would
    call ``os.mkdir(path)`` in the parent if it were unpickled there, ``peak`` this
    attempt's ``Finished`` with a peak memory that is not a number of bytes,
    ``error-surrogate`` and ``progress-surrogate`` its ``Failed`` or a ``Progress`` with a
    lone surrogate in their text (UTF-8, so Redis, cannot carry it). Each: error, and the
    child is replaced."""
    import pickle
    import struct

    from sandboxq.pool.child import current_job
    from sandboxq.pool.messages import Failed, Finished, Progress, RemoteError

    job = current_job()
    sock = job._conn.sock
    if kind == "peak":
        body = pickle.dumps(Finished(job.task_id, b"null", "1 GB"))  # type: ignore[arg-type]
        frame = struct.pack("!I", len(body)) + body
    elif kind == "error-surrogate":
        error = RemoteError("builtins.ValueError", "bad \udcff", "Traceback \udcff\n", None)
        body = pickle.dumps(Failed(job.task_id, error))
        frame = struct.pack("!I", len(body)) + body
    elif kind == "progress-surrogate":
        body = pickle.dumps(Progress(job.task_id, 0.5, "at \udcff"))
        frame = struct.pack("!I", len(body)) + body
    elif kind == "huge":
        frame = struct.pack("!I", 0xFFFFFFFF) + b"x" * 64
    elif kind == "crafted":
        body = pickle.dumps(_Crafted(path))
        frame = struct.pack("!I", len(body)) + body
    else:
        body = b"\x80\x05this is not a pickle at all"
        frame = struct.pack("!I", len(body)) + body
    sock.sendall(frame)
    sleep_forever()


class _Crafted:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.path,))


def progress_bad_arguments() -> list[str]:
    """Calls ``progress()`` with bad arguments; returns what each call raised (ok)."""
    from sandboxq.pool.child import current_job

    seen = []
    for args in ((1.5,), ("half",), (float("nan"),), (True,), (0.5, 42)):
        try:
            current_job().progress(*args)
            seen.append("accepted")
        except (TypeError, ValueError) as exc:
            seen.append(type(exc).__name__)
    current_job().progress(0.5, "x" * 100_000)  # accepted, capped
    return seen


def exit_at_next_start() -> str:
    """Returns ok, but the child dies before it can start its next task (a hook on the
    child's loop): that next task must not be charged for the death."""

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_name == "run_one":
            os._exit(7)

    sys.setprofile(hook)
    return "ok"


def wait_on_fifo(fifo: str) -> str:
    """Blocks until someone opens ``fifo`` for writing: a barrier a test controls."""
    with open(fifo) as f:
        f.read()
    return "released"


def mark_started(marker: str) -> str:
    """Writes ``marker`` as soon as it starts: proof that the attempt ran."""
    with open(marker, "a") as f:
        f.write(f"{os.getpid()}\n")
    return "ran"


def touch_and_return(marker: str) -> str:
    """Writes ``marker`` just before it returns (ok)."""
    with open(marker, "w") as f:
        f.write("done")
    return "done"


def mark_then_hang(marker: str) -> None:
    """Writes ``marker`` as it starts, then sleeps forever: for killing the pool's helpers
    under a running attempt."""
    with open(marker, "w") as f:
        f.write(str(os.getpid()))
    sleep_forever()


def call(name: str, *args: Any) -> Any:
    """Runs the catalogue handler ``name`` with ``args``: one pool, several behaviours."""
    return globals()[name](*args)


def wait_then_return(fifo: str, marker: str, mb: int = 0) -> str:
    """Waits on ``fifo`` (a test's barrier), keeps ``mb`` MB, writes ``marker``, returns ok:
    the test holds the parent busy meanwhile, so the result waits unread in the pipe."""
    with open(fifo) as f:
        f.read()
    if mb:
        _leaked.append(bytearray(mb * 1024 * 1024))
    with open(marker, "w") as f:
        f.write("returned")
    return "returned"


def leak_then_hold(mb: int, hold_s: float = 0.0) -> int:
    """Keeps ``mb`` MB alive in the child after it returns, after ``hold_s`` seconds (ok):
    a later small job must not be charged for what an earlier one leaked."""
    _leaked.append(bytearray(mb * 1024 * 1024))
    time.sleep(hold_s)
    return mb


def burst_then_clock(pid_file: str, count: int = 200) -> float:
    """Forks ``count`` sleeping processes, then returns the wall-clock time of its return
    (ok): how long its leftovers take to be gone is measured from there."""
    _fork_sleepers(pid_file, count)
    return time.time()


def cpu_loop(n: int) -> float:
    """A pure-Python loop of ``n`` turns; returns the CPU time it took (ok), the CPU tax
    of wherever it runs."""
    t0 = time.process_time()
    total = 0
    for i in range(n):
        total += i * i % 7
    return time.process_time() - t0


# -- failure policies: the progress watchdog, exit codes retried without charge -------------


def progress_then_hang(steps: int = 3, every_s: float = 0.05) -> None:
    """Reports progress ``steps`` times, ``every_s`` apart, then sleeps forever: ended as
    ``progress_timeout`` by a watchdog (``progress_timeout_s``) long before any hard
    timeout."""
    from sandboxq.pool.child import current_job

    for i in range(1, steps + 1):
        current_job().progress(i / (steps + 1), f"step {i}")
        time.sleep(every_s)
    sleep_forever()


def progress_then_deaf(steps: int = 3, every_s: float = 0.05) -> None:
    """Ignores the soft signal (and SIGTERM, SIGINT), reports progress ``steps`` times
    ``every_s`` apart, then hangs: ``progress_timeout``, killed after the grace."""
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    progress_then_hang(steps, every_s)


def progress_every(steps: int, every_s: float) -> int:
    """Reports progress ``steps`` times, ``every_s`` apart, then returns ``steps`` (ok):
    busy for longer than a watchdog shorter than ``steps * every_s``, never silent for it."""
    from sandboxq.pool.child import current_job

    for i in range(1, steps + 1):
        time.sleep(every_s)
        current_job().progress(i / steps)
    return steps


def exit_once(marker: str, code: int = 3) -> str:
    """Exits with ``code`` the first time (it writes ``marker``), returns "ok" after: one
    exit code mapped to ``retry_uncharged`` costs the job no attempt."""
    if not os.path.exists(marker):
        with open(marker, "w") as f:
            f.write("exited")
        os._exit(code)
    return "ok"


def use_memory(mb: int, hold_s: float = 0.3) -> int:
    """Holds ``mb`` MB (written) for ``hold_s`` seconds, frees them and returns ``mb``:
    ok under a limit above ``mb``, memory_limit under one below it."""
    block = bytearray(mb * 1024 * 1024)
    block[:: mmap.PAGESIZE] = b"\x01" * len(block[:: mmap.PAGESIZE])
    time.sleep(hold_s)
    del block
    return mb


def use_memory_and_mark(mb: int, marker: str, hold_s: float = 0.5) -> int:
    """Holds ``mb`` MB (written) at once, then writes ``marker`` and holds them ``hold_s``
    seconds more (ok under a limit above ``mb``): a test knows when the memory is in use."""
    block = bytearray(mb * 1024 * 1024)
    block[:: mmap.PAGESIZE] = b"\x01" * len(block[:: mmap.PAGESIZE])
    with open(marker, "w") as f:
        f.write(str(mb))
    time.sleep(hold_s)
    del block
    return mb


def grow_to(
    mb: int,
    step_mb: int = 5,
    pause_s: float = 0.02,
    hold_s: float = 1.0,
    together: str | None = None,
    count: int = 0,
) -> int:
    """Grows by ``step_mb`` every ``pause_s`` up to ``mb`` MB, holds it ``hold_s``, returns
    ``mb`` (ok): several of them together outgrow a pool's ``pool_memory_mb``, and the
    newest ones end as ``memory_pressure``.

    With ``together`` (a file), it first appends its pid there and waits until the file
    holds ``count`` lines: ``count`` attempts grow at once however far apart their
    children started them (a retry finds the lines already there and grows at once)."""
    if together is not None:
        with open(together, "a") as f:
            f.write(f"{os.getpid()}\n")
        _wait_lines(together, count)
    blocks = []
    for _ in range(mb // step_mb):
        blocks.append(bytearray(step_mb * 1024 * 1024))
        time.sleep(pause_s)
    time.sleep(hold_s)
    return mb
