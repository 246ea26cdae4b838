"""The processor of the dashboard tests' worker: one route per kind of job."""

from __future__ import annotations

import os
import time
from typing import Any

from sandboxq import current_job


def route(kind: str, arg: Any = None) -> Any:
    if kind == "ok":
        return {"echo": arg}
    if kind == "fail":
        raise ValueError(f"failed on purpose: {arg}")
    if kind == "gate":
        # Half way, then wait until the test creates the file ``arg`` (a barrier the test
        # releases once it has seen the progress), then finish.
        current_job().progress(0.5, "half way")
        deadline = time.monotonic() + 30
        while not os.path.exists(arg) and time.monotonic() < deadline:
            time.sleep(0.02)
        # a bidi override: shown as its escape, or it would reverse what follows it
        current_job().progress(1.0, "released \u202e!won")
        return "released"
    raise ValueError(f"unknown kind {kind!r}")
