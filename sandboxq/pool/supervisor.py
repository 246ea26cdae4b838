"""The supervisor: one thread that owns every child and runs each attempt to its end.

    submit / kill / close (any thread)
        │ commands deque + one byte on the wake pipe (commands.py: what each one does)
        ▼
    select(child pipes, child sentinels, fork server pidfd, wake pipe; timeout = next deadline)
        │                    │                     │                    │
        │ Ready/Progress/    │ a child died:       │ the fork server    │ a deadline passed:
        │ Finished/Failed    │ exit code → outcome │ died: its attempts │ read the pipe, then
        │ (undecodable: that │ (never started:     │ interrupted, fresh │ soft signal, tree
        │ child's error)     │ back to pending)    │ server + children  │ kill, memory sample
        ▼                    ▼                     ▼                    ▼
    on_done(AttemptResult) ── then: dispatch pending tasks

Nothing polls: the select timeout is the nearest soft/hard deadline or memory sample, so a
kill lands within a millisecond or two of its deadline. A child runs one attempt at a time.
Pending tasks go to idle children first; while jobs are short (``PIPELINE_BELOW_S``) a few
more are queued in busy children's channels, and a queued task starts when its child
finishes the one before (its deadline clock starts then, not at dispatch). The child
records each task's task_id as it starts it (``Child.started``), so a task withdrawn while
queued never starts, and one a child died before starting goes back to pending, uncharged.
A kill names an attempt task_id, and the supervisor is the only thread that dispatches, so a
kill can never hit the next job a reused child picked up.

Every process an attempt starts dies with the attempt (``kill.sweep``, the child's own
sweep, and the orphan sweep below the fork server: ``server.py``).

Under a control group (containment.py) each child gets its group at spawn, a kill freezes
and kills the whole group, the kernel enforces the memory limit (no sampling), and the
group is removed once the child is gone.
"""

from __future__ import annotations

import itertools
import logging
import os
import selectors
import threading
import time
from collections import deque
from typing import Any

from sandboxq.errors import PoolBroken
from sandboxq.models import Outcome
from sandboxq.pool import commands, launch, server
from sandboxq.pool.attempt import Task
from sandboxq.pool.channel import BadMessage, Channel
from sandboxq.pool.child import SHARED_SIZE, child_main
from sandboxq.pool.containment import Containment
from sandboxq.pool.handles import (
    Attempt,
    Child,
    OnDone,
    call,
    death_outcome,
    kill_overshoot_s,
    now_ms,
    readable,
)
from sandboxq.pool.kill import descendants, kill_tree
from sandboxq.pool.limits import ChildSetup
from sandboxq.pool.messages import Failed, Finished, Progress, Ready, Run

log = logging.getLogger("sandboxq.pool")


#: Longest single select(): epoll cannot wait 25 days (2**31 ms), and a 30-day hard timeout
#: is a legitimate setting, so a far deadline is reached through several waits.
MAX_SELECT_S = 3600.0
#: Children that die before they are ready, in a row, before the pool gives up.
MAX_START_FAILURES = 3
#: How long idle children get to exit on their own at shutdown before they are killed.
EXIT_GRACE_S = 1.0
#: Queue tasks in a busy child's channel only while attempts average less than this...
PIPELINE_BELOW_S = 0.005
#: ...about this much expected work per child (so a task never waits long behind the
#: ones queued before it), and never more than PIPELINE_DEPTH tasks.
PIPELINE_WORK_S = 0.002
PIPELINE_DEPTH = 32
#: How long a child's exit code 255 waits for the fork server's pidfd to explain it.
SERVER_DEATH_WAIT_S = 0.2
#: Tries to start one child before the pool is broken.
LAUNCH_TRIES = 4
#: A child's frame may exceed the result cap by this much (the message around the result,
#: an error's traceback); anything larger is a bad message, refused before it is read.
FRAME_SLACK = 4 * 1024 * 1024


