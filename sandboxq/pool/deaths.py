"""A child is gone: how each of its attempts ends.

    the child died (its sentinel) ──► bury(): kill what it left (its group, else its tree,
                                      and the orphans below the fork server), then
        running attempt: started? → settled with the outcome its death explains
                                    (our kill's reason, an OOM kill in its group, the CPU
                                    limit, an exit code, the guard's fence, else a crash)
                                    and the stack it dumped last (stacks.py)
                         not started → back to the front of pending, uncharged
        queued attempts: never started → back to pending, in order (one killed while
                                    queued ends with its kill's outcome)
    the fork server died ──► server_died(): every child died with it; each attempt is
                             interrupted, not charged, and each child buried as above;
                             a started attempt carries the death (``infra_death``):
                             the worker counts it against its job
    the pool stops ──► stop_all(): channels closed, a grace to exit, then every tree
                       killed; what still ran ends as its (cancelling) kill says

Runs on the supervisor thread only; the supervisor unregisters the child from its select
and counts start failures, this module decides outcomes.
"""

from __future__ import annotations

import signal
import time
from collections import deque
from collections.abc import Callable

from sandboxq.models import Outcome
from sandboxq.pool import server
from sandboxq.pool.attempt import SELF_FENCE, signal_name
from sandboxq.pool.containment import Containment
from sandboxq.pool.guard import fence_came
from sandboxq.pool.handles import Child
from sandboxq.pool.kill import descendants
from sandboxq.pool.running import Attempt, tell
from sandboxq.text import guarded_logger

log = guarded_logger("sandboxq.pool")

#: How long the supervisor waits for a child whose sentinel fired to be reaped, and, at
#: shutdown, for children to exit on their own once their channels are closed.
EXIT_GRACE_S = 1.0


def bury(child: Child, exitcode: int | None, pending: deque[Attempt], contain: Containment) -> None:
    """``child`` died with ``exitcode`` and was reaped: end or requeue its attempts."""
    run = child.running
    if not child.doomed:  # a deadline kill (teardown.py) killed everything already
        # What it left behind: re-parented to the fork server when it died on its own (in
        # a control group, the group holds it wherever it went).
        child.kill_all(run.tree if run else ())
        server.sweep_orphans()
    server.forget(child.process.pid)
    if run is not None:
        settle_death(child, run, exitcode, pending)
    # After: its OOM-kill counter names the outcome. Never waited for after a deadline kill.
    contain.remove(child.group, wait=not child.doomed)
    if child.stacks is not None:
        child.stacks.close()  # after: its last stack was read
    if child.output is not None:
        child.output.close()  # after: its last output was taken
    # Queued attempts never started: back to the front of the line, in order.
    for attempt in reversed(child.queued):
        if attempt.kill_outcome is not None:
            attempt.settle(attempt.kill_outcome, None, detail=attempt.kill_detail)
        else:
            attempt.child = None
            pending.appendleft(attempt)
    child.queued.clear()
    child.process.close()


def settle_death(child: Child, run: Attempt, exitcode: int | None, pending: deque[Attempt]) -> None:
    """End ``run``, which ``child`` was running when it died with ``exitcode``."""
    child.running = None
    if not child.started(run) and run.kill_outcome is None:
        # It died before it started this one (between tasks): not this task's fault.
        run.child = None
        pending.appendleft(run)
        return
    child.explain_death(run)
    if child.server_died or child.lost_channel(run):
        exitcode = None  # the code of its quiet exit is ours, not the handler's
    outcome, detail, code, signum = death_outcome(run, exitcode)
    if outcome is Outcome.LEASE_LOST and run.kill_outcome is None:  # the guard's fence kill
        tell(run, None, SELF_FENCE, f"{detail} (killed by the pool's guard)")
    overshoot = kill_overshoot_s(run, outcome, time.monotonic())  # metrics
    run.settle(
        outcome,
        child.pid,
        exitcode=code,
        signal=signum,
        detail=detail,
        kill_overshoot_s=overshoot,
        infra_death=run.infra_death,
        traceback=child.stack_at_death(run),
        output=child.output.take(run.task_id) if child.output is not None else None,
    )


