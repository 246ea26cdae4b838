"""The commands other threads send the supervisor thread, and what each one does to an
attempt wherever it is: pending (not yet sent), queued in a busy child's channel, or running.

    Submit(attempt)             indexed by its task id, then pending
    Kill(task_id, outcome)      pending → settled now; queued → withdrawn (never starts) and
                                settled, or, if the child started it meanwhile, killed once
                                the parent sees it running; running → its child's tree is
                                killed, the death settles it (``stack_first``: asked for
                                its stack, killed ``DUMP_EARLY_S`` later by deadlines.py)
    Fence(task_id, deadline)    moves the fence deadline (and the running child's guard),
                                unless it has come while the attempt runs
    Soft(task_id)               the soft signal now; however it ends, it is ``interrupted``
    EndUnstarted(outcome)       every pending attempt ends with ``outcome``, never run
    Close(cancel)               put once submits are refused; with ``cancel``, every attempt
                                ends as ``interrupted``

Any thread puts a command in the supervisor's ``Mailbox`` (a deque, and one byte on a
wake pipe the supervisor's select watches; not for a submit that could not start before
the supervisor's next wake anyway: ``Mailbox.put``); the supervisor thread runs them in
order (``run``). A command finds its attempt by task id in the supervisor's index of attempts
not yet settled; an id that is not there has ended already, and the command does nothing,
unless it was given out (``Pool.new_task_id``) and not submitted yet: a cancel or a lost
lease can name an attempt before its ``Submit`` comes, and is then done as it comes
(``Reserved``). An attempt that ends here reports itself (``Attempt.settle``);
``collect`` reads what a child already sent, so an attempt that returned is not killed.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from sandboxq.models import Outcome
from sandboxq.pool.guard import fence_came
from sandboxq.pool.handles import Child
from sandboxq.pool.running import Attempt, DueKill
from sandboxq.pool.stacks import DUMP_EARLY_S


@dataclass(frozen=True, slots=True)
class Submit:
    """Run ``attempt`` (``Pool.execute``)."""

    attempt: Attempt


@dataclass(frozen=True, slots=True)
class _ForTask:
    """A command about one attempt, named by its task id."""

    task_id: int


@dataclass(frozen=True, slots=True)
class Kill(_ForTask):
    """End the attempt now with ``outcome`` (``Pool.kill``); with ``stack_first``, a running
    one is asked for its stack and killed ``DUMP_EARLY_S`` later."""

    outcome: Outcome
    detail: str
    stack_first: bool = False


@dataclass(frozen=True, slots=True)
class Fence(_ForTask):
    """Move the attempt's fence deadline, a ``time.monotonic()`` (``Pool.extend_fence``)."""

    deadline: float


@dataclass(frozen=True, slots=True)
class Soft(_ForTask):
    """Soft-signal the attempt now; it ends as interrupted (``Pool.soft_stop``)."""


@dataclass(frozen=True, slots=True)
class EndUnstarted:
    """End every attempt not yet sent to a child with ``outcome`` (``Pool.end_unstarted``)."""

    outcome: Outcome
    detail: str


@dataclass(frozen=True, slots=True)
class Close:
    """The pool is shutting down; ``cancel``: end every attempt (``Pool.shutdown``)."""

    cancel: bool


Command = Submit | Kill | Fence | Soft | EndUnstarted | Close


class Mailbox:
    """Commands from any thread to the supervisor thread: a deque, and a wake pipe whose
    read end (``fd``) is in the supervisor's select."""

    def __init__(self) -> None:
        self.queue: deque[Command] = deque()
        self.fd, self._wake_w = os.pipe()
        os.set_blocking(self.fd, False)
        self._woken = False
        self._shut = False
        #: Set by the supervisor thread before it waits: tasks are left pending after its
        #: last assignment, so one more at their end could not start before its next wake.
        self.surplus = False

    def put(self, command: Command, lazy: bool = False) -> None:
        """Queue ``command`` and wake the supervisor (any thread). ``lazy`` (a submit
        whose start nothing times): no wake while the supervisor has ``surplus``; it
        takes the command at its next wake, before it assigns (a wake byte per job cost
        the supervisor a turn of its loop each).

        The append comes before the read of ``surplus``, and the supervisor writes
        ``surplus`` before it reads the deque: a put that saw a stale True was appended
        before that read, so the supervisor takes it instead of waiting."""
        self.queue.append(command)
        if not (lazy and self.surplus):
            self.wake()

    def wake(self) -> None:
        """Wake the supervisor (any thread), with or without a command queued."""
        # One wake byte per batch of commands: the supervisor clears the flag before
        # taking from the deque, so a command appended while it is set is always seen.
        if not self._woken and not self._shut:
            self._woken = True
            try:
                os.write(self._wake_w, b"\0")
            except OSError:  # the supervisor has exited and closed the pipe
                pass

    def take(self) -> deque[Command]:
        """Consume the wake byte and return the queue, for the supervisor thread to pop
        from the left until empty (commands put meanwhile are taken in the same turn)."""
        try:
            os.read(self.fd, 4096)
        except (BlockingIOError, OSError):
            pass
        self._woken = False
        return self.queue

    def shut(self) -> None:
        """The supervisor thread is done: no more wake bytes."""
        self._shut = True

    def close(self) -> None:
        """Close the wake pipe, once the supervisor thread has stopped."""
        if self._shut and self.fd >= 0:
            os.close(self.fd)
            os.close(self._wake_w)
            self.fd = self._wake_w = -1


