"""Handlers that change their child's process for the next attempt: its stdio, or the
signals the pool sends (the child is replaced before its next task: baseline.py)."""

from __future__ import annotations

import os
import signal
import sys
import time


def close_stdout() -> int:
    sys.stdout.close()
    return os.getpid()


def close_fd_1() -> int:
    os.close(1)
    return os.getpid()


def ignore_every_signal() -> int:
    for sig in signal.valid_signals():
        try:
            signal.signal(sig, signal.SIG_IGN)
        except (OSError, ValueError):  # SIGKILL, SIGSTOP
            pass
    return os.getpid()


def block_every_signal() -> int:
    signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    return os.getpid()


def print_and_wait_for_soft(wait_s: float) -> str:
    """Prints, then sleeps: the soft signal raises SoftTimeout out of it; "no soft
    signal" when none came."""
    print("still printing")
    time.sleep(wait_s)
    return "no soft signal"


def call(name: str, *args: float) -> object:
    """The handler the pool runs: one of the above by name, so they share a child."""
    return globals()[name](*args)
