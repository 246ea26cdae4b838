"""The supervisor's handle on each pool process: one ``Child`` per process (the child's
own loop is child.py), what can be done to a child (soft signal, tree kill, withdrawing a
queued task, memory sample), and how an attempt that answered is settled
(``Child.finish``). The attempts themselves are ``running.Attempt``.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

import psutil

from sandboxq.models import Outcome, now_ms
from sandboxq.pool import server, stacks
from sandboxq.pool.cgroups import Group
from sandboxq.pool.channel import Channel
from sandboxq.pool.child import (
    CHANNEL_LOST,
    DESCRIPTORS_FULL,
    RING,
    SIGSOFT,
    STARTED,
    STATE_CHANGED,
    THREADS_LEFT,
    WITHDRAWN,
    WITHDRAWN_RING,
)
from sandboxq.pool.guard import Fence
from sandboxq.pool.kill import descendant_pids, kill_tree, resume, stop, tree_rss
from sandboxq.pool.messages import Failed, Finished
from sandboxq.pool.output import ChildOutput
from sandboxq.pool.running import MB, Attempt
from sandboxq.pool.stacks import StackFile
from sandboxq.text import bounded_traceback, guarded_logger

log = guarded_logger("sandboxq.pool")


def soft_cause(run: Attempt) -> str | None:
    """What sent ``run`` its soft signal, in words: a policy's end (deadline_s, the
    watchdog), or its soft timeout; None for the others (a withdrawal, a cancel)."""
    if run.end_detail:
        return run.end_detail
    if run.soft_outcome is Outcome.SOFT_TIMEOUT and run.task.soft_timeout_s:
        return f"past its soft timeout of {run.task.soft_timeout_s:g} s"
    return None


class Child:
    """A pool process: at most one running attempt, and while jobs are short, up to
    a few more already sent down its channel (queued, not started: supervisor.py)."""

    __slots__ = (
        "conn",
        "doomed",
        "fence",
        "group",
        "jobs_done",
        "output",
        "pid",
        "process",
        "queued",
        "ready",
        "recycle",
        "retiring",
        "rss_after",
        "rss_ready",
        "running",
        "server_died",
        "shared",
        "soft_task_id",
        "stacks",
    )

    def __init__(self, process: Any, conn: Channel, soft_task_id: Any, shared: Any) -> None:
        self.process = process
        self.conn = conn
        self.soft_task_id = soft_task_id  # shared: which attempt the soft signal is meant for
        self.fence = Fence(None)  # its slot in the guard's table (guard.py), once guarded
        self.shared = shared  # shared: the task it started last, the tasks withdrawn (child.py)
        #: The process that runs the handler: the one the pool started, or with a PID
        #: namespace (pid_namespace.py), from Ready on, the one two below it.
        self.pid: int = process.pid
        self.ready = False
        self.retiring = False
        self.running: Attempt | None = None
        self.queued: deque[Attempt] = deque()
        self.jobs_done = 0
        self.server_died = False  # the fork server died under it
        self.recycle = False  # replace it once its queued tasks are done (memory)
        self.rss_ready: int = 0  # resident memory when it became ready
        self.rss_after: int | None = None  # sampled after its last attempt, until the next
        self.group: Group | None = None  # its control group, in a cgroup mode
        self.stacks: StackFile | None = None  # where it dumps its stack (stacks.py)
        self.output: ChildOutput | None = None  # its stdout and stderr (output.py)
        self.doomed = False  # killed, its attempt settled already (teardown.py)

    def assigned(self) -> int:
        return self.jobs_done + (self.running is not None) + len(self.queued)

    def sync_fence(self) -> None:
        """Tell the pool's guard the running attempt's fence deadline (none: nothing runs)."""
        run = self.running
        self.fence.deadline = run.fence_deadline if run is not None else None

    def rss(self) -> int:
        return tree_rss(self.pid)[0]

    def begin(self, run: Attempt, now: float, every: float, at_ms: int | None = None) -> None:
        """``run`` starts now; with a memory limit, from the child's present memory (its
        limit applies to what it adds, not to what earlier attempts left)."""
        run.start(now, every, at_ms)
        limit = run.task.max_memory_mb
        if limit is not None:
            run.rss_base = self.rss_after if self.rss_after is not None else self.rss()
        self.rss_after = None
        if self.group is not None:
            # In a cgroup mode the kernel enforces the attempt's limit: no sampling.
            self.group.limit_memory(int(limit * MB) if limit else None)
            if limit:
                self.group.start_peak()  # its high-water mark: the attempt's peak
            run.memory_check_at = None

    def finish(
        self, run: Attempt, msg: Finished | Failed, max_growth_mb: float | None
    ) -> tuple[float, int]:
        """The running ``run`` answered with ``msg``: settle it as the child reported (or
        as its soft signal decided) and count it. Returns when it ended (monotonic, and
        epoch ms), read once: the end of this attempt is the start of the next."""
        self.running = None
        now, at_ms = time.monotonic(), now_ms()
        if self.group is None:  # a cgroup mode's sweep found them in the group already
            server.sweep_escaped()  # out of the child's tree, before the outcome is told
        # Where it was when asked (at the soft signal, or it ended in the moment between
        # the request before the hard kill and the kill): every thread, as it was.
        asked = run.soft_sent or run.hard_stack_asked
        stack = self.asked_stack() if asked else None
        out = self.output.take(run.task_id) if self.output is not None else None
        limit, group = run.task.max_memory_mb, self.group
        told = {"output": out, "peak_rss": msg.peak_rss}  # what every outcome below carries
        if limit and group is not None and group.oom_killed_since_start():
            # The kernel killed a process of its tree at the group's limit (a grandchild
            # that grew), and the handler went on to answer: the attempt still went over
            # its limit, as the process-tree mode's sampling would have found.
            did = "returned" if isinstance(msg, Finished) else "raised"
            detail = (
                f"the kernel OOM-killed a process of its tree at its limit of {limit:g} MB "
                f"(the handler then {did})"
            )
            tb = None if isinstance(msg, Finished) else bounded_traceback(msg.error.traceback)
            run.settle(
                Outcome.MEMORY_LIMIT, self.pid, now, at_ms, detail=detail, traceback=tb, **told
            )
        elif isinstance(msg, Finished):
            outcome = run.soft_outcome if run.soft_sent else Outcome.OK
            stack = (
                stacks.with_soft_stack(stack, run.soft_stack) if outcome is not Outcome.OK else None
            )
            why = soft_cause(run) if run.soft_sent else None
            done = {"result": msg.result, "traceback": stack, "detail": why}
            run.settle(outcome, self.pid, now, at_ms, **done, **told)
        else:
            outcome = run.soft_outcome if run.soft_sent else Outcome.ERROR
            # Bounded by the child already; again here, as a handler may send its own. A
            # raise after the soft signal keeps every thread's stack at the signal too (a
            # thread that did the waiting is not in the raise's traceback), after it: with
            # a dump in it, the cut keeps the beginning (text.bounded_traceback).
            dumped = stacks.with_soft_stack(stack, run.soft_stack) if run.soft_sent else None
            both = f"{msg.error.traceback}\n{dumped}" if dumped else msg.error.traceback
            tb = bounded_traceback(both)
            why = soft_cause(run) if run.soft_sent else None
            run.settle(
                outcome, self.pid, now, at_ms, error=msg.error, traceback=tb, detail=why, **told
            )
        self.jobs_done += 1
        if self.shared[THREADS_LEFT] == run.task_id:
            self.recycle = True  # replaced before its next task (child.py says why)
            _threads_left.warn(self.pid, run.task.job_id)
        if self.shared[DESCRIPTORS_FULL] == run.task_id:
            self.recycle = True  # the same, for a full descriptor table (descriptors.py)
            _descriptors_full.warn(self.pid, run.task.job_id)
        if run.task.max_memory_mb is not None or max_growth_mb is not None:
            self.check_after(run, max_growth_mb)
        return now, at_ms

    def asked_stack(self) -> str | None:
        """The stack the child dumped when asked (stacks.py). Nothing at all means its
        handler broke its dumping (blocked the signal, replaced its handler, closed the
        file): the child is replaced once its attempt ends, so the next one has it."""
        if self.stacks is None:
            return None
        stack = self.stacks.take()
        if stack is None:
            self.recycle = True
        return stack

    def ask_stack_before_kill(self, run: Attempt) -> None:
        """``DUMP_EARLY_S`` before ``run``'s hard deadline: ask for the stack it hangs in
        (the one dumped at its soft signal is kept, in case this one never comes)."""
        run.hard_stack_asked = True
        if self.stacks is None:
            return
        if run.soft_sent:
            run.soft_stack = self.stacks.take()
        stacks.ask(self.pid)

    def look_before_kill(self) -> None:
        """Shortly before a deadline kill in the process-tree mode: walk its tree once, so
        /proc's entries of its processes are made when the kill walks it (for a fresh
        200-fork burst here, the first walk took 3.4 ms and the next 1.7; the outcome came
        1.3-1.5 ms sooner)."""
        if self.group is None:
            descendant_pids(self.pid)

    def stack_at_death(self, run: Attempt) -> str | None:
        """Once the child is dead: the stack it dumped last (asked before the hard kill,
        or written as it crashed), then the one of its soft signal. Asked, but stopped
        when killed: why it dumped none, in the stack's place."""
        stack = self.stacks.take() if self.stacks is not None else None
        if stack is None and self.stacks is not None and run.stopped_at_kill is not None:
            stack = stacks.stopped_note(run.stopped_at_kill)
        return stacks.with_soft_stack(stack, run.soft_stack)

    def check_after(self, run: Attempt, max_growth_mb: float | None) -> None:
        """After ``run``: a child over that attempt's limit, or grown by more than
        ``max_growth_mb`` since it started, is replaced before it takes another task."""
        rss = self.rss_after = self.rss()
        limit = run.task.max_memory_mb
        if limit is not None and rss > limit * MB:
            self.recycle = True
        if max_growth_mb is not None and rss - self.rss_ready > max_growth_mb * MB:
            self.recycle = True

    def started(self, run: Attempt) -> bool:
        """Whether the child started ``run`` (read once it is dead or stopped)."""
        return bool(self.shared[STARTED] == run.task_id)

    def warn_if_retired_itself(self) -> None:
        """Once it is dead: when it ended itself after its last task's reply, having
        changed what the next task relies on (child.py), say so (once a minute)."""
        last = self.shared[STATE_CHANGED]
        if last and last == self.shared[STARTED]:
            _state_changed.warn(self.pid, None)

    def lost_channel(self, run: Attempt) -> bool:
        """Whether ``run``'s reply could not be sent: the handler closed or broke the
        child's channel (read once the child is dead)."""
        return bool(self.shared[CHANNEL_LOST] == run.task_id)

    def withdraw(self, attempt: Attempt, stop_within_s: float = 0.5) -> bool | None:
        """Take a task back from the child's channel before it starts: True if it will
        never run, False if it has started. The child is stopped meanwhile, so it cannot
        start it half-way; None if it did not stop within ``stop_within_s`` (nothing was
        done: a later try may do it)."""
        if not stop(self.pid, stop_within_s):
            return None
        try:
            if self.shared[STARTED] == attempt.task_id:
                return False
            count = self.shared[WITHDRAWN]
            self.shared[RING + count % WITHDRAWN_RING] = attempt.task_id
            self.shared[WITHDRAWN] = count + 1
            return True
        finally:
            resume(self.pid)

    def signal_soft(self, run: Attempt) -> None:
        run.soft_sent = True
        if self.stacks is not None:
            stacks.ask(self.pid)  # first: where it is stuck, before SoftTimeout moves it
        # The child raises SoftTimeout only if it still runs this task, so the signal
        # can never land in the next task it took from its channel.
        self.soft_task_id.value = run.task_id
        try:
            os.kill(self.pid, SIGSOFT)
        except ProcessLookupError:
            pass

    def end_softly(self, run: Attempt, outcome: Outcome, detail: str, now: float) -> None:
        """End ``run`` as a hard timeout ends (a policy's end: its deadline_s, the
        watchdog): the soft signal now, unless it was sent already, so that however it
        ends it is ``outcome``; its tree is killed ``end_grace_s`` later (deadlines.py)."""
        run.ending, run.end_detail = outcome, detail
        run.soft_outcome = outcome
        run.end_kill_at = now + run.task.end_grace_s
        if not run.soft_sent:
            self.signal_soft(run)

    def lose_server(self, why: str, what: str) -> bool:
        """The fork server died (and this child with it): its attempt is interrupted, not
        charged, and its exit code (multiprocess's 255) is not the handler's. Returns
        whether that attempt had started: then it carries ``what`` died
        (``infra_death``), to be counted against its job."""
        run = self.running
        blamed = False
        if run is not None and run.kill_outcome is None:
            run.kill_outcome, run.kill_detail = Outcome.INTERRUPTED, why
            if self.started(run):
                run.infra_death, blamed = what, True
        self.server_died = True
        self.kill_all(run.tree if run else ())
        return blamed

    def refuse(self, error: Exception) -> None:
        """The child sent what cannot be decoded (``error``): its fault alone. Kill it; its
        running attempt ends as an error that says why."""
        run = self.running
        if run is not None and run.kill_outcome is None:
            self.kill(Outcome.ERROR, f"a message from the child could not be decoded ({error})")
        else:
            kill_tree(self.pid)

    def kill(self, outcome: Outcome, detail: str, *, thaw: bool = True) -> None:
        """Kill the tree running ``self.running``, which then ends with ``outcome``
        (``thaw``: see ``Group.kill``)."""
        run = self.running
        assert run is not None
        run.kill_outcome, run.kill_detail = outcome, detail
        self.kill_all(run.tree, thaw=thaw)

    def kill_all(self, known: Iterable[psutil.Process] = (), *, thaw: bool = True) -> None:
        """SIGKILL the child and everything it started: its control group, else its tree."""
        if self.group is not None:
            self.group.kill(thaw=thaw)
        else:
            kill_tree(self.pid, known)

    def explain_death(self, run: Attempt) -> None:
        """An OOM kill in the group of a memory-limited attempt: it ends as memory_limit,
        as the kernel's own counter says, not as a crash. A reply the handler's own code
        kept from leaving (it closed or broke the channel): an error that says so, not
        the quiet exit that followed."""
        if run.kill_outcome is None and self.lost_channel(run):
            run.kill_outcome = Outcome.ERROR
            run.kill_detail = (
                "the handler closed or broke the child's channel to the parent, so its "
                "outcome could not be sent; the child was replaced"
            )
            return
        if run.kill_outcome is None and self.process.exitcode == -stacks.DUMP_SIGNAL:
            # Its handler reset the dump signal to its default action (terminate), and
            # our request for its stack ended it: the kill we were about to make.
            if run.kill_due is not None:  # a stop's kill, which asks first
                run.kill_outcome, when = run.kill_due.outcome, f"as {run.kill_due.detail}"
            elif run.hard_stack_asked:
                run.kill_outcome, when = Outcome.HARD_TIMEOUT, "just before its hard deadline"
            else:
                run.kill_outcome, when = run.soft_outcome, "at its soft timeout"
            run.kill_detail = (
                f"asked for its stack {when}, it died of {stacks.DUMP_SIGNAL_NAME}: its "
                "handler had reset that signal to its default action"
            )
            return
        limit, group = run.task.max_memory_mb, self.group
        if (
            limit
            and group is not None
            and run.kill_outcome is None
            and group.oom_killed_since_start()
        ):
            run.kill_outcome = Outcome.MEMORY_LIMIT
            run.kill_detail = f"the kernel OOM-killed it at its limit of {limit:g} MB"

    def over_memory(self, run: Attempt, now: float, every: float) -> str | None:
        """Sample the tree's memory; the reason to kill it, if it is over its limit."""
        assert run.task.max_memory_mb is not None
        rss, tree = tree_rss(self.pid)
        run.tree = list({p.pid: p for p in (*run.tree, *tree)}.values())
        run.memory_check_at = now + every
        grown = rss - run.rss_base
        run.peak_rss = grown if run.peak_rss is None else max(run.peak_rss, grown)
        if grown > run.task.max_memory_mb * MB:
            return (
                f"used {grown / MB:.0f} MB more than at its start, over the limit of "
                f"{run.task.max_memory_mb:g} MB"
            )
        return None


