"""Handlers whose stack a test looks for: each spins, hangs, crashes or prints in a
function with a name of its own, so the captured traceback can be checked for it."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import sys
import threading
import time


def outer_frame_raises(message: str = "deep") -> None:
    inner_frame_raises(message)


def inner_frame_raises(message: str) -> None:
    raise RuntimeError(message)


def raise_huge_message(size: int) -> None:
    """Raises a ValueError whose message alone is ``size`` characters, on one line."""
    raise ValueError("E" * size)


def deep_recursion() -> None:
    """Raises RecursionError after ~1,000 frames that alternate between two functions (so
    Python does not fold them into "[Previous line repeated]"): a traceback far over the
    bound."""
    _deeper()


def _deeper() -> None:
    deep_recursion()


def spin_in_pure_python() -> None:
    while True:
        pass


def spin_beside_a_waiting_thread() -> None:
    """A handler whose work waits in a thread of its own (a download, a pool's worker)
    while it spins: at its soft signal it raises SoftTimeout out of the spin."""
    threading.Thread(target=wait_in_a_side_thread, daemon=True).start()
    spin_in_pure_python()


def wait_in_a_side_thread() -> None:
    threading.Event().wait()


def regex_with_the_gil() -> bool:
    """A catastrophic backtracking match: one C call that holds the GIL for minutes."""
    return bool(re.match(r"(a+)+$", "a" * 40 + "b"))


def sleep_in_libc() -> None:
    """``sleep(3)`` in libc through ctypes.PyDLL, which keeps the GIL during the call:
    no other thread and no Python signal handler runs until it returns."""
    libc = ctypes.PyDLL(None)
    while True:  # a signal handler (the stack dump) ends one sleep early
        libc.sleep(3600)


def gil_is_held_in_libc_sleep() -> bool:
    """Whether a thread that wakes 50 ms into a 0.5 s ``libc.usleep`` made through
    ``ctypes.PyDLL`` (as ``sleep_in_libc`` does) has to wait for the call to end."""
    import threading

    woke = []
    thread = threading.Thread(target=lambda: (time.sleep(0.05), woke.append(time.monotonic())))
    start = time.monotonic()
    thread.start()
    ctypes.PyDLL(None).usleep(500_000)
    thread.join()
    return woke[0] - start >= 0.45


def segfault_here() -> None:
    ctypes.string_at(0)


def abort_here() -> None:
    os.abort()


def block_the_dump_signal(signum: int) -> None:
    """Blocks ``signum`` (the pool's stack-dump signal) in every thread, then spins."""
    if signum:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signum})
    spin_in_pure_python()


def own_handler_for_the_dump_signal(signum: int) -> None:
    """Installs its own Python handler for ``signum``, then spins."""
    if signum:
        signal.signal(signum, lambda *_: None)
    spin_in_pure_python()


def default_action_for_the_dump_signal(signum: int) -> None:
    """Resets ``signum`` to its default action (for a real-time signal: terminate)."""
    signal.signal(signum, signal.SIG_DFL)
    spin_in_pure_python()


def close_every_descriptor_then(then: str) -> str:
    """Closes every descriptor above stderr (its channel too, so the reply is lost)."""
    os.closerange(3, 65536)
    if then == "segfault":
        segfault_here()
    spin_in_pure_python()
    return "unreachable"


#: What ``forge_a_stack_or`` writes into its dump file: a stack of a frame never run.
FORGED_FRAME = "forged_frame"


def forge_a_stack_or(then: str) -> str:
    """``"forge"``: writes a dump of its own making into the file the pool's stack dumps
    go to, and returns; else ``then`` as ``close_every_descriptor_then`` takes it."""
    if then != "forge":
        if then == "segfault":
            segfault_here()
        spin_in_pure_python()
    for fd in map(int, os.listdir("/proc/self/fd")):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:sandboxq-stack"):
                forged = (
                    "Fatal Python error: Segmentation fault\n\n"
                    "Current thread 0x00000000deadbeef (most recent call first):\n"
                    f'  File "forged.py", line 1 in {FORGED_FRAME}\n'
                )
                os.write(fd, forged.encode())
                return "forged"
    return "no dump file found"


def print_and_return(text: str, repeat: int = 1, err_text: str = "") -> str:
    for _ in range(repeat):
        print(text)
    if err_text:
        print(err_text, file=sys.stderr)
    return "done"


def stop_itself(stop: bool = True) -> None:
    """Stops its own process (SIGSTOP, state T): nothing of it runs until a SIGCONT or
    a SIGKILL, its stack dump neither. ``stop=False``: it only spins."""
    if stop:
        os.kill(os.getpid(), signal.SIGSTOP)
    spin_in_pure_python()


def print_then_spin(text: str) -> None:
    print(text, flush=True)
    spin_in_pure_python()


def swallow_soft_timeout_then(then: str, signum: int = 0) -> str:
    """Spins until its soft timeout, catches it, then: ``return``, or blocks ``signum``
    (the stack-dump signal; 0: none) and spins on elsewhere until it is killed."""
    from sandboxq.errors import SoftTimeout

    try:
        spin_in_pure_python()
    except SoftTimeout:
        if then == "return":
            return "swallowed"
        if signum:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signum})
        spin_after_the_soft_timeout()
    return "unreachable"


def spin_after_the_soft_timeout() -> None:
    while True:
        pass


def print_numbered(count: int) -> None:
    for n in range(count):
        print(f"line {n}")


def grandchild_crashes_then_spin() -> None:
    """Forks a process that segfaults, waits for it, then spins until killed."""
    pid = os.fork()
    if pid == 0:
        try:
            segfault_here()
        finally:
            os._exit(1)
    os.waitpid(pid, 0)
    spin_in_pure_python()


_PRINTER = (
    "import time\nwhile True:\n    print('from the stray', flush=True)\n    time.sleep(0.001)"
)


def leave_a_printer_or_say(what: str) -> int:
    """``stray``: start a process in a session of its own that prints every millisecond,
    let it print, and return its pid; else print ``what``."""
    import subprocess

    if what != "stray":
        print(what)
        return 0
    printer = subprocess.Popen([sys.executable, "-c", _PRINTER], start_new_session=True)
    time.sleep(0.2)
    return printer.pid


def print_then_raise_every_tenth(i: int) -> int:
    """Job ``i``: returns at once, saying nothing; every tenth (i % 10 == 5) prints a
    line naming itself to stdout and to stderr, then raises."""
    if i % 10 == 5:
        print(f"stdout of {i}")
        print(f"stderr of {i}", file=sys.stderr)
        raise RuntimeError(f"job {i} failed")
    return i
