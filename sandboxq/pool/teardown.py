"""A deadline kill whose outcome does not wait for the kernel to tear the processes down.

    deadlines.enforce ─► kill_at_deadline(child, outcome, detail)
        cgroup v2:   cgroup.kill ─────────────────────────┐ every process of the attempt
        cgroup v1:   freeze, SIGKILL all, FROZEN, recheck ┤ has SIGKILL pending and none
        process tree: SIGSTOP the tree until nothing new,  │ can run another instruction
                      SIGKILL every process stopped, and   │ of its own
                      kill what escaped the tree ──────────┘
          ──► the outcome is settled now (its overshoot measured now)
          ──► v1: thaw, so the pending SIGKILLs act
        later, in the select: the child's sentinel ─► deaths.bury: reaped, the group
              removed once empty (never waited for), no second kill or orphan sweep

Why: a burst of 200 processes took the kernel 140 to 160 ms to tear down, and the outcome
waited for it (and, in process-tree mode, the supervisor thread waited inside the sweep,
delaying every other child's deadline). A process that is frozen, or stopped, with SIGKILL
pending is as good as dead for the attempt's outcome: it runs no more code of its own.

Where the guarantee cannot be had in time (the v1 freezer does not reach FROZEN within
``FREEZE_WAIT_S``: a task in an uninterruptible wait), the kill falls back to the old
path: kill, wait until dead, outcome from the child's sentinel.
"""

from __future__ import annotations

import signal
from collections import deque

from sandboxq.models import Outcome
from sandboxq.pool import deaths, server
from sandboxq.pool.handles import Child
from sandboxq.pool.kill import kill_stopped, stopped_state
from sandboxq.pool.running import Attempt

#: How long a v1 kill waits for its group to read FROZEN before it falls back.
FREEZE_WAIT_S = 0.05


def kill_at_deadline(child: Child, outcome: Outcome, detail: str) -> None:
    """Kill the attempt ``child`` runs; settle it now when nothing of it can run again."""
    run = child.running
    assert run is not None
    run.kill_outcome, run.kill_detail = outcome, detail
    if run.hard_stack_asked:
        # Read before the kill, which stops the tree itself: a child stopped already ran
        # no handler for the dump signal (a stopped process takes none but SIGKILL), and
        # its empty traceback says why (stacks.stopped_note).
        run.stopped_at_kill = stopped_state(child.pid)
    group = child.group
    if group is not None:
        stopped = group.kill_pending(FREEZE_WAIT_S)
    else:
        # what memory sampling saw may have been re-parented out of the tree since
        kill_stopped(child.pid, include_root=True, known=run.tree)
        # and what the handler moved out of it (clone(CLONE_PARENT), or a daemon once it
        # turned its subreaper flag off) is the fork server's child: about 2 us to look
        server.kill_escaped()
        stopped = True
    if not stopped:
        child.kill_all(run.tree)  # the old path: its sentinel settles the attempt
        return
    _settle_now(child, run)
    if group is not None:
        group.thaw()  # after the outcome: the pending SIGKILLs act once thawed


def _settle_now(child: Child, run: Attempt) -> None:
    child.doomed = True  # deaths.bury: reap it, remove its group, kill nothing twice
    deaths.settle_death(child, run, -signal.SIGKILL, deque())
    child.sync_fence()  # nothing runs: the guard has no deadline to hold for it