class _LeftBehindWarning:
    """The warning that an attempt left its child what only a replacement clears, once a
    minute at most: a handler that does so every time has its child replaced every time,
    and a line per job would bury the log (the line says how many since the last one)."""

    EVERY_S = 60.0

    def __init__(self, what: str) -> None:
        self._what = what
        self._lock = threading.Lock()  # one per process; pools' supervisors share it
        self._last = -math.inf
        self._unsaid = 0

    def warn(self, pid: int, job_id: str | None) -> None:
        now = time.monotonic()
        with self._lock:
            self._unsaid += 1
            if now - self._last < self.EVERY_S:
                return
            self._last, count, self._unsaid = now, self._unsaid, 0
        of = f" of job {job_id}" if job_id else ""
        more = f" ({count - 1} more children since the last such line)" if count > 1 else ""
        log.warning(
            "child %d: the attempt%s %s; the child is replaced before its next task%s",
            pid,
            of,
            self._what,
            more,
        )


_threads_left = _LeftBehindWarning("left Python threads running (keep_strays=True keeps them)")
_descriptors_full = _LeftBehindWarning("left no file descriptor free")
_state_changed = _LeftBehindWarning(
    "changed its process past setting back (its stdio, the pool's signals, its limits, "
    "or a thread left running)"
)