def server_died(
    children: list[Child], dead: int | None, how: str, on_exit: Callable[[Child], None]
) -> int:
    """The fork server (pid ``dead``) died, and every child with it (their parent-death
    signal): their attempts end as interrupted, not charged, with the cause. Returns how
    many of them had started: each of their jobs is charged with the death, so a job
    present at repeated deaths is stopped (design invariant 11); a death under none is
    the pool's own."""
    what = f"the pool's fork server (pid {dead}) {how}"
    why = f"{what}; the attempt was not charged"
    log.error("%s; starting a fresh one", what)
    blamed = 0
    for child in list(children):
        blamed += child.lose_server(why, what)  # killed and gone: its exit is handled now
        on_exit(child)
    return blamed


def stop_all(children: list[Child], pending: deque[Attempt]) -> None:
    """Close every channel, give the children a moment to exit, then kill what is left."""
    # Seen while each child lives: once it exits, a grandchild that left its process
    # group (setsid) is re-parented and no longer found under it.
    trees = {child.pid: descendants(child.pid) for child in children}
    for child in children:
        if not child.conn.closed:
            child.conn.close()
    deadline = time.monotonic() + EXIT_GRACE_S
    for child in children:
        child.process.join(max(0.0, deadline - time.monotonic()))
    for child in children:
        run = child.running
        child.kill_all((*(run.tree if run else ()), *trees.get(child.pid, ())))
        child.process.join(EXIT_GRACE_S)
        if run is not None:  # only after a supervisor crash or a cancelling close
            settle_death(child, run, child.process.exitcode, pending)
        for attempt in child.queued:
            attempt.settle(Outcome.INTERRUPTED, None, detail="the pool stopped")
        if child.stacks is not None:
            child.stacks.close()
        if child.output is not None:
            child.output.close()
        server.forget(child.process.pid)
        if child.process.exitcode is not None:
            child.process.close()
        else:  # killed, but its exit not reported (its fork server stopped again, or hangs)
            log.warning("child %d: killed, its exit not reported by its fork server", child.pid)
    server.sweep_orphans()  # kept strays and daemons of children that died on their own


def kill_overshoot_s(run: Attempt, outcome: Outcome, now: float) -> float | None:
    """How late the deadline kill that ended ``run`` with ``outcome`` landed, reaped at
    ``now`` (None: not a deadline kill). The fence's kill is often the pool's guard, which
    strikes up to GUARD_EARLY_S early on purpose: that counts as on time (0). A lease
    lost earlier than that (a rejected renewal) had no deadline to be late for."""
    if outcome is Outcome.HARD_TIMEOUT and run.hard_deadline is not None:
        return max(0.0, now - run.hard_deadline)
    if outcome is run.ending and run.end_kill_at is not None:  # deadline_s, the watchdog
        return max(0.0, now - run.end_kill_at)
    fence = run.fence_deadline
    if outcome is Outcome.LEASE_LOST and fence is not None and fence_came(fence, now):
        return max(0.0, now - fence)
    return None


def death_outcome(
    run: Attempt, exitcode: int | None
) -> tuple[Outcome, str, int | None, int | None]:
    """How ``run`` ended when its child died with ``exitcode`` (multiprocess's: negative for
    a signal): its outcome, why in words, and the exit code or the signal."""
    signum = -exitcode if exitcode is not None and exitcode < 0 else None
    code = exitcode if exitcode is not None and exitcode >= 0 else None
    fence = run.fence_deadline
    if run.kill_outcome is not None:  # we killed it, and said why
        return run.kill_outcome, run.kill_detail or str(run.kill_outcome), code, signum
    if signum == signal.SIGXCPU:
        return Outcome.CPU_LIMIT, "the attempt used up its CPU time (cpu_time_s)", code, signum
    if code is not None:
        return Outcome.EXIT, f"the handler exited with code {code}", code, signum
    if signum == signal.SIGKILL and fence_came(fence, time.monotonic()):
        # the pool's guard (guard.py): the lease was not renewed in time
        return Outcome.LEASE_LOST, "the lease could not be renewed in time", code, signum
    return Outcome.CRASHED, f"the child was killed by {signal_name(signum or 0)}", code, signum
