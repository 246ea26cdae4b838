"""Handlers for the "why it failed, and where" tests: each fails in a known function, so a
test can look for that function's name in what the attempt kept."""

from __future__ import annotations

import sys
import time


def outer_frame(message: str = "deep") -> None:
    inner_frame(message)


def inner_frame(message: str) -> None:
    raise RuntimeError(message)


def fail_with_url(url: str) -> None:
    """A handler that names a URL with a password in what it raises and prints."""
    print(f"connecting to {url}", flush=True)
    raise ConnectionError(f"cannot reach {url}")


def print_then_fail(lines: int = 3) -> None:
    for n in range(lines):
        print(f"stdout line {n}", flush=True)
        print(f"stderr line {n}", file=sys.stderr, flush=True)
    raise ValueError("after printing")


def sleep_then_return(seconds: float) -> str:
    time.sleep(seconds)
    return "done"
