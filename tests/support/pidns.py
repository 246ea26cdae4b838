"""Handlers that look at the PID namespace their child runs in
(``tests/test_pid_namespace.py``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading


def what_i_see() -> dict[str, object]:
    """Its own pid, its NSpid line, the pids its /proc shows, what a process it starts
    calls itself, and whether a thread of its own runs."""
    with open("/proc/self/status") as f:
        nspid = next(line for line in f if line.startswith("NSpid:")).split()[1:]
    ran: list[bool] = []
    thread = threading.Thread(target=lambda: ran.append(True))
    thread.start()
    thread.join()
    started = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid(), os.getppid())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "uid": os.getuid(),
        "nspid": [int(p) for p in nspid],
        "proc": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
        "started": [int(p) for p in started],
        "thread_ran": ran == [True],
    }


def kill_myself(signum: int) -> None:
    """Sends itself ``signum``, as a handler that gives up might."""
    os.kill(os.getpid(), signum)


def kill_the_reaper() -> bool:
    """Sends SIGKILL and SIGTERM to pid 1, its namespace's first process, and says
    whether that process is still there (its namespace's own signals cannot end it)."""
    for signum in (signal.SIGKILL, signal.SIGTERM):
        os.kill(1, signum)
    os.kill(1, 0)  # raises if it is gone
    return True
