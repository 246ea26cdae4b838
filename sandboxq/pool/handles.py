"""The supervisor's records: one ``Attempt`` per submitted task, one ``Child`` per process
(the parent's handle on it; the child's own loop is child.py), what can be done to a
child (soft signal, tree kill, withdrawing a queued task, memory sample), and how an
attempt that answered is settled (``Child.finish``).

Deadlines are ``time.monotonic()`` values; they are set when an attempt *starts* (is handed
to an idle child, or becomes the running one after its predecessor in the channel ends).
"""

from __future__ import annotations

import logging
import os
import select
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import psutil

from sandboxq.models import Outcome, now_ms
from sandboxq.pool.attempt import AttemptResult, Task
from sandboxq.pool.cgroups import Group
from sandboxq.pool.channel import Channel
from sandboxq.pool.child import CHANNEL_LOST, RING, SIGSOFT, STARTED, WITHDRAWN, WITHDRAWN_RING
from sandboxq.pool.guard import Fence
from sandboxq.pool.kill import kill_tree, resume, stop, tree_rss
from sandboxq.pool.messages import Failed, Finished

OnDone = Callable[[AttemptResult], None]
log = logging.getLogger("sandboxq.pool")
MB = 1024 * 1024


def call(fn: Callable[..., None], *args: Any) -> None:
    """Call a user's callback on the supervisor thread: its bug must not take that down."""
    try:
        fn(*args)
    except Exception:
        log.exception("pool callback %r failed", fn)


def readable(channel: Channel) -> bool:
    return bool(select.select([channel], [], [], 0)[0])


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
        "fence_deadline",
        "hard_deadline",
        "infra_death",
        "kill_detail",
        "kill_outcome",
        "live",
        "memory_check_at",
        "on_done",
        "rss_base",
        "soft_deadline",
        "soft_outcome",
        "soft_sent",
        "started",
        "started_ms",
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
        self.started = 0.0
        self.started_ms: int | None = None
        self.soft_deadline: float | None = None
        self.hard_deadline: float | None = None
        self.memory_check_at: float | None = None
        self.fence_deadline = task.fence_deadline
        self.soft_sent = False
        self.soft_outcome = Outcome.SOFT_TIMEOUT  # what ending after the soft signal means
        self.kill_outcome: Outcome | None = None
        self.kill_detail: str | None = None
        self.infra_death: str | None = None  # a helper of the pool died while it ran: what
        self.tree: list[psutil.Process] = []  # descendants seen while sampling memory
        self.rss_base = 0  # the child's resident memory when this attempt started

    def start(self, now: float, memory_every: float, at_ms: int | None = None) -> None:
        task = self.task
        self.started = now
        self.started_ms = at_ms if at_ms is not None else now_ms()
        self.soft_deadline = now + task.soft_timeout_s if task.soft_timeout_s else None
        self.hard_deadline = now + task.hard_timeout_s if task.hard_timeout_s else None
        self.memory_check_at = now + memory_every if task.max_memory_mb else None

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
        call(self.on_done, result)

    def due(self, now: float) -> bool:
        """Whether a deadline or a memory sample of this attempt has come."""
        event = self.next_event()
        return event is not None and now >= event

    def next_event(self) -> float | None:
        if self.kill_outcome is not None:
            return None  # killed; waiting for the sentinel
        times = [self.hard_deadline, self.memory_check_at, self.fence_deadline]
        if not self.soft_sent:
            times.append(self.soft_deadline)
        return min((t for t in times if t is not None), default=None)


class Child:
    """A pool process: at most one running attempt, and while jobs are short, up to
    a few more already sent down its channel (queued, not started: supervisor.py)."""

    __slots__ = (
        "conn",
        "doomed",
        "fence",
        "group",
        "jobs_done",
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
    )

    def __init__(self, process: Any, conn: Channel, soft_task_id: Any, shared: Any) -> None:
        self.process = process
        self.conn = conn
        self.soft_task_id = soft_task_id  # shared: which attempt the soft signal is meant for
        self.fence = Fence(None)  # its slot in the guard's table (guard.py), once guarded
        self.shared = shared  # shared: the task it started last, the tasks withdrawn (child.py)
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
            run.memory_check_at = None

    def finish(
        self, run: Attempt, msg: Finished | Failed, max_growth_mb: float | None
    ) -> tuple[float, int]:
        """The running ``run`` answered with ``msg``: settle it as the child reported (or
        as its soft signal decided) and count it. Returns when it ended (monotonic, and
        epoch ms), read once: the end of this attempt is the start of the next."""
        self.running = None
        now, at_ms = time.monotonic(), now_ms()
        if isinstance(msg, Finished):
            outcome = run.soft_outcome if run.soft_sent else Outcome.OK
            run.settle(outcome, self.pid, now, at_ms, result=msg.result)
        else:
            outcome = run.soft_outcome if run.soft_sent else Outcome.ERROR
            run.settle(outcome, self.pid, now, at_ms, error=msg.error)
        self.jobs_done += 1
        if run.task.max_memory_mb is not None or max_growth_mb is not None:
            self.check_after(run, max_growth_mb)
        return now, at_ms

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

    def lost_channel(self, run: Attempt) -> bool:
        """Whether ``run``'s reply could not be sent: the handler closed or broke the
        child's channel (read once the child is dead)."""
        return bool(self.shared[CHANNEL_LOST] == run.task_id)

    def withdraw(self, attempt: Attempt) -> bool:
        """Take a task back from the child's channel before it starts: True if it will
        never run. The child is stopped meanwhile, so it cannot start it half-way."""
        if not stop(self.pid):
            return False
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
        # The child raises SoftTimeout only if it still runs this task, so the signal
        # can never land in the next task it took from its channel.
        self.soft_task_id.value = run.task_id
        try:
            os.kill(self.pid, SIGSOFT)
        except ProcessLookupError:
            pass

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
        if grown > run.task.max_memory_mb * MB:
            return (
                f"used {grown / MB:.0f} MB more than at its start, over the limit of "
                f"{run.task.max_memory_mb:g} MB"
            )
        return None
