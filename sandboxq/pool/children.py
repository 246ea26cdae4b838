"""The supervisor's records: one ``Attempt`` per submitted task, one ``Child`` per process,
what can be done to a child (soft signal, tree kill, memory sample), and how an attempt
ended when its child died (``death_outcome``).

Deadlines are ``time.monotonic()`` values; they are set when an attempt *starts* (is handed
to an idle child, or becomes the running one after its predecessor in the channel ends).
"""

from __future__ import annotations

import os
import select
import signal
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import psutil

from sandboxq.models import Outcome
from sandboxq.pool.attempt import AttemptResult, Task, signal_name
from sandboxq.pool.cgroups import Group
from sandboxq.pool.channel import Channel
from sandboxq.pool.child import FENCE_CHECK_S, SIGSOFT
from sandboxq.pool.kill import kill_tree, tree_rss

OnDone = Callable[[AttemptResult], None]


def readable(channel: Channel) -> bool:
    return bool(select.select([channel], [], [], 0)[0])


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class Attempt:
    """One submitted attempt: pending, then queued in a child, then running (deadlines in
    ``time.monotonic()``, set when it starts)."""

    __slots__ = (
        "fence_deadline",
        "hard_deadline",
        "kill_detail",
        "kill_outcome",
        "memory_check_at",
        "on_done",
        "soft_deadline",
        "soft_outcome",
        "soft_sent",
        "started",
        "started_ms",
        "task",
        "token",
        "tree",
    )

    def __init__(self, token: int, task: Task, on_done: OnDone) -> None:
        self.token = token
        self.task = task
        self.on_done = on_done
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
        self.tree: list[psutil.Process] = []  # descendants seen while sampling memory

    def start(self, now: float, memory_every: float, at_ms: int | None = None) -> None:
        task = self.task
        self.started = now
        self.started_ms = at_ms if at_ms is not None else now_ms()
        self.soft_deadline = now + task.soft_timeout_s if task.soft_timeout_s else None
        self.hard_deadline = now + task.hard_timeout_s if task.hard_timeout_s else None
        self.memory_check_at = now + memory_every if task.max_memory_mb else None

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
        "fence",
        "group",
        "jobs_done",
        "pid",
        "process",
        "queued",
        "ready",
        "retiring",
        "running",
        "soft_token",
    )

    def __init__(self, process: Any, conn: Channel, soft_token: Any, fence: Any) -> None:
        self.process = process
        self.conn = conn
        self.soft_token = soft_token  # shared: which attempt the soft signal is meant for
        self.fence = fence  # shared: the running attempt's fence deadline, for its guard
        self.pid: int = process.pid
        self.ready = False
        self.retiring = False
        self.running: Attempt | None = None
        self.queued: deque[Attempt] = deque()
        self.jobs_done = 0
        self.group: Group | None = None  # its control group, in a cgroup mode

    def assigned(self) -> int:
        return self.jobs_done + (self.running is not None) + len(self.queued)

    def sync_fence(self) -> None:
        """Tell the child's fence guard the running attempt's fence deadline (0: none)."""
        run = self.running
        self.fence.value = (run.fence_deadline or 0.0) if run is not None else 0.0

    def signal_soft(self, run: Attempt) -> None:
        run.soft_sent = True
        # The child raises SoftTimeout only if it still runs this token, so the signal
        # can never land in the next task it took from its channel.
        self.soft_token.value = run.token
        try:
            os.kill(self.pid, SIGSOFT)
        except ProcessLookupError:
            pass

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

    def attempt_started(self, run: Attempt) -> None:
        """In a cgroup mode the kernel enforces the attempt's memory limit: no sampling."""
        if self.group is not None:
            limit = run.task.max_memory_mb
            self.group.limit_memory(int(limit * 2**20) if limit else None)
            run.memory_check_at = None

    def explain_death(self, run: Attempt) -> None:
        """An OOM kill in the group of a memory-limited attempt: it ends as memory_limit,
        as the kernel's own counter says, not as a crash."""
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
        if rss > run.task.max_memory_mb * 1024 * 1024:
            return f"used {rss / 2**20:.0f} MB, over the limit of {run.task.max_memory_mb:g} MB"
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
    if signum == signal.SIGKILL and fence and time.monotonic() + FENCE_CHECK_S >= fence:
        # the child's own fence guard: the parent had not renewed the lease in time
        return Outcome.LEASE_LOST, "the lease could not be renewed in time", code, signum
    return Outcome.CRASHED, f"the child was killed by {signal_name(signum or 0)}", code, signum
