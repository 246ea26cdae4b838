"""What the supervisor's commands do to an attempt, wherever it is: pending (not yet sent),
queued in a busy child's channel, or running.

    kill(task_id)   pending → settled now; queued → withdrawn (never starts) and settled;
                  running → its child's tree is killed, the death settles it
    fence(task_id)  moves the fence deadline (and the running child's guard)
    soft(task_id)   the soft signal now; however it ends, it is ``interrupted``
    cancel_all    every attempt ends as ``interrupted`` (a cancelling close)

Runs on the supervisor thread only. An attempt that ends here reports itself
(``Attempt.settle``); ``collect`` reads what a child already sent, so an attempt that
returned is not killed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from sandboxq.models import Outcome
from sandboxq.pool.handles import Attempt, Child


def find(children: Iterable[Child], pending: deque[Attempt], task_id: int) -> Attempt | None:
    for child in children:
        if child.running is not None and child.running.task_id == task_id:
            return child.running
        for attempt in child.queued:
            if attempt.task_id == task_id:
                return attempt
    for attempt in pending:
        if attempt.task_id == task_id:
            return attempt
    return None


def soft_stop(children: Iterable[Child], task_id: int) -> None:
    for child in children:
        run = child.running
        if run is not None and run.task_id == task_id:
            run.soft_outcome = Outcome.INTERRUPTED
            if not run.soft_sent:
                child.signal_soft(run)


def extend_fence(
    children: list[Child], pending: deque[Attempt], task_id: int, deadline: float
) -> None:
    attempt = find(children, pending, task_id)
    if attempt is None:
        return
    attempt.fence_deadline = deadline
    for child in children:
        if child.running is attempt:
            child.sync_fence()


def kill(
    children: list[Child],
    pending: deque[Attempt],
    collect: Callable[[Child], Any],
    task_id: int,
    outcome: Outcome,
    detail: str,
) -> None:
    for child in children:
        if child.running is not None and child.running.task_id == task_id:
            collect(child)
        run = child.running
        if run is not None and run.task_id == task_id:
            if run.kill_outcome is None:
                child.kill(outcome, detail)
            return
        for attempt in child.queued:
            if attempt.task_id == task_id:
                if child.withdraw(attempt):
                    child.queued.remove(attempt)
                    attempt.settle(outcome, None, detail=detail)
                else:  # it has started: killed as soon as the parent sees it running
                    attempt.kill_outcome, attempt.kill_detail = outcome, detail
                return
    for attempt in pending:
        if attempt.task_id == task_id:
            pending.remove(attempt)
            attempt.settle(outcome, None, detail=detail)
            return


def cancel_all(children: list[Child], pending: deque[Attempt]) -> None:
    why = "the pool was shut down"
    while pending:
        pending.popleft().settle(Outcome.INTERRUPTED, None, detail=why)
    for child in children:
        for attempt in child.queued:
            attempt.kill_outcome, attempt.kill_detail = Outcome.INTERRUPTED, why
        if child.running is not None and child.running.kill_outcome is None:
            child.kill(Outcome.INTERRUPTED, why)
