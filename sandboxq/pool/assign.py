"""Assignment: which pending task goes to which child, and when a busy child gets more.

    pending ──► an idle child, one task: it starts now (its deadlines start with it)
            └─► while attempts average under PIPELINE_BELOW_S, a few more tasks queued in
                each busy child's channel, several in one write; a queued task starts
                when its child finishes the one before, and its deadlines start then
    a child idle, nothing pending ──► takes back the task queued last behind an attempt
                that has run TAKE_BACK_AFTER_S (withdrawn before it starts), so no task
                waits behind an unexpectedly long or hung attempt while a child sits idle

Waking a sleeping child costs the parent tens of microseconds, which dominates short jobs,
so while jobs are short busy children get tasks queued ahead. For longer jobs that cost is
noise, and a child that goes straight on to a queued task is no longer idle when its
parent reads what the attempt before left (a traced attempt's peak memory was the next
one's; the memory left behind that decides a replacement holds the next one's start),
and a fleet run's first Ctrl-C did not cancel a line queued that way. So longer jobs only
go to idle children. A task whose fence deadline passed while it was pending ends as
``lease_lost`` instead of being sent.

Memory also keeps a task for an idle child: a task with a memory limit, a task behind one,
and every task while the pool watches its children's growth (``max_child_growth_mb``).
The supervisor sets a task's limit, and reads the memory it counts from, before the child
can start it. A child that goes on to a queued task is in it before this thread catches
up: under its predecessor's limit in a cgroup mode (held there, a task with a higher limit
was OOM-killed under the lower one and reported as crashed), and with its first
allocations in what the parent reads as the attempt before left behind (a child was
replaced for 100 MB the next task held).

Measured (2026-11, 7 alternating pairs on 2 cores), against idle children only (nothing
queued ahead): pool no-op throughput 2.1x (22,400 against 10,800 jobs/s, bench/pool_bench.py
throughput), a worker's no-op throughput 1.4x on Redis (10,000 against 7,000 jobs/s,
bench/queue_bench.py) and 3.1x on memory:// (17,400 against 5,700 jobs/s); 10 ms CPU jobs
unchanged (127 jobs/s: the branch is off for them). One task queued ahead is not enough:
with PIPELINE_DEPTH 1 the pool runs 1.7x slower than with 32 (13,000 jobs/s). For 10 ms
jobs one task ahead would save a child 200 us of waiting per job (``sandboxq run`` of
2,000, 4 alternating pairs: 340-430 us against 500-680 us between two jobs), but the wall
time moved less than the runs' spread (11.45-11.77 s against 11.55-11.77 s).
"""

from __future__ import annotations

import time
from collections import deque

from sandboxq.models import Outcome
from sandboxq.pool.handles import Child
from sandboxq.pool.messages import Run
from sandboxq.pool.running import Attempt

#: Queue tasks in a busy child's channel only while attempts average less than this...
PIPELINE_BELOW_S = 0.005
#: ...about this much expected work per child (so a task never waits long behind the
#: ones queued before it), and never more than PIPELINE_DEPTH tasks.
PIPELINE_WORK_S = 0.002
PIPELINE_DEPTH = 32
#: A task queued behind an attempt is taken back for an idle child once that attempt has
#: run this long (four times the longest average that queues tasks): sooner, it most likely
#: starts where it is before a take-back would pay, which stops the busy child (up to 4 ms
#: on 2 loaded cores).
TAKE_BACK_AFTER_S = 0.02
#: How long taking a task back may stop its child at most: a child that does not stop
#: that soon (a core it waits for, an uninterruptible wait) keeps the task for now...
TAKE_BACK_STOP_S = 0.005
#: ...and it is tried again this much later. Kept for good, it waited behind a hung
#: attempt, with every task queued before it, while a child sat idle (a test failed so
#: under load). A try that fails costs the supervisor TAKE_BACK_STOP_S: 5 % of its time
#: at most while a child cannot be stopped.
TAKE_BACK_RETRY_S = 0.1


