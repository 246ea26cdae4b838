"""One submitted attempt as the supervisor tracks it (``Attempt``): pending, sent to a
child, running, then settled with its ``AttemptResult``; its deadlines and what ends it.

Deadlines are ``time.monotonic()`` values; they are set when an attempt *starts* (is handed
to an idle child, or becomes the running one after its predecessor in the channel ends).
The child it runs in is ``handles.Child``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import psutil

from sandboxq.models import Outcome, now_ms
from sandboxq.pool.attempt import AttemptResult, Task
from sandboxq.pool.stacks import DUMP_EARLY_S
from sandboxq.text import guarded_logger

if TYPE_CHECKING:
    from sandboxq.pool.handles import Child

OnDone = Callable[[AttemptResult], None]
log = guarded_logger("sandboxq.pool")
MB = 1024 * 1024


def call(fn: Callable[..., None], *args: Any) -> None:
    """Call a user's callback on the supervisor thread: its bug must not take that down."""
    try:
        fn(*args)
    except Exception:
        log.exception("pool callback %r failed", fn)


def tell(run: Attempt, pid: int | None, event: str, detail: str) -> None:
    """What is about to be done to ``run`` (in child ``pid``; None: it is dead already),
    to its task's ``on_event`` (tracing's span events), before it is done: a child about
    to be killed can still be read."""
    if run.task.on_event is not None:
        call(run.task.on_event, event, detail, pid)


class DueKill(NamedTuple):
    """A kill asked with the stack first (``Pool.kill(..., stack_first=True)``): the child
    is asked for its stack now and killed at ``at``, ``DUMP_EARLY_S`` later, as a hard
    timeout's kill is; the attempt then ends with ``outcome``."""

    at: float
    outcome: Outcome
    detail: str


