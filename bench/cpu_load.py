"""A parallel CPU load for containment checks and benches: ``python bench/cpu_load.py N S``
runs N busy Python loops for S seconds (stress(1)-like), then exits; killing it (its pid)
ends the loops too (they are its children, and die with it)."""

from __future__ import annotations

import ctypes
import multiprocessing
import signal
import sys
import time


def _spin(until: float) -> None:
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the parent
    x = 0
    while time.monotonic() < until:
        x = (x * 31 + 7) % 1_000_003


def main(argv: list[str]) -> int:
    count, seconds = int(argv[0]), float(argv[1])
    until = time.monotonic() + seconds
    procs = [multiprocessing.Process(target=_spin, args=(until,)) for _ in range(count)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
