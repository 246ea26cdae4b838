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


def fail_naming_an_undecodable_file(progress: bool = False) -> None:
    """A file name that is not UTF-8, as the file system hands it over (a lone surrogate
    per undecodable byte), in what the handler raises, prints and reports as progress."""
    import os

    from sandboxq import current_job

    path = os.fsdecode(b"/uploads/\xff.png")
    print(f"opening {path}", flush=True)
    if progress:
        current_job().progress(0.5, f"at {path}")
    raise ValueError(f"cannot thumbnail {path}")


def print_then_fail(lines: int = 3) -> None:
    for n in range(lines):
        print(f"stdout line {n}", flush=True)
        print(f"stderr line {n}", file=sys.stderr, flush=True)
    raise ValueError("after printing")


def sleep_then_return(seconds: float) -> str:
    time.sleep(seconds)
    return "done"