class Attempt:
    """One submitted attempt: pending, then sent to a child: running at once if the child
    was idle, else queued in its channel until the one before it ends (deadlines in
    ``time.monotonic()``, set when it starts running).

    ``child`` is the child it was sent to (None while pending). ``live`` is the
    supervisor's index of the attempts not yet settled, by task id: the supervisor adds
    an attempt when it takes the submit, ``settle`` removes it.
    """

    __slots__ = (
        "child",
        "end_detail",
        "end_kill_at",
        "ending",
        "fence_deadline",
        "hard_deadline",
        "hard_stack_asked",
        "infra_death",
        "kill_detail",
        "kill_due",
        "kill_outcome",
        "live",
        "memory_check_at",
        "on_done",
        "peak_rss",
        "pinned",
        "progress_deadline",
        "rss_base",
        "soft_deadline",
        "soft_outcome",
        "soft_sent",
        "soft_stack",
        "started",
        "started_ms",
        "stopped_at_kill",
        "take_back_after",
        "task",
        "task_id",
        "tree",
    )

    def __init__(self, task_id: int, task: Task, on_done: OnDone, live: dict[int, Attempt]) -> None:
        self.task_id = task_id
        self.task = task
        self.on_done = on_done
        self.live = live
        self.child: Child | None = None
        #: Queued behind another attempt and not to be taken back (it started: assign.py).
        self.pinned = False
        #: Not taken back before this (``time.monotonic()``): a try found its child slow
        #: to stop.
        self.take_back_after = 0.0
        self.started = 0.0
        self.started_ms: int | None = None
        self.soft_deadline: float | None = None
        self.hard_deadline: float | None = None
        self.memory_check_at: float | None = None
        self.fence_deadline = task.fence_deadline
        self.soft_sent = False
        self.soft_stack: str | None = None  # dumped at the soft signal (stacks.py)
        self.hard_stack_asked = False  # asked for its stack just before the hard kill
        #: The child's state letter when that kill came, if it was stopped (T, t): then it
        #: could not dump the stack asked (stacks.stopped_note).
        self.stopped_at_kill: str | None = None
        self.soft_outcome = Outcome.SOFT_TIMEOUT  # what ending after the soft signal means
        self.kill_outcome: Outcome | None = None
        self.kill_detail: str | None = None
        self.kill_due: DueKill | None = None  # a kill that asked for the stack first
        self.infra_death: str | None = None  # a helper of the pool died while it ran: what
        self.tree: list[psutil.Process] = []  # descendants seen while sampling memory
        self.rss_base = 0  # the child's resident memory when this attempt started
        # A policy's end (deadline_s, the progress watchdog): soft signal, then tree kill.
        self.progress_deadline: float | None = None
        self.ending: Outcome | None = None  # the outcome of that end, once begun
        self.end_detail: str | None = None
        self.end_kill_at: float | None = None
        # the most the sampled tree grew over rss_base (process_tree; None: no sample yet)
        self.peak_rss: int | None = None

    def start(self, now: float, memory_every: float, at_ms: int | None = None) -> None:
        task = self.task
        self.started = now
        self.started_ms = at_ms if at_ms is not None else now_ms()
        self.soft_deadline = now + task.soft_timeout_s if task.soft_timeout_s else None
        self.hard_deadline = now + task.hard_timeout_s if task.hard_timeout_s else None
        self.memory_check_at = now + memory_every if task.max_memory_mb else None
        if task.progress_timeout_s:
            self.progress_deadline = now + task.progress_timeout_s

    def progressed(self, now: float) -> None:
        """It called ``progress()``: the watchdog counts again from ``now``."""
        if self.progress_deadline is not None and self.ending is None:
            self.progress_deadline = now + (self.task.progress_timeout_s or 0.0)

    def ending_due(self, now: float) -> tuple[Outcome, str] | None:
        """The policy that ends this attempt at ``now``, if one has come: its job's
        deadline_s, else the watchdog (the parent judges from the progress it sees)."""
        task = self.task
        if task.deadline_at is not None and now >= task.deadline_at:
            return Outcome.DEADLINE, "the job's deadline_s ran out during this attempt"
        if self.progress_deadline is not None and now >= self.progress_deadline:
            return (
                Outcome.PROGRESS_TIMEOUT,
                f"no progress() for {task.progress_timeout_s:g} s: ended as hung",
            )
        return None

    def settle(
        self,
        outcome: Outcome,
        pid: int | None,
        now: float | None = None,
        at_ms: int | None = None,
        **fields: Any,
    ) -> None:
        """Report how this attempt ended to its ``on_done`` (``now`` / ``at_ms``: the
        moment, when the caller already read the clocks)."""
        self.live.pop(self.task_id, None)
        if now is None:
            now = time.monotonic()
        result = AttemptResult(
            self.task_id,
            outcome,
            pid=pid,
            started_ms=self.started_ms,
            ended_ms=at_ms if at_ms is not None else now_ms(),
            runtime_s=now - self.started if self.started_ms else None,
            **fields,
        )
        if self.task.max_memory_mb is not None and self.started_ms:  # a memory-limited run
            result.memory_limit_mb = self.task.max_memory_mb
            result.peak_memory_mb = self.peak_mb()
        call(self.on_done, result)

    def peak_mb(self) -> float | None:
        """The most its tree grew over its start, MB: its control group's high-water mark
        where it has one, else the largest sample (``Child.over_memory``)."""
        group = self.child.group if self.child is not None else None
        peak = group.peak_growth() if group is not None else None
        if peak is None:
            peak = self.peak_rss
        return None if peak is None else round(peak / MB, 1)

    def due(self, now: float) -> bool:
        """Whether a deadline or a memory sample of this attempt has come."""
        event = self.next_event()
        return event is not None and now >= event

    def kill_at(self) -> float | None:
        """When a deadline kills it, the sooner of its hard deadline and a policy's end
        (``deadline_s``, the progress watchdog): its stack is asked ``DUMP_EARLY_S`` before."""
        if self.end_kill_at is None:
            return self.hard_deadline
        if self.hard_deadline is None:
            return self.end_kill_at
        return min(self.hard_deadline, self.end_kill_at)

    def next_event(self) -> float | None:
        if self.kill_outcome is not None:
            return None  # killed; waiting for the sentinel
        times = [self.hard_deadline, self.memory_check_at, self.fence_deadline]
        if self.kill_due is not None:
            times.append(self.kill_due.at)
        if not self.soft_sent:
            times.append(self.soft_deadline)
        kill_at = self.kill_at()
        if kill_at is not None and not self.hard_stack_asked:
            times.append(kill_at - DUMP_EARLY_S)
        if self.ending is None:
            times += (self.task.deadline_at, self.progress_deadline)
        else:
            times.append(self.end_kill_at)
        return min((t for t in times if t is not None), default=None)
