"""The pool's memory budget (``pool_memory_mb``): its children together stay under it, and
the pool, not the kernel's OOM killer, picks which attempt ends.

    supervisor select ── wait_s: its timeout includes the next check (while any runs)
    MemoryBudget.check(children, now), every CGROUP_CHECK_S (cgroup modes: one file
    read) or memory_check_interval_s (process_tree: every child's tree RSS, summed):
        usage >= budget - margin, and no pressure kill still in flight
            ─► the most recently started running attempt: tree kill, outcome
               memory_pressure, its ``infra_death`` says why (the worker requeues it
               uncharged and counts it against the job, as a helper's death is: a job
               that causes it every time is stopped as ``poison``, and a job with such
               a count runs alone, where it alone can be blamed)

In a cgroup mode the children's groups sit in the pool's group, which is given the
budget as its kernel limit too: should the children outgrow the checks, the kernel's OOM
killer can only pick one of them. The fork server and the worker are outside that group,
so they are never the ones to die.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from sandboxq.models import Outcome
from sandboxq.pool.containment import Containment
from sandboxq.pool.handles import Child
from sandboxq.pool.running import MB, Attempt
from sandboxq.text import guarded_logger

log = guarded_logger("sandboxq.pool")

#: How much of the budget is kept free: the children must not reach the kernel's limit
#: between two checks (with 4 children growing 250 MB/s each, 10 ms is 10 MB).
MARGIN_FRACTION = 0.1
MIN_MARGIN_MB = 16.0
#: How often the pool group's charge is read in a cgroup mode (one small file read).
CGROUP_CHECK_S = 0.01


class MemoryBudget:
    def __init__(self, budget_mb: float, contain: Containment, sample_every_s: float) -> None:
        self.budget_mb = budget_mb
        self.margin_mb = max(MIN_MARGIN_MB, budget_mb * MARGIN_FRACTION)
        self._contain = contain
        self._every_s = CGROUP_CHECK_S if contain.cgroups else sample_every_s
        self._next = 0.0
        self._victim: Attempt | None = None  # the pressure kill still in flight
        #: Attempts ended to keep the pool within its budget.
        self.kills = 0
        contain.limit_pool_memory(int(budget_mb * MB))

    def wait_s(self, children: Iterable[Child], timeout: float | None) -> float | None:
        """The select's ``timeout``, shortened to wake for the next check while any
        attempt runs."""
        if not any(c.running is not None for c in children):
            return timeout
        left = max(0.0, self._next - time.monotonic())
        return left if timeout is None else min(timeout, left)

    def check(self, children: list[Child], now: float) -> None:
        if now < self._next:
            return
        self._next = now + self._every_s
        victim = self._victim
        if victim is not None and victim.task_id in victim.live:
            return  # its memory is not given back until it is dead and reaped
        self._victim = None
        running = [c for c in children if c.running is not None and c.running.kill_outcome is None]
        if not running:
            return
        usage = self._contain.pool_usage()
        if usage is None:
            usage = sum(c.rss() for c in children)
        if usage < (self.budget_mb - self.margin_mb) * MB:
            return
        child = max(running, key=lambda c: c.running.started if c.running else 0.0)
        run = child.running
        assert run is not None
        why = (
            f"the pool's memory budget ran short ({usage / MB:.0f} MB of pool_memory_mb "
            f"{self.budget_mb:g}): the most recently started attempt was ended"
        )
        log.warning("child %d: %s", child.pid, why)
        run.infra_death = why
        child.kill(Outcome.MEMORY_PRESSURE, why)
        self._victim = run
        self.kills += 1
