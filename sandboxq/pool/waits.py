"""Waiting on a descriptor with ``poll(2)``, never ``select(2)``.

``select`` refuses descriptors numbered 1024 and above ("filedescriptor out of range"),
and a service that embeds a worker while it holds a thousand sockets gives every pipe
the pool opens afterwards such a number: the guard crash-looped on it and the supervisor
thread died at its first hard timeout. ``poll`` takes any descriptor.
"""

from __future__ import annotations

import math
import select
from collections.abc import Sequence
from typing import Protocol


class _HasFileno(Protocol):
    def fileno(self) -> int: ...


Waitable = int | _HasFileno


def _fd(waitable: Waitable) -> int:
    return waitable if isinstance(waitable, int) else waitable.fileno()


def _poll_ms(timeout_s: float | None) -> int | None:
    # rounded up: a wait of 0.4 ms is a wait, not a look
    return None if timeout_s is None else max(0, math.ceil(timeout_s * 1000))


def readable_among(fds: Sequence[Waitable], timeout_s: float | None) -> list[int]:
    """The descriptors of ``fds`` that are readable (or closed, or in error) within
    ``timeout_s`` (None: until one is); empty when none is by then."""
    poller = select.poll()
    for waitable in fds:
        poller.register(_fd(waitable), select.POLLIN)
    return [fd for fd, _ in poller.poll(_poll_ms(timeout_s))]


def readable(waitable: Waitable, timeout_s: float | None = 0.0) -> bool:
    """Whether ``waitable`` is readable (or at its end) within ``timeout_s``."""
    return bool(readable_among([waitable], timeout_s))


def writable(waitable: Waitable, timeout_s: float | None) -> bool:
    """Whether ``waitable`` has room for a write within ``timeout_s``."""
    poller = select.poll()
    poller.register(_fd(waitable), select.POLLOUT)
    return bool(poller.poll(_poll_ms(timeout_s)))
