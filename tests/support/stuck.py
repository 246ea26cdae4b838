"""Handlers that run on through their parent's trouble, and log when they ran.

    hold_gil_logged(log, seconds)   appends "start <pid> <time>", then holds the GIL in
                                    one C call for about ``seconds`` (no thread of the
                                    child, and no signal handler, runs meanwhile), then
                                    "end <pid> <time>"; ok: its pid. With ``marker``
                                    (a path), only its first run holds ``seconds``; the
                                    run of another worker that recovered the job holds
                                    ``again_s``
    daemon_then_hold(pid_file)      double-forks a daemon in a session of its own (its pid
                                    written to ``pid_file``), then holds the GIL

A child inside one long C call is the case the parent's own fence cannot reach from
inside the child: only something outside it can stop or kill it.
"""

from __future__ import annotations

import os
import time


def _hold_gil_for(seconds: float) -> None:
    t0 = time.perf_counter()
    sum(range(2_000_000))
    per_item = max(time.perf_counter() - t0, 1e-4) / 2_000_000
    sum(range(int(seconds / per_item)))


def hold_gil_logged(log: str, seconds: float, marker: str = "", again_s: float = 0.0) -> int:
    if marker:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            seconds = again_s  # a later run of the same job
    with open(log, "a") as out:
        out.write(f"start {os.getpid()} {time.time():.6f}\n")
    _hold_gil_for(seconds)
    with open(log, "a") as out:
        out.write(f"end {os.getpid()} {time.time():.6f}\n")
    return os.getpid()


def daemon_then_hold(pid_file: str) -> None:
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            with open(pid_file + ".tmp", "w") as out:
                out.write(str(os.getpid()))
            os.rename(pid_file + ".tmp", pid_file)
            while True:
                time.sleep(3600)
        os._exit(0)
    os.wait()
    _hold_gil_for(3600.0)
