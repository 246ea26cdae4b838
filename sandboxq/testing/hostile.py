"""Handlers that attack the pool itself rather than their own attempt: each must end its
own attempt and nothing else (design invariant 11).

Use them as processors by path, e.g. ``"sandboxq.testing.hostile:kill_parent"``.

| handler              | in a Pool                      | through a worker               |
|----------------------|--------------------------------|--------------------------------|
| kill_parent          | interrupted, its cause naming  | ``poison`` once the fork server|
|                      | the fork server's death (and   | died under it                  |
|                      | ``infra_death`` set)           | ``max_infra_deaths`` times (3);|
|                      |                                | the worker goes on serving     |
| scribble_descriptors | error ("could not be decoded": | the same                       |
|                      | only its own channel took it)  |                                |
| close_descriptors    | error ("closed or broke the    | the same                       |
|                      | child's channel")              |                                |
| list_descriptors     | ok: ``{fd: what it leads to}`` | ok                             |

Before a child runs any of its user's code it keeps only its channel to the parent and
stdio (``sandboxq.pool.descriptors``), so a scribbler reaches its own channel and
/dev/null, never the fork server's "alive" pipe or the resource tracker's.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

#: What ``scribble_descriptors`` writes: not a frame the parent can read, not text.
GARBAGE = b"\xff\xfe\x00garbage\x80\x81" * 8


def kill_parent() -> None:
    """SIGKILLs its parent, the pool's fork server, then waits to die with it (its
    parent-death signal)."""
    os.kill(os.getppid(), signal.SIGKILL)
    while True:
        time.sleep(1)


def _descriptors() -> list[int]:
    return sorted(int(name) for name in os.listdir("/proc/self/fd"))


def scribble_descriptors() -> int:
    """Writes garbage to every descriptor above stderr it holds, then returns how many took
    it. What it wrote into its own channel ends the attempt as an error."""
    took = 0
    for fd in _descriptors():
        if fd <= 2:
            continue
        try:
            os.write(fd, GARBAGE)
            took += 1
        except OSError:
            pass
    return took


def close_descriptors() -> str:
    """Closes every descriptor above stderr and returns normally: its outcome can no longer
    reach the parent."""
    os.closerange(3, 65536)
    return "closed"


def list_descriptors() -> dict[str, str]:
    """Every descriptor the child holds while it runs a handler, and what it leads to."""
    found = {}
    for fd in _descriptors():
        try:
            found[str(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed by now
            continue
    return found


def call(name: str, *args: Any) -> Any:
    """Runs ``name``, a handler of this module or of ``sandboxq.testing.handlers``, with
    ``args``: one pool, hostile and ordinary jobs side by side."""
    from sandboxq.testing import handlers

    found: Any = globals()[name] if name in __all__ else getattr(handlers, name)
    return found(*args)


__all__ = [
    "call",
    "close_descriptors",
    "kill_parent",
    "list_descriptors",
    "scribble_descriptors",
]