class Supervisor:
    def __init__(
        self,
        ctx: Any,
        processor: str,
        size: int,
        *,
        max_jobs_per_child: int | None,
        max_result_bytes: int,
        memory_check_interval_s: float,
        keep_strays: bool = False,
        max_child_growth_mb: float | None = None,
        containment: Containment | None = None,
    ) -> None:
        self._ctx = ctx
        self._processor = processor
        self._size = size
        self._max_jobs_per_child = max_jobs_per_child
        self._max_result_bytes = max_result_bytes
        self._memory_every = memory_check_interval_s
        self._keep_strays = keep_strays
        self._max_growth_mb = max_child_growth_mb
        self._contain = containment or Containment("process_tree", "", ChildSetup())
        self._task_ids = itertools.count(1)
        self._commands: deque[tuple[Any, ...]] = deque()
        self._pending: deque[Attempt] = deque()
        self._children: list[Child] = []
        self._idle: list[Child] = []
        self._recent_job_s = 1.0  # moving average of attempt durations
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._woken = False
        self._closing = False
        self._closed = False
        self._start_failures = 0
        #: Children started, replacements included (the worker's pool restarts metric).
        self.spawned = 0
        self._replace = 0  # children that died and are to be replaced
        self._server = server.Watch() if ctx.get_start_method() == "forkserver" else None
        self.broken: PoolBroken | None = None
        self._spawned = threading.Event()
        self._thread = threading.Thread(target=self._main, name="sandboxq-supervisor", daemon=True)

    # -- any thread -------------------------------------------------------------------

    def start(self) -> None:
        """Start the thread; returns once the first children have been started."""
        self._thread.start()
        self._spawned.wait()

    def submit(self, task: Task, on_done: OnDone) -> int:
        if self.broken is not None:
            raise self.broken
        if self._closing:
            raise RuntimeError("cannot submit to a pool that is shutting down")
        task_id = next(self._task_ids)
        self.command("run", Attempt(task_id, task, on_done))
        return task_id

    def running_pids(self) -> dict[int, int]:
        """Attempt task_id → child pid for what runs now (a snapshot, for status displays)."""
        return {c.running.task_id: c.pid for c in list(self._children) if c.running is not None}

    def child_states(self) -> dict[str, list[int]]:
        """Child pids by state: starting (not ready yet), busy, idle (a snapshot, for metrics)."""
        states: dict[str, list[int]] = {"starting": [], "busy": [], "idle": []}
        for c in list(self._children):
            state = "starting" if not c.ready else "busy" if c.running is not None else "idle"
            states[state].append(c.pid)
        return states

    def close(self, *, cancel: bool) -> None:
        """Stop accepting work; ``cancel`` ends queued and running attempts as interrupted."""
        self._closing = True
        self.command("close", cancel)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def close_wake_pipe(self) -> None:
        """Close the wake pipe, once the thread has stopped (after ``join``)."""
        if self._closed and self._wake_r >= 0:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1

    @property
    def pids(self) -> list[int]:
        return [c.pid for c in list(self._children)]

    def command(self, *command: Any) -> None:
        """Queue a command for the supervisor thread (``Pool`` documents each kind):
        ``("kill", task_id, outcome, detail)``, ``("fence", task_id, deadline)``,
        ``("soft", task_id)``, ``("end_unstarted", outcome, detail)``, ``("close", cancel)``."""
        self._commands.append(command)
        # One wake byte per batch of commands: the supervisor clears the flag before
        # draining the deque, so a command appended while it is set is always seen.
        if not self._woken and not self._closed:
            self._woken = True
            try:
                os.write(self._wake_w, b"\0")
            except OSError:  # the supervisor has exited and closed the pipe
                pass

    # -- the supervisor thread ----------------------------------------------------------

    def _main(self) -> None:
        self._selector.register(self._wake_r, selectors.EVENT_READ, self._on_wake)
        try:
            try:
                for _ in range(self._size):
                    self._spawn()
            finally:
                self._spawned.set()
            while not (
                self._closing and not self._commands and not self._pending and not self._busy()
            ):
                # Replacements start here, after a whole select batch: a slow start (a
                # fresh fork server importing numpy) never delays another child's outcome.
                while self._replace > 0 and not self._closing:
                    self._replace -= 1
                    self._spawn()
                self._assign()
                timeout = self._next_event(time.monotonic())
                for key, _ in self._selector.select(timeout):
                    key.data(key.fileobj)
                self._enforce_deadlines(time.monotonic())
        except BaseException as exc:
            log.exception("pool supervisor crashed")
            self.broken = PoolBroken(f"the pool supervisor crashed: {exc!r}")
        finally:
            self._closing = True
            self._shutdown()

    def _busy(self) -> bool:
        return any(c.running is not None or c.queued for c in self._children)

    def _next_event(self, now: float) -> float | None:
        times = [t for c in self._children if c.running and (t := c.running.next_event())]
        return min(MAX_SELECT_S, max(0.0, min(times) - now)) if times else None

    def _on_wake(self, _fd: Any) -> None:
        try:
            os.read(self._wake_r, 4096)
        except (BlockingIOError, OSError):
            pass
        self._woken = False
        while self._commands:
            kind, *rest = self._commands.popleft()
            if kind == "run":
                self._pending.append(rest[0])
            elif kind == "kill":
                commands.kill(self._children, self._pending, self._collect, *rest)
            elif kind == "fence":
                commands.extend_fence(self._children, self._pending, *rest)
            elif kind == "soft":
                commands.soft_stop(self._children, rest[0])
            elif kind == "end_unstarted":
                while self._pending:
                    self._pending.popleft().settle(rest[0], None, detail=rest[1])
            elif kind == "close" and rest[0]:
                commands.cancel_all(self._children, self._pending)

    def _spawn(self) -> None:
        channel, child_end = Channel.pair(max_frame=self._max_result_bytes + FRAME_SLACK)
        soft = self._ctx.RawValue("q", 0)
        fence = self._ctx.RawValue("d", 0.0)
        shared = self._ctx.RawArray("q", SHARED_SIZE)
        group, setup = self._contain.new_child()
        process = self._ctx.Process(
            target=child_main,
            args=(
                child_end,
                self._processor,
                soft,
                fence,
                self._keep_strays,
                shared,
                setup,
            ),
            name="sandboxq-child",
        )
        try:
            with server.spawning():
                launch.start_retrying(process, LAUNCH_TRIES)
                server.register(process.pid)
        except OSError as exc:
            child_end.close()
            channel.close()
            self._break(f"no child could be started: {exc!r}")
            return
        self.spawned += 1
        child_end.close()
        self._follow_server()
        child = Child(process, channel, soft, fence, shared)
        child.group = group
        self._children.append(child)
        self._selector.register(channel, selectors.EVENT_READ, lambda _: self._on_messages(child))
        self._selector.register(
            process.sentinel, selectors.EVENT_READ, lambda _: self._on_exit(child)
        )

    # -- the fork server ------------------------------------------------------------------

    def _follow_server(self) -> None:
        watch = self._server
        if watch is None:
            return
        if watch.fd is not None and server.pid() != watch.pid:
            self._on_server_death()  # replaced before its death was seen: it died
        if (fd := watch.follow()) is not None:
            self._selector.register(fd, selectors.EVENT_READ, self._on_server_event)

    def _on_server_event(self, _fd: Any) -> None:
        # A select batch can still hold the event of a pidfd already handled (through a
        # child's exit) and closed, its number now reused: only a dead server counts.
        if self._server is not None and self._server.is_dead():
            self._on_server_death()

    def _on_server_death(self) -> None:
        """The fork server died, and every child with it (their parent-death signal): end
        their attempts as interrupted, not charged, with the cause; the replacements that
        ``_on_exit`` starts bring up a fresh fork server."""
        watch = self._server
        if watch is None or watch.fd is None:
            return
        self._selector.unregister(watch.fd)
        dead, how = watch.pid, watch.how()
        deaths = watch.died(time.monotonic())
        why = f"the pool's fork server (pid {dead}) {how}; the attempt was not charged"
        log.error("the pool's fork server (pid %s) %s; starting a fresh one", dead, how)
        for child in list(self._children):
            child.lose_server(why)  # killed and gone, so its exit is handled now
            self._on_exit(child)
        if deaths >= server.MAX_DEATHS:
            self._break(
                f"the pool's fork server died {deaths} times within "
                f"{server.DEATH_WINDOW_S:g} s (last pid {dead})"
            )

    # -- dispatch: idle children first; while jobs are short, queue a few more in each ----

    def _assign(self) -> None:
        while self._pending and self._idle:
            self._send(self._idle.pop(), 1)
        if self._pending and self._recent_job_s < PIPELINE_BELOW_S:
            ahead = int(PIPELINE_WORK_S / max(self._recent_job_s, 1e-9))
            depth = max(1, min(PIPELINE_DEPTH, ahead))
            refill = max(1, depth // 2)
            limit = self._max_jobs_per_child
            for child in self._children:
                run = child.running
                if run is None or run.kill_outcome is not None or child.recycle:
                    continue
                room = depth - len(child.queued)
                if limit is not None:
                    room = min(room, limit - child.assigned())
                # Top up in batches: one write carries several tasks.
                if room >= refill or (room > 0 and len(self._pending) <= room):
                    self._send(child, room)
                if not self._pending:
                    return

    def _send(self, child: Child, count: int) -> None:
        """Send up to ``count`` pending tasks to ``child`` in one write.

        The first starts now if the child was idle; the rest queue in its channel. Waking a
        sleeping child costs the parent tens of microseconds, which dominates short jobs, so
        while jobs are short (``PIPELINE_BELOW_S``) busy children get tasks queued ahead.
        For longer jobs that cost is noise, and a task queued behind a long job would wait
        while another child sits idle, so longer jobs are only sent to idle children.
        """
        now = time.monotonic()
        batch: list[Attempt] = []
        while len(batch) < count and self._pending:
            attempt = self._pending.popleft()
            if attempt.fence_deadline is not None and now >= attempt.fence_deadline:
                detail = "the lease expired before the job started"
                attempt.settle(Outcome.LEASE_LOST, None, detail=detail)
            else:
                batch.append(attempt)
        if not batch:
            if child.running is None:
                self._idle.append(child)
            return
        runs = [
            Run(
                a.task_id,
                a.task.payload,
                a.task.codec,
                self._max_result_bytes,
                a.task.job_id,
                a.task.attempt,
            )
            for a in batch
        ]
        try:
            child.conn.send(*runs)
        except OSError:  # it just died; its sentinel will tell us how
            self._pending.extendleft(reversed(batch))
            return
        if child.running is None:
            first = child.running = batch.pop(0)
            child.begin(first, now, self._memory_every)
            child.sync_fence()
        child.queued.extend(batch)

    # -- messages from children ------------------------------------------------------------

    def _on_messages(self, child: Child) -> None:
        if child.conn.closed:
            # A stale readiness from this select batch: an earlier event of the batch (a
            # kill's drain, the child's exit) already read this channel to its end.
            return
        try:
            messages = child.conn.receive_available()
        except (EOFError, OSError):  # died mid-message or closed; the sentinel follows
            self._selector.unregister(child.conn)
            child.conn.close()
            return
        except BadMessage as exc:
            self._bad_message(child, exc)
            return
        for msg in messages:
            self._on_message(child, msg)

    def _bad_message(self, child: Child, exc: BadMessage) -> None:
        """The child sent what cannot be decoded: its fault alone. The stream cannot be
        trusted past that frame, so the child is killed (and replaced, as any dead child)
        and its running attempt ends as an error that says why."""
        log.warning("child %d sent a message that could not be decoded: %s", child.pid, exc)
        self._selector.unregister(child.conn)
        child.conn.close()
        run = child.running
        detail = f"a message from the child could not be decoded ({exc})"
        if run is not None and run.kill_outcome is None:
            child.kill(Outcome.ERROR, detail)
        else:
            kill_tree(child.pid)

    def _on_message(self, child: Child, msg: Any) -> None:
        run = child.running
        kind = type(msg)  # most frequent first: this runs once or twice per job
        if kind is Finished or kind is Failed:
            if run is None or run.task_id != msg.task_id or run.kill_outcome is not None:
                return  # stale, or being killed: the kill decides the outcome
            child.running = None
            now, at_ms = time.monotonic(), now_ms()  # once: the end of this, the start of next
            if kind is Finished:
                outcome = run.soft_outcome if run.soft_sent else Outcome.OK
                run.settle(outcome, child.pid, now, at_ms, result=msg.result)
            else:
                outcome = run.soft_outcome if run.soft_sent else Outcome.ERROR
                run.settle(outcome, child.pid, now, at_ms, error=msg.error)
            child.jobs_done += 1
            if run.task.max_memory_mb is not None or self._max_growth_mb is not None:
                child.check_after(run, self._max_growth_mb)
            self._recent_job_s += (now - run.started - self._recent_job_s) * 0.2
            self._advance(child, now, at_ms)
            child.sync_fence()
        elif kind is Progress:
            if run and run.task_id == msg.task_id and run.task.on_progress:
                call(run.task.on_progress, msg.fraction, msg.message)
        elif kind is Ready:
            child.ready = True
            self._start_failures = 0
            if self._max_growth_mb is not None:
                child.rss_ready = child.rss()
            self._idle.append(child)

    def _advance(self, child: Child, now: float, at_ms: int) -> None:
        """The running attempt ended and the child lives: start its next, retire it, or idle it."""
        if child.queued:
            # The child went straight on to the next task in its channel.
            nxt = child.running = child.queued.popleft()
            child.begin(nxt, now, self._memory_every, at_ms)
            if nxt.kill_outcome is not None:  # killed while it was queued
                child.kill_all()
            return
        limit = self._max_jobs_per_child
        if (child.recycle or (limit and child.jobs_done >= limit)) and not self._closing:
            self._retire(child)
        else:
            self._idle.append(child)

    def _collect(self, child: Child) -> None:
        """Read what a child already sent: a finished attempt is never mistaken for a hung one."""
        while not child.conn.closed and readable(child.conn):
            self._on_messages(child)

    def _retire(self, child: Child) -> None:
        """Close the channel (the child exits on EOF) and start its replacement right away."""
        child.retiring = True
        self._selector.unregister(child.conn)
        child.conn.close()
        self._spawn()

    # -- a child died ----------------------------------------------------------------------

    def _on_exit(self, child: Child) -> None:
        if child not in self._children:
            return  # a stale event of this select batch: its exit was handled already
        # 255 is also what multiprocess reports when the fork server closed the child's
        # sentinel by dying (its files close before its pidfd says so): look again, briefly.
        lost = child.process.exitcode == 255 and not child.server_died
        if self._server is not None and self._server.is_dead(SERVER_DEATH_WAIT_S * lost):
            self._on_server_death()  # it explains this death (and handles this exit)
            return
        if not child.conn.closed:
            self._collect(child)
        self._selector.unregister(child.process.sentinel)
        if not child.conn.closed:
            self._selector.unregister(child.conn)
            child.conn.close()
        child.process.join(EXIT_GRACE_S)
        exitcode = child.process.exitcode
        self._children.remove(child)
        if child in self._idle:
            self._idle.remove(child)
        run = child.running
        # What it left behind: re-parented to the fork server when it died on its own (in
        # a control group, the group holds it wherever it went).
        child.kill_all(run.tree if run else ())
        server.sweep_orphans()
        server.forget(child.pid)
        if run is not None:
            self._settle_death(child, run, exitcode)
        self._contain.remove(child.group)  # after: its OOM-kill counter names the outcome
        # Queued attempts never started: back to the front of the line, in order.
        for attempt in reversed(child.queued):
            if attempt.kill_outcome is not None:
                attempt.settle(attempt.kill_outcome, None, detail=attempt.kill_detail)
            else:
                self._pending.appendleft(attempt)
        child.queued.clear()
        child.process.close()
        if not child.ready and not child.retiring and not child.server_died:
            self._start_failures += 1
            if self._start_failures >= MAX_START_FAILURES:
                self._break(
                    f"children exit before they are ready (last exit code {exitcode}); "
                    "see the child's stderr"
                )
        if not self._closing and not child.retiring and self.broken is None:
            self._replace += 1

    def _settle_death(self, child: Child, run: Attempt, exitcode: int | None) -> None:
        child.running = None
        if not child.started(run) and run.kill_outcome is None:
            # It died before it started this one (between tasks): not this task's fault.
            self._pending.appendleft(run)
            return
        child.explain_death(run)
        if child.server_died:
            exitcode = None
        outcome, detail, code, signum = death_outcome(run, exitcode)
        overshoot = kill_overshoot_s(run, outcome, time.monotonic())  # metrics
        run.settle(
            outcome,
            child.pid,
            exitcode=code,
            signal=signum,
            detail=detail,
            kill_overshoot_s=overshoot,
        )

    def _break(self, why: str) -> None:
        """Give up: no more children. Attempts that never started end as interrupted."""
        log.error("the pool is broken: %s", why)
        self.broken = PoolBroken(why)
        self._closing = True
        while self._pending:
            self._pending.popleft().settle(Outcome.INTERRUPTED, None, detail=why)

    # -- deadlines and kills ---------------------------------------------------------------

    def _enforce_deadlines(self, now: float) -> None:
        for child in list(self._children):
            run = child.running
            if run is None or run.kill_outcome is not None or not run.due(now):
                continue
            # Read what it already sent first: an attempt that returned before its deadline
            # is reported as it ended, whatever the deadline would have made of it.
            self._collect(child)
            if child.running is not run:
                continue
            if run.hard_deadline is not None and now >= run.hard_deadline:
                hard = run.task.hard_timeout_s
                child.kill(Outcome.HARD_TIMEOUT, f"killed at the hard deadline of {hard:g} s")
            elif run.fence_deadline is not None and now >= run.fence_deadline:
                child.kill(Outcome.LEASE_LOST, "the lease could not be renewed in time")
            else:
                if run.soft_deadline is not None and not run.soft_sent and now >= run.soft_deadline:
                    child.signal_soft(run)
                due = run.memory_check_at is not None and now >= run.memory_check_at
                if due and (why := child.over_memory(run, now, self._memory_every)) is not None:
                    child.kill(Outcome.MEMORY_LIMIT, why)

    def _shutdown(self) -> None:
        """Close every channel, give idle children a moment to exit, then kill what is left."""
        self._on_wake(None)  # commands that raced with close: run ones end as interrupted
        commands.cancel_all(self._children, self._pending)
        # Seen while each child lives: once it exits, a grandchild that left its process
        # group (setsid) is re-parented and no longer found under it.
        trees = {child.pid: descendants(child.pid) for child in self._children}
        for child in self._children:
            if not child.conn.closed:
                child.conn.close()
        deadline = time.monotonic() + EXIT_GRACE_S
        for child in self._children:
            child.process.join(max(0.0, deadline - time.monotonic()))
        for child in self._children:
            run = child.running
            child.kill_all((*(run.tree if run else ()), *trees.get(child.pid, ())))
            child.process.join(EXIT_GRACE_S)
            if run is not None:  # only after a supervisor crash or a cancelling close
                self._settle_death(child, run, child.process.exitcode)
            for attempt in child.queued:
                attempt.settle(Outcome.INTERRUPTED, None, detail="the pool stopped")
            child.process.close()
            server.forget(child.pid)
        server.sweep_orphans()  # kept strays and daemons of children that died on their own
        self._children.clear()
        if self._server is not None:
            self._server.close()
        self._contain.close()
        self._selector.close()
        self._closed = True