class Assigner:
    """Sends pending tasks to children; keeps the moving average of attempt durations
    that decides whether busy children get tasks queued ahead."""

    def __init__(
        self,
        max_jobs_per_child: int | None,
        max_result_bytes: int,
        memory_every_s: float,
        watch_growth: bool,
    ) -> None:
        self._limit = max_jobs_per_child
        self._watch_growth = watch_growth
        self._max_result_bytes = max_result_bytes
        self._memory_every = memory_every_s
        self.recent_job_s = 1.0

    def observe(self, runtime_s: float) -> None:
        """Fold one attempt's duration into the moving average."""
        self.recent_job_s += (runtime_s - self.recent_job_s) * 0.2

    def assign(self, pending: deque[Attempt], idle: list[Child], children: list[Child]) -> None:
        """Idle children first; while jobs are short, top up the busy ones' channels;
        with children idle and nothing pending, ``take_back``. A task that runs ``alone``
        waits, and holds back the tasks behind it, until no other attempt runs or is
        queued; while it runs, nothing else starts."""
        if any(c.running is not None and c.running.task.alone for c in children):
            return
        while pending and idle:
            if pending[0].task.alone:
                if any(c.running is not None or c.queued for c in children):
                    return
                self.send(idle.pop(), 1, pending, idle)
                return
            self.send(idle.pop(), 1, pending, idle)
        if (
            pending
            and not pending[0].task.alone
            and self.recent_job_s < PIPELINE_BELOW_S
            and not self._watch_growth
        ):
            ahead = int(PIPELINE_WORK_S / max(self.recent_job_s, 1e-9))
            depth = max(1, min(PIPELINE_DEPTH, ahead))
            refill = max(1, depth // 2)
            limit = self._limit
            for child in children:
                run = child.running
                if run is None or run.kill_outcome is not None or child.recycle:
                    continue
                room = depth - len(child.queued)
                if limit is not None:
                    room = min(room, limit - child.assigned())
                # Top up in batches: one write carries several tasks.
                if room >= refill or (room > 0 and len(pending) <= room):
                    self.send(child, room, pending, idle)
                if not pending or pending[0].task.alone:
                    return
        elif idle and not pending:
            self.take_back(pending, idle, children)

    def take_back(self, pending: deque[Attempt], idle: list[Child], children: list[Child]) -> None:
        """Give idle children the tasks queued last behind attempts that have run for
        ``TAKE_BACK_AFTER_S``, one each, withdrawn before they start (``Child.withdraw``)."""
        now = time.monotonic()
        for child in children:
            if len(pending) >= len(idle):
                break
            found = _take_back_due(child)
            if found is None or now < found[1]:
                continue
            last = found[0]
            withdrawn = child.withdraw(last, TAKE_BACK_STOP_S)
            if withdrawn:
                child.queued.pop()
                last.child = None
                pending.append(last)
            elif withdrawn is None:  # its child did not stop in time (a loaded machine)
                last.take_back_after = now + TAKE_BACK_RETRY_S
            else:  # it started meanwhile: it stays
                last.pinned = True
        while pending and idle:
            self.send(idle.pop(), 1, pending, idle)

    def take_back_at(
        self, pending: deque[Attempt], idle: list[Child], children: list[Child]
    ) -> float | None:
        """When the next task can be taken back for an idle child (None: none can)."""
        if pending or not idle:
            return None
        times = [found[1] for c in children if (found := _take_back_due(c)) is not None]
        return min(times) if times else None

    def send(self, child: Child, count: int, pending: deque[Attempt], idle: list[Child]) -> None:
        """Send up to ``count`` pending tasks to ``child`` in one write: the first starts now
        if the child was idle (else it goes back to ``idle`` when none was left to send);
        the rest queue in its channel."""
        now = time.monotonic()
        batch: list[Attempt] = []
        ahead = child.running
        while len(batch) < count and pending:
            task = pending[0].task
            if task.alone and (batch or ahead is not None):
                break  # it starts on its own, later
            if ahead is not None and (
                task.max_memory_mb is not None or ahead.task.max_memory_mb is not None
            ):
                break  # it starts in an idle child, under its own limit from the start
            attempt = pending.popleft()
            if attempt.fence_deadline is not None and now >= attempt.fence_deadline:
                detail = "the lease expired before the job started"
                attempt.settle(Outcome.LEASE_LOST, None, detail=detail)
            else:
                attempt.child, attempt.pinned = child, False
                batch.append(attempt)
        if not batch:
            if child.running is None:
                idle.append(child)
            return
        max_bytes = self._max_result_bytes
        runs = [
            Run(
                a.task_id,
                a.task.payload,
                a.task.codec,
                max_bytes,
                a.task.job_id,
                a.task.attempt,
                a.task.trace,
            )
            for a in batch
        ]
        starts = child.running is None
        if starts:
            # Before the child can start: its memory limit (or the base its samples count
            # from) and its fence are in force, and what it wrote while idle is no
            # attempt's. (A task queued behind a running one starts where that one's
            # output was taken, under the same limits.)
            first = child.running = batch[0]
            child.begin(first, now, self._memory_every)
            child.sync_fence()
            if child.output is not None:
                child.output.clear()
        try:
            child.conn.send(*runs)
        except OSError:  # it just died; its sentinel will tell us how
            if starts:
                child.running = None
                child.sync_fence()
            for a in batch:
                a.child = None
            pending.extendleft(reversed(batch))
            return
        child.queued.extend(batch[1:] if starts else batch)


def _take_back_due(child: Child) -> tuple[Attempt, float] | None:
    """The task queued last behind ``child``'s running attempt and when it may be taken
    back (``time.monotonic()``), if it may be."""
    run = child.running
    if run is None or run.kill_outcome is not None or not child.queued:
        return None
    last = child.queued[-1]
    if last.pinned or last.kill_outcome is not None:
        return None
    return last, max(run.started + TAKE_BACK_AFTER_S, last.take_back_after)
