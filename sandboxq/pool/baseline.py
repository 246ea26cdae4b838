"""What a child's next attempt relies on, as the child was set up: checked after every
attempt, so that one attempt's changes to its process reach no other job.

    child start ── record(): the descriptors 0, 1 and 2 (which file each is), the
                   ``sys.std*`` objects, and the signals the parent sends (their handler,
                   and that they are not blocked)
    each attempt's end ── changed(): what differs, or None ──► the child is replaced
                          before its next task (child.py: ``shared[STATE_CHANGED]``)

Why replace, not restore: a process reused for the next job is only worth its start
time saved while it is as it was, and an attempt can change it in more ways than a
restore would know (a stream replaced, a descriptor closed and its number reused). Found
by a handler that closed ``sys.stdout``: every later job on that child failed printing;
one that ignored every signal: the next job got no soft signal and was killed at its hard
deadline, its cleanup never run. What a module of the handler keeps between jobs (a
cache, a connection) is the handler's own, as in any pool that reuses its processes.

Cost: 5 us a job in the child, most of it three ``fstat``.
"""

from __future__ import annotations

# The C module: ``signal``'s wrappers turn every handler and signal number into an enum
# member, which made a check 8 us instead of 5.
import _signal  # type: ignore[import-not-found]
import os
import sys
from typing import Any

#: Per descriptor 0-2: (device, inode) of its file, or None when it was closed.
_Files = tuple[tuple[int, int] | None, ...]

_files: _Files = ()
_streams: tuple[Any, ...] = ()
_handlers: dict[int, Any] = {}


def _open_files() -> _Files:
    found: list[tuple[int, int] | None] = []
    for fd in (0, 1, 2):
        try:
            st = os.fstat(fd)
        except OSError:
            found.append(None)
        else:
            found.append((st.st_dev, st.st_ino))
    return tuple(found)


def record(signals: tuple[int, ...]) -> None:
    """In the child, once set up: what ``changed`` compares with. ``signals``: those the
    parent sends it (the soft timeout, the stack dump)."""
    global _files, _streams, _handlers
    _files = _open_files()
    _streams = (sys.stdin, sys.stdout, sys.stderr)
    _handlers = {int(sig): _signal.getsignal(sig) for sig in signals}


def changed() -> str | None:
    """What the attempt changed of the recorded state, in a few words; None if nothing."""
    if _open_files() != _files:
        return "closed or replaced its stdin, stdout or stderr descriptor"
    stdin, stdout, stderr = _streams
    if not (sys.stdin is stdin and sys.stdout is stdout and sys.stderr is stderr) or any(
        getattr(stream, "closed", False) for stream in _streams
    ):
        return "closed or replaced sys.stdin, sys.stdout or sys.stderr"
    blocked = _signal.pthread_sigmask(_signal.SIG_BLOCK, [])
    for sig, handler in _handlers.items():
        if sig in blocked or _signal.getsignal(sig) is not handler:
            return f"blocked signal {sig} or changed its handler"
    return None
