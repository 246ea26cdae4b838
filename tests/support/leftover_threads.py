"""Handlers that leave Python threads running after they return (the attempt boundary
for threads: the child is replaced before its next task)."""

from __future__ import annotations

import os
import threading
import time


def _sleep_forever() -> None:
    while True:
        time.sleep(3600)


def leave_threads(count: int = 1, daemon: bool = False) -> int:
    """Starts ``count`` threads that never end, returns this child's pid."""
    for _ in range(count):
        threading.Thread(target=_sleep_forever, daemon=daemon, name="left-behind").start()
    return os.getpid()


def leave_threads_to_the_limit() -> int:
    """Starts threads that never end until the system refuses one (a control group's
    pids limit counts threads), returns how many started."""
    started = 0
    while True:
        try:
            threading.Thread(target=_sleep_forever, daemon=True).start()
        except RuntimeError:  # "can't start new thread"
            return started
        started += 1


def pid() -> int:
    return os.getpid()


def fork_and_wait() -> int:
    """Forks a process that exits at once; returns its exit status."""
    child = os.fork()
    if child == 0:
        os._exit(0)
    return os.waitpid(child, 0)[1]


def call(name: str, *args: object) -> object:
    """Runs the handler ``name`` of this module: one pool, several behaviours."""
    return globals()[name](*args)
