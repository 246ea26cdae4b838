"""A handler that starts a process outside its own process tree: ``clone(CLONE_PARENT)``
makes the new process its parent's child (the fork server's, or the PID namespace's
reaper's), out of reach of the child's subreaper sweep."""

from __future__ import annotations

import ctypes
import os
import platform
import signal
import time

#: ``clone``'s system call number, by machine (the flags come first on each).
SYS_CLONE = {"x86_64": 56, "aarch64": 220}
CLONE_PARENT = 0x00008000

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def escape(marker: str) -> int:
    """Starts ``sleep <marker>`` as a sibling of this process (setsid: a session of its
    own too); returns its pid as this process sees it."""
    flags = ctypes.c_ulong(CLONE_PARENT | signal.SIGCHLD)
    pid = int(_libc.syscall(SYS_CLONE[platform.machine()], flags, None, None, None, None))
    if pid == 0:  # a raw clone: nothing of Python's own fork handling, so exec at once
        os.setsid()
        os.execv("/bin/sleep", ["/bin/sleep", marker])
        os._exit(1)
    if pid < 0:
        raise OSError(ctypes.get_errno(), "clone(CLONE_PARENT) failed")
    deadline = time.monotonic() + 10
    while _argv(pid)[:2] != [b"/bin/sleep", marker.encode()]:  # running sleep before we return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{pid} did not start sleep")
        time.sleep(0.001)
    return pid


def _argv(pid: int) -> list[bytes]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def escape_then_hang(marker: str) -> None:
    """``escape``, then hang until the attempt's hard timeout."""
    escape(marker)
    time.sleep(600)


def copy_comes_back(then_s: float = 0.5) -> str:
    """Forks; the copy comes back out of the handler at once (as a forked worker process
    that forgot to exit does), while this process works on for ``then_s``."""
    if os.fork() == 0:
        return f"from the copy {os.getpid()}"
    time.sleep(then_s)
    return f"from the child {os.getpid()}"
