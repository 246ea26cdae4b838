"""Deadline enforcement: how long the supervisor's select may wait, and what is due when
it wakes.

A running attempt has up to six times (``Attempt.next_event``): its soft deadline (the
soft signal), ``DUMP_EARLY_S`` before its hard deadline (asked for its stack, stacks.py,
and its tree walked once, ``Child.look_before_kill``), its hard deadline (a tree kill,
whatever the dump did), its fence deadline (a tree kill: the lease was not renewed in
time), a kill asked with its stack first (``Attempt.kill_due``: a stop's) and, where
memory is sampled, its next sample. A policy
may end it too, as a hard timeout does (the soft signal, then a tree kill ``end_grace_s``
later): its job's ``deadline_s`` and the progress watchdog (``Attempt.ending_due``). The
select waits until the nearest of them over every child, so nothing polls and a kill lands
within a millisecond or two of its deadline.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from sandboxq.models import Outcome
from sandboxq.pool.attempt import HARD_KILL, MEMORY_KILL, SELF_FENCE, SOFT_SIGNAL, Task
from sandboxq.pool.handles import Child
from sandboxq.pool.running import Attempt, tell
from sandboxq.pool.stacks import DUMP_EARLY_S
from sandboxq.pool.teardown import kill_at_deadline

#: Longest single select(): epoll cannot wait 25 days (2**31 ms), and a 30-day hard timeout
#: is a legitimate setting, so a far deadline is reached through several waits.
MAX_SELECT_S = 3600.0


def wait_s(children: Iterable[Child], now: float) -> float | None:
    """How long the select may wait from ``now`` (None: until something happens)."""
    times = [t for c in children if c.running and (t := c.running.next_event())]
    return min(MAX_SELECT_S, max(0.0, min(times) - now)) if times else None


def end_overdue(pending: deque[Attempt], now: float) -> None:
    """Attempts still waiting for a child when their job's deadline_s passed, or its
    max_queue_s since it became runnable, end now, never started: a wait behind busy
    children (a job the worker claimed ahead) must not become a run past either."""
    if not any(_late(a.task, now) for a in pending):
        return
    for attempt in list(pending):
        if (late := _late(attempt.task, now)) is not None:
            pending.remove(attempt)
            attempt.settle(late[0], None, now, detail=late[1])


def _late(task: Task, now: float) -> tuple[Outcome, str] | None:
    if task.deadline_at is not None and now >= task.deadline_at:
        return Outcome.DEADLINE, "the job's deadline_s passed before the attempt could start"
    if task.start_by is not None and now >= task.start_by:
        return Outcome.EXPIRED, "not started within max_queue_s of becoming runnable"
    return None


def pending_due(pending: deque[Attempt]) -> float | None:
    """When the first of ``pending`` runs out of deadline_s or max_queue_s (None: none
    has either): the supervisor's select wakes for it."""
    times = [t for a in pending for t in (a.task.deadline_at, a.task.start_by) if t is not None]
    return min(times) if times else None


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
        # The fence first: past it the lease is gone, whatever else came due while this
        # process was stopped (the guard killed the child there; a hard_timeout reported
        # after was charged and acked on a lease another worker may hold).
        if run.fence_deadline is not None and now >= run.fence_deadline:
            detail = "the lease could not be renewed in time"
            tell(run, child.pid, SELF_FENCE, detail)
            kill_at_deadline(child, Outcome.LEASE_LOST, detail)
        elif run.kill_due is not None and now >= run.kill_due.at:
            kill_at_deadline(child, run.kill_due.outcome, run.kill_due.detail)
        elif run.hard_deadline is not None and now >= run.hard_deadline:
            hard = run.task.hard_timeout_s
            detail = f"killed at the hard deadline of {hard:g} s"
            tell(run, child.pid, HARD_KILL, detail)
            kill_at_deadline(child, Outcome.HARD_TIMEOUT, detail)
        elif run.ending is not None and run.end_kill_at is not None and now >= run.end_kill_at:
            detail = f"{run.end_detail}; killed after a grace of {run.task.end_grace_s:g} s"
            tell(run, child.pid, HARD_KILL, detail)
            kill_at_deadline(child, run.ending, detail)
        else:
            if run.ending is None and (ending := run.ending_due(now)) is not None:
                child.end_softly(run, *ending, now)
            if run.soft_deadline is not None and not run.soft_sent and now >= run.soft_deadline:
                tell(run, child.pid, SOFT_SIGNAL, f"soft timeout of {run.task.soft_timeout_s:g} s")
                child.signal_soft(run)
            kill_at = run.kill_at()
            if kill_at is not None and not run.hard_stack_asked and now >= kill_at - DUMP_EARLY_S:
                child.ask_stack_before_kill(run)
                child.look_before_kill()
            due = run.memory_check_at is not None and now >= run.memory_check_at
            if due and (why := child.over_memory(run, now, memory_every)) is not None:
                tell(run, child.pid, MEMORY_KILL, why)
                child.kill(Outcome.MEMORY_LIMIT, why)
