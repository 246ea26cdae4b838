"""Handlers that leave their child without a free file descriptor (the attempt boundary for
descriptors: the sweep still runs, and the child is replaced before its next task)."""

from __future__ import annotations

import os
import time


def exhaust(limit: int = 100_000) -> dict[str, int]:
    """Starts a process that sleeps, then opens /dev/null until the table is full (at most
    ``limit`` times) and returns: the sweep after it must still find that process."""
    stray = os.fork()
    if stray == 0:
        time.sleep(60)
        os._exit(0)
    opened = 0
    try:
        while opened < limit:
            os.open(os.devnull, os.O_RDONLY)
            opened += 1
    except OSError:
        pass
    return {"pid": os.getpid(), "stray": stray, "opened": opened}


def open_a_file() -> int:
    """Opens a file, as any job may: its child's pid."""
    with open(os.devnull):
        return os.getpid()


def call(name: str, *args: object) -> object:
    """Runs the handler ``name`` of this module: one pool, several behaviours."""
    return globals()[name](*args)
