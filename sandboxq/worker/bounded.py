"""Calls that may not outlast a deadline: what a stopping worker does against a backend
that may hang.

    call_until(fn, deadline)   fn() on a daemon thread; its answer, or BackendError when the
                               deadline (``time.monotonic()``) passes first
    run_until(fn, timeout_s)   the same for a step whose answer nobody needs (errors logged)

A blocking socket read cannot be interrupted from another thread, so the call runs on a
thread of its own that is left behind (a daemon: it ends with the process) when the time
is up. Only used once a stop has a deadline: the hot path calls the backend directly.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from sandboxq.errors import BackendError
from sandboxq.text import guarded_logger

log = guarded_logger("sandboxq.worker")

T = TypeVar("T")


def call_until(fn: Callable[[], T], deadline: float) -> T:
    if deadline == math.inf:
        return fn()
    box: dict[str, object] = {}

    def call() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=call, name="sandboxq-bounded-call", daemon=True)
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()))
    if thread.is_alive():
        raise BackendError("no answer from the backend before the stop deadline")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


def run_until(fn: Callable[[], None], timeout_s: float | None) -> None:
    deadline = math.inf if timeout_s is None else time.monotonic() + timeout_s
    try:
        call_until(fn, deadline)
    except Exception as exc:
        log.warning("while stopping: %s", exc)
