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
    """Burn ``ms`` milliseconds of CPU in pure Python."""
    end = time.perf_counter() + ms / 1000
    n = 0
    while time.perf_counter() < end:
        n += 1
    return n


def stamp() -> float:
    """Returns the wall-clock time of its first line (for enqueue→start latency)."""
    return time.time()