class Reserved:
    """Task ids given out (``Pool.new_task_id``, any thread) whose ``Submit`` has not come,
    and the commands that named one of them first (supervisor thread): the caller records
    an attempt's id before it submits it, and a cancel or a lost lease may be sent in
    between. They are done when it comes, in the order they came."""

    def __init__(self) -> None:
        self.ids: set[int] = set()
        self._early: dict[int, list[Kill | Fence | Soft]] = {}

    def hold(self, command: Kill | Fence | Soft) -> None:
        if command.task_id in self.ids:
            self._early.setdefault(command.task_id, []).append(command)

    def submitted(self, task_id: int) -> list[Kill | Fence | Soft]:
        self.ids.discard(task_id)
        return self._early.pop(task_id, []) if self._early else []


def run(
    command: Command,
    live: dict[int, Attempt],
    pending: deque[Attempt],
    children: Iterable[Child],
    collect: Callable[[Child], Any],
    reserved: Reserved,
) -> None:
    """Do what ``command`` says (on the supervisor thread)."""
    match command:
        case Submit():
            # First, and without a sub-pattern: a Submit comes with every job, and in
            # Python 3.11 capturing its field costs more than the rest of its handling.
            live[command.attempt.task_id] = command.attempt
            pending.append(command.attempt)
            for early in reserved.submitted(command.attempt.task_id):
                run(early, live, pending, children, collect, reserved)
        case Kill() | Fence() | Soft():
            if (found := live.get(command.task_id)) is None:
                reserved.hold(command)  # ended, or not submitted yet (then done when it is)
            else:
                _act_on(found, command, pending, collect)
        case EndUnstarted(outcome, detail):
            while pending:
                pending.popleft().settle(outcome, None, detail=detail)
        case Close(cancel):
            if cancel:
                cancel_all(children, pending)


def _act_on(
    attempt: Attempt,
    command: Kill | Fence | Soft,
    pending: deque[Attempt],
    collect: Callable[[Child], Any],
) -> None:
    match command:
        case Kill(_, outcome, detail, stack_first):
            kill(attempt, pending, collect, outcome, detail, stack_first)
        case Fence(_, deadline):
            extend_fence(attempt, deadline)
        case Soft():
            soft_stop(attempt)


def kill(
    attempt: Attempt,
    pending: deque[Attempt],
    collect: Callable[[Child], Any],
    outcome: Outcome,
    detail: str,
    stack_first: bool = False,
) -> None:
    child = attempt.child
    if child is None:
        pending.remove(attempt)
        attempt.settle(outcome, None, detail=detail)
    elif child.running is attempt:
        collect(child)
        if child.running is not attempt or attempt.kill_outcome is not None:
            return
        if stack_first and child.stacks is not None:
            # Where it was when stopped, as a hard timeout's kill has it (deadlines.py
            # kills at ``at``); a later kill without the wait still kills at once.
            if not attempt.hard_stack_asked:
                child.ask_stack_before_kill(attempt)
            if attempt.kill_due is None:
                attempt.kill_due = DueKill(time.monotonic() + DUMP_EARLY_S, outcome, detail)
        else:
            child.kill(outcome, detail)
    elif child.withdraw(attempt):
        child.queued.remove(attempt)
        attempt.settle(outcome, None, detail=detail)
    else:  # it has started: killed as soon as the parent sees it running
        attempt.kill_outcome, attempt.kill_detail = outcome, detail


def extend_fence(attempt: Attempt, deadline: float) -> None:
    """Move ``attempt``'s fence deadline, unless it runs and its deadline has come: the guard
    may have killed its child on it already. A renewal that lands after that (the worker
    was stopped with one on its way) would make the fence's kill read as a crash."""
    child = attempt.child
    if child is None or child.running is not attempt:
        attempt.fence_deadline = deadline  # not in the guard's table
        return
    old = attempt.fence_deadline
    if fence_came(old, time.monotonic()):
        return
    attempt.fence_deadline = deadline
    child.sync_fence()
    if fence_came(old, time.monotonic()):  # as the slot was written: the guard read the old
        attempt.fence_deadline = old
        child.sync_fence()


def soft_stop(attempt: Attempt) -> None:
    child = attempt.child
    if child is not None and child.running is attempt:
        attempt.soft_outcome = Outcome.INTERRUPTED
        if not attempt.soft_sent:
            child.signal_soft(attempt)


def cancel_all(children: Iterable[Child], pending: deque[Attempt]) -> None:
    why = "the pool was shut down"
    while pending:
        pending.popleft().settle(Outcome.INTERRUPTED, None, detail=why)
    for child in children:
        for attempt in child.queued:
            attempt.kill_outcome, attempt.kill_detail = Outcome.INTERRUPTED, why
        if child.running is not None and child.running.kill_outcome is None:
            child.kill(Outcome.INTERRUPTED, why)
