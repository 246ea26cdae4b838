"""Processors used by the benchmarks."""

from __future__ import annotations

import time

import numpy as np


def noop(x: object = None) -> object:
    return x


def numpy_job(seconds: float) -> float:
    """Imports numpy at module level, like a real inference processor; sleeps ``seconds``."""
    if seconds:
        time.sleep(seconds)
    return float(np.zeros(4).sum())


def cpu(ms: float) -> int:
    """Burn ``ms`` milliseconds of this process's CPU time in pure Python.

    CPU time, not wall time: a job that shares its core with the parent worker (or with
    anything else) takes longer, so the cost of the parent shows in the throughput.
    """
    end = time.process_time() + ms / 1000
    n = 0
    while time.process_time() < end:
        n += 1
    return n


def stamp() -> float:
    """Returns the wall-clock time of its first line (for enqueue→start latency)."""
    return time.time()


def loud_failure(frames: int = 44) -> None:
    """Writes 8 KiB to stdout, then raises from ``frames`` frames down: a failed job whose
    record keeps about 4 KiB of traceback and 8 KiB of output."""
    for _ in range(82):
        print("x" * 99)
    _down_a(frames)


# Two functions in turn: Python folds a run of identical frames into one line.
def _down_a(n: int) -> None:
    if n:
        _down_b(n - 1)
    raise RuntimeError("failed on purpose, deep down")


def _down_b(n: int) -> None:
    if n:
        _down_a(n - 1)
    raise RuntimeError("failed on purpose, deep down")
