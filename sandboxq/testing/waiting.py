"""Waiting in a test for something to become true, with a deadline that names it.

    job_id = wait_for(lambda: queue.backend.list_jobs(JobState.ACTIVE), 10, "a running job")

A condition polled against a deadline, never a fixed sleep: a fast machine goes on at
once, a slow one gets the whole timeout, and a failure says what never happened.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

#: How often the condition is asked again: short next to any timeout a test uses.
POLL_S = 0.02


def wait_for(condition: Callable[[], T], timeout_s: float, what: str) -> T:
    """The first true value ``condition()`` returns; ``AssertionError`` naming ``what`` if
    none comes within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(POLL_S)
    return value
