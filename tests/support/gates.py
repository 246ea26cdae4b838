"""Handlers a test holds at a point of its choosing: they wait on a file the test creates.

    report_then_wait(gate, value)   progress 0.5, then waits for ``gate`` to exist; ok: value
    run_then_wait(log, gate)        appends "start <pid> <attempt> <time>" to ``log``,
                                    reports progress 0.5, waits for ``gate``, appends
                                    "end ..."; ok: the attempt number
    meet(folder, count, value)      a barrier across processes: leaves a file in
                                    ``folder``, waits until ``count`` are there; ok: value

A file, not a timer: the test decides when the handler goes on, so a race it forces does
not depend on how loaded the machine is. The polling is the handler's own (10 ms), inside
the child; nothing in the test sleeps.
"""

from __future__ import annotations

import os
import time
from typing import Any

POLL_S = 0.01


def _wait_for_file(path: str) -> None:
    while not os.path.exists(path):
        time.sleep(POLL_S)


def report_then_wait(gate: str, value: Any = None) -> Any:
    """Reports progress 0.5, then waits until ``gate`` exists; ok: returns ``value``."""
    from sandboxq.pool.child import current_job

    current_job().progress(0.5, "waiting at the gate")
    _wait_for_file(gate)
    return value


def run_then_wait(log: str, gate: str) -> int:
    """Logs its start, reports progress, waits until ``gate`` exists, logs its end; ok:
    the attempt number."""
    from sandboxq.pool.child import current_job

    job = current_job()
    with open(log, "a") as out:
        out.write(f"start {os.getpid()} {job.attempt} {time.time()}\n")
    job.progress(0.5, "waiting at the gate")
    _wait_for_file(gate)
    attempt = job.attempt
    with open(log, "a") as out:
        out.write(f"end {os.getpid()} {attempt} {time.time()}\n")
    return attempt


def meet(folder: str, count: int, value: Any = None) -> Any:
    """A barrier for handlers on different workers: each leaves a file of its own in
    ``folder`` and goes on once ``count`` files are there, so they return together."""
    with open(os.path.join(folder, f"{os.getpid()}-{time.monotonic_ns()}"), "w"):
        pass
    while len(os.listdir(folder)) < count:
        time.sleep(POLL_S)
    return value
