"""Deadline enforcement: how long the supervisor's select may wait, and what is due when
it wakes.

A running attempt has up to four times (``Attempt.next_event``): its soft deadline (the
soft signal), its hard deadline (a tree kill), its fence deadline (a tree kill: the lease
was not renewed in time) and, where memory is sampled, its next sample. The select waits
until the nearest of them over every child, so nothing polls and a kill lands within a
millisecond or two of its deadline.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from sandboxq.models import Outcome
from sandboxq.pool.handles import Child
from sandboxq.pool.teardown import kill_at_deadline

#: Longest single select(): epoll cannot wait 25 days (2**31 ms), and a 30-day hard timeout
#: is a legitimate setting, so a far deadline is reached through several waits.
MAX_SELECT_S = 3600.0


def wait_s(children: Iterable[Child], now: float) -> float | None:
    """How long the select may wait from ``now`` (None: until something happens)."""
    times = [t for c in children if c.running and (t := c.running.next_event())]
    return min(MAX_SELECT_S, max(0.0, min(times) - now)) if times else None


def enforce(
    children: list[Child], now: float, collect: Callable[[Child], Any], memory_every: float
) -> None:
    """Act on every deadline and memory sample that has come by ``now``."""
    for child in list(children):  # collect may retire a child and start its replacement
        run = child.running
        if run is None or run.kill_outcome is not None or not run.due(now):
            continue
        # Read what it already sent first: an attempt that returned before its deadline
        # is reported as it ended, whatever the deadline would have made of it.
        collect(child)
        if child.running is not run:
            continue
        if run.hard_deadline is not None and now >= run.hard_deadline:
            hard = run.task.hard_timeout_s
            kill_at_deadline(
                child, Outcome.HARD_TIMEOUT, f"killed at the hard deadline of {hard:g} s"
            )
        elif run.fence_deadline is not None and now >= run.fence_deadline:
            kill_at_deadline(child, Outcome.LEASE_LOST, "the lease could not be renewed in time")
        else:
            if run.soft_deadline is not None and not run.soft_sent and now >= run.soft_deadline:
                child.signal_soft(run)
            due = run.memory_check_at is not None and now >= run.memory_check_at
            if due and (why := child.over_memory(run, now, memory_every)) is not None:
                child.kill(Outcome.MEMORY_LIMIT, why)
