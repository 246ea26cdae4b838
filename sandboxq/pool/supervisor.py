"""The supervisor: one thread that owns every child and runs each attempt to its end.

    submit / kill / fence / soft / end_unstarted / close (any thread)
        │ a named command (commands.py) in the mailbox: a deque + a wake-pipe byte
        ▼
    select(child pipes, child sentinels, fork server pidfd, wake pipe; timeout = next deadline)
        │                    │                     │                    │
        │ Ready/Progress/    │ a child died:       │ the fork server    │ a deadline passed:
        │ Finished/Failed    │ exit code → outcome │ died: its attempts │ read the pipe, then
        │ (undecodable: that │ (never started:     │ interrupted, fresh │ soft signal, tree
        │ child's error)     │ back to pending)    │ server + children  │ kill, memory sample
        ▼                    ▼ (deaths.py)         ▼                    ▼ (deadlines.py)
    on_done(AttemptResult) ── then: replacement children (spawn.py), and pending tasks
                              assigned to children (assign.py)

Nothing polls: the select timeout is the nearest soft/hard/fence deadline or memory
sample, so a kill lands within a millisecond or two of its deadline. A child runs one
attempt at a time, but while jobs are short a few more tasks are queued in its channel
(assign.py): "sent" is not "started". A queued task starts when its child finishes the one
before, and its deadlines start then. The child records each task's id as it starts it
(``Child.started``), so a task withdrawn while queued (cancelled, or taken back for an
idle child) never starts there, and one a child died before starting goes back to
pending, uncharged.

Every attempt not yet settled is in one index by task id (``_live``: added when the
supervisor takes the submit, removed by ``Attempt.settle``); a command finds its attempt
there, and the attempt knows the child it was sent to. A kill names a task id and only
this thread sends tasks to children, so a kill can never hit the next job a reused child
picked up.

Every process an attempt starts dies with the attempt (``kill.sweep``, the child's own
sweep, and the orphan sweep below the fork server: ``server.py``). Under a control group
(containment.py) each child gets its group at spawn (spawn.py), a kill takes the whole
group (``cgroups.Group.kill``), the kernel enforces the memory limit (no sampling), and
the group is removed once the child is gone (deaths.py).
"""

from __future__ import annotations

import itertools
import selectors
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from sandboxq.errors import PoolBroken, ProcessorError
from sandboxq.models import Outcome
from sandboxq.pool import commands, deadlines, deaths, server
from sandboxq.pool.assign import Assigner
from sandboxq.pool.attempt import Task
from sandboxq.pool.budget import MemoryBudget
from sandboxq.pool.channel import BadMessage
from sandboxq.pool.commands import Close, Command, Mailbox, Submit
from sandboxq.pool.containment import Containment
from sandboxq.pool.guard import Guard
from sandboxq.pool.handles import Child
from sandboxq.pool.limits import ChildSetup
from sandboxq.pool.messages import Failed, Finished, Progress, Ready
from sandboxq.pool.output import Relay
from sandboxq.pool.pid_namespace import inner_pid
from sandboxq.pool.running import Attempt, OnDone, call
from sandboxq.pool.spawn import Spawner
from sandboxq.pool.waits import readable
from sandboxq.text import guarded_logger

log = guarded_logger("sandboxq.pool")

#: Children that die before they are ready, in a row, before the pool gives up.
MAX_START_FAILURES = 3
#: How long a child's exit code 255 waits for the fork server's pidfd to explain it.
SERVER_DEATH_WAIT_S = 0.2
#: How long after a child's channel ended its exit may take to be reported before the
#: fork server, which reaps it and reports it, is looked at (``_look_at_late_exits``).
EXIT_LATE_S = 0.1
#: How often a start that waits for its first children looks at its deadline and at a stop.
START_LOOK_S = 0.05
#: How long a start given up waits for the supervisor thread to end once the fork server
#: it waited for is killed (it ends within milliseconds then).
GIVE_UP_WAIT_S = 5.0


class Supervisor:
    """The pool's children and attempts, owned by one thread (``_main``); the methods
    above the thread's marker are safe from any thread."""

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
        capture_output: bool = True,
        pool_memory_mb: float | None = None,
    ) -> None:
        self._processor = processor
        self._size = size
        self._max_jobs_per_child = max_jobs_per_child
        self._memory_every = memory_check_interval_s
        self._max_growth_mb = max_child_growth_mb
        self._contain = containment or Containment("process_tree", "", ChildSetup())
        self._task_ids = itertools.count(1)
        self._mail = Mailbox()
        self._live: dict[int, Attempt] = {}  # every attempt not yet settled, by task id
        self._reserved = commands.Reserved()  # ids given out, not submitted yet
        self._pending: deque[Attempt] = deque()
        #: Whether a task with a deadline_s or max_queue_s was ever submitted: until one is,
        #: the loop does not look through what waits for either. A walk of every pending
        #: task on every turn, with 10,000 submitted at once, held the pool's no-op
        #: throughput to 12,500 jobs/s against 19,000 without it (5 alternated rounds).
        self._timed = False
        self._children: list[Child] = []
        self._idle: list[Child] = []
        self._assigner = Assigner(
            max_jobs_per_child,
            max_result_bytes,
            memory_check_interval_s,
            watch_growth=max_child_growth_mb is not None,
        )
        self._selector = selectors.DefaultSelector()
        # Children's stdout and stderr, shown live and kept per attempt (output.py).
        self._relay = Relay() if capture_output else None
        self._spawner = Spawner(
            ctx,
            processor,
            max_result_bytes=max_result_bytes,
            keep_strays=keep_strays,
            containment=self._contain,
            relay=self._relay,
            selector=self._selector,
            on_server_death=self._on_server_death,
            wake=self._mail.wake,
        )
        # Room for the pool's children, the retiring ones still exiting, and their
        # replacements.
        self._guard = Guard(capacity=4 * size + 8, pool_dirs=self._contain.pool_dirs)
        self._closing = False
        # A dropped pool's supervisor closes its own wake pipe once its thread ends
        # (``abandon``); the lock orders that with the thread's end. Re-entrant: the
        # finalizer that calls abandon runs wherever the collector finds the pool, this
        # thread's locked end included (closing the pipe twice is harmless).
        self._end_lock = threading.RLock()
        self._abandoned = self._ended = False
        #: Children whose channel ended, by when their exit should have been seen.
        self._exits_due: dict[Child, float] = {}
        #: In a process forked from the pool's own (pool.py's fork hook), that process's
        #: pid: the copy refuses work and leaves the children alone.
        self.forked_from: int | None = None
        self._start_failures = 0
        #: Children started, replacements included (the worker's pool restarts metric).
        self.spawned = 0
        self._replace = 0  # children that died and are to be replaced
        self.broken: PoolBroken | None = None
        self._spawned = threading.Event()
        self._thread = threading.Thread(target=self._main, name="sandboxq-supervisor", daemon=True)
        #: pool_memory_mb: the children's memory together (budget.py)
        self.budget = (
            MemoryBudget(pool_memory_mb, self._contain, memory_check_interval_s)
            if pool_memory_mb is not None
            else None
        )

    # -- any thread -------------------------------------------------------------------

    def start(self, give_up_after_s: float, stop_asked: Callable[[], bool] | None = None) -> None:
        """Start the thread; returns once the first children have been started. A start
        that takes longer than ``give_up_after_s`` (the fork server's import of the
        processor hangs: the caller's own import of it had finished) raises
        ``ProcessorError``; one stopped meanwhile (``stop_asked``: a worker's SIGTERM)
        raises ``PoolBroken``. Either way the fork server is killed, the thread ends, and
        nothing of the pool is left."""
        self._thread.start()
        deadline = time.monotonic() + give_up_after_s
        # Looked at a few times a second: a fork server preloading numpy takes seconds.
        while not self._spawned.wait(START_LOOK_S):
            if stop_asked is not None and stop_asked():
                error: Exception = PoolBroken("stopped before its first children started")
            elif time.monotonic() >= deadline:
                error = ProcessorError(
                    f"the pool's fork server did not finish importing {self._processor!r} "
                    f"within {give_up_after_s:g} s (import_timeout_s), although this process "
                    "had imported it: does the module wait at import on something another "
                    "process does not have (a lock, the network, sys.argv)?",
                    processor=self._processor,
                )
            else:
                continue
            self._spawner.give_up(str(error))  # the fork server killed: the thread goes on
            # Bounded: a start stuck before the fork server (none to kill) is left to
            # end on its own, a daemon thread; the caller gets its answer now.
            if self._spawned.wait(GIVE_UP_WAIT_S):
                self.close(cancel=True)
                self._thread.join(GIVE_UP_WAIT_S)
                if not self._thread.is_alive():
                    self.close_wake_pipe()
            raise error

    def new_task_id(self) -> int:
        """A task id for a later ``submit``; commands naming it before then wait for it."""
        task_id = next(self._task_ids)
        self._reserved.ids.add(task_id)
        return task_id

    def submit(self, task: Task, on_done: OnDone, task_id: int | None = None) -> int:
        """Queue ``task``; returns its task id (what ``Kill``, ``Fence`` and ``Soft`` name):
        ``task_id`` if given (``new_task_id``), else a new one."""
        if self.broken is not None:
            raise self.broken
        if self.forked_from is not None:
            raise RuntimeError(
                f"this pool belongs to process {self.forked_from}: a process forked from it "
                "has neither its supervisor thread nor its children; make a Pool here"
            )
        if self._closing:
            raise RuntimeError("cannot submit to a pool that is shutting down")
        if task_id is None:
            task_id = next(self._task_ids)
        if not self._timed and (task.deadline_at is not None or task.start_by is not None):
            self._timed = True  # before the Submit: the loop reads it once the task is in
        # A deadline_s or max_queue_s is watched from pending, so such a task always wakes.
        lazy = task.deadline_at is None and task.start_by is None
        self._mail.put(Submit(Attempt(task_id, task, on_done, self._live)), lazy=lazy)
        return task_id

    def running_pids(self) -> dict[int, int]:
        """Task id → child pid for what runs now (a snapshot, for status displays)."""
        return {c.running.task_id: c.pid for c in list(self._children) if c.running is not None}

    def running_starts(self) -> dict[int, tuple[int, int | None]]:
        """Task id → (child pid, when it started, ms) for what runs now (a snapshot)."""
        return {
            run.task_id: (c.pid, run.started_ms)
            for c in list(self._children)
            if (run := c.running) is not None
        }

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
        self.command(Close(cancel))

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def close_wake_pipe(self) -> None:
        """Close the wake pipe, once the thread has stopped (after ``join``)."""
        self._mail.close()

    def abandon(self) -> None:
        """The pool was dropped unclosed (its finalizer, on whichever thread let it go):
        what was submitted runs to its end, then everything stops, and the wake pipe is
        closed behind it, as nobody is left to send a command. In a forked copy, nothing."""
        if self.forked_from is not None:
            return
        with self._end_lock:
            self._abandoned = True
            if self._ended:
                self._mail.close()
                return
        self.close(cancel=False)

    @property
    def helper_restarts(self) -> int:
        """Fork servers and guards started to replace dead ones."""
        return self._spawner.server_restarts + self._guard.restarts

    @property
    def pids(self) -> list[int]:
        return [c.pid for c in list(self._children)]

    def command(self, command: Command) -> None:
        """Queue a command for the supervisor thread (commands.py says what each does)."""
        self._mail.put(command)

    # -- the supervisor thread ----------------------------------------------------------

    def _main(self) -> None:
        # What this thread starts inherits its signal mask: the fork server, importing
        # the processor (seconds, for numpy and friends), printed a KeyboardInterrupt
        # traceback at a Ctrl-C meant for the run; it ignores SIGINT once it serves, and
        # the guard never wants it. A hangup (the terminal closed: sent to the worker's
        # whole process group) killed the fork server and the resource tracker, and the
        # running jobs with them, while the worker drained on it. The children unblock
        # both (child.py). Signals still reach this process: its other threads take them.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGHUP})
        self._selector.register(self._mail.fd, selectors.EVENT_READ, self._on_wake)
        self._start_guard()
        try:
            try:
                for _ in range(self._size):
                    if self._closing:  # broken: no child could be started
                        break
                    self._spawn()
            finally:
                self._spawned.set()
            collect, memory_every = self._collect, self._memory_every
            while not (
                self._closing and not self._mail.queue and not self._pending and not self._busy()
            ):
                # Replacements start here, after a whole select batch: a slow start (a
                # fresh fork server importing numpy) never delays another child's outcome.
                while self._replace > 0 and not self._closing:
                    self._replace -= 1
                    self._spawn()
                if self._mail.queue:  # submits put without a wake byte (Mailbox.put)
                    self._run_commands()
                timed = self._timed and bool(self._pending)
                if timed:  # deadline_s, max_queue_s
                    deadlines.end_overdue(self._pending, time.monotonic())
                if self._pending or self._idle:
                    self._assigner.assign(self._pending, self._idle, self._children)
                # Written before the deque is read (Mailbox.put says why).
                self._mail.surplus = surplus = bool(self._pending)
                timeout = self._select_timeout(timed)
                if self._mail.queue and not surplus:
                    timeout = 0.0  # a lazy submit came in meanwhile: take it now
                for key, _ in self._selector.select(timeout):
                    key.data(key.fileobj)
                deadlines.enforce(self._children, time.monotonic(), collect, memory_every)
                if self.budget is not None:
                    self.budget.check(self._children, time.monotonic())
        except BaseException as exc:
            log.exception("pool supervisor crashed")
            self.broken = PoolBroken(f"the pool supervisor crashed: {exc!r}")
        finally:
            self._closing = True
            self._shutdown()

    def _select_timeout(self, timed: bool) -> float | None:
        """How long the select may wait: until the nearest deadline of a child, of a task
        still waiting for one (``timed``), of a take-back, a memory sample or a late exit
        (None: until something happens)."""
        now = time.monotonic()
        timeout = deadlines.wait_s(self._children, now)
        if timed and (late := deadlines.pending_due(self._pending)) is not None:
            # one still waiting for a child runs out (a far one: several waits)
            wait = min(deadlines.MAX_SELECT_S, max(0.0, late - now))
            timeout = wait if timeout is None else min(timeout, wait)
        due = self._assigner.take_back_at(self._pending, self._idle, self._children)
        if due is not None:  # a child idle, a task queued behind a running attempt
            wait = max(0.0, due - now)
            timeout = wait if timeout is None else min(timeout, wait)
        if self.budget is not None:  # pool_memory_mb
            timeout = self.budget.wait_s(self._children, timeout)
        if self._exits_due:  # children whose channel ended, their exits not seen yet
            timeout = self._look_at_late_exits(now, timeout)
        return timeout

    def _busy(self) -> bool:
        return any(c.running is not None or c.queued for c in self._children)

    def _on_wake(self, _fd: Any) -> None:
        self._mail.take()
        self._run_commands()

    def _run_commands(self) -> None:
        queue, live, pending, collect = self._mail.queue, self._live, self._pending, self._collect
        while queue:
            commands.run(queue.popleft(), live, pending, self._children, collect, self._reserved)
        # Commands come with every lease renewal while jobs run: the guard's beat is
        # looked at that often, and costs a read of shared memory.
        self._guard.check(time.monotonic())
        self._spawner.follow_tracker()  # another pool's start may have made a new one

    def _spawn(self) -> None:
        try:
            child = self._spawner.spawn()
        except OSError as exc:
            if self._spawner.given_up is not None:  # start() raises it: no error to log
                self._break(self._spawner.given_up, quiet=True)
            else:
                self._break(f"no child could be started: {exc!r}")
            return
        self.spawned += 1
        child.fence = self._guard.add(child.pid)
        self._spawner.follow_server()
        self._children.append(child)
        self._selector.register(
            child.conn, selectors.EVENT_READ, lambda _: self._on_messages(child)
        )
        self._selector.register(
            child.process.sentinel, selectors.EVENT_READ, lambda _: self._on_exit(child)
        )

    def _on_server_death(self) -> None:
        """The fork server died, and every child with it: the replacements that
        ``_on_exit`` asks for bring up a fresh one."""
        lost = self._spawner.server_lost()
        if lost is None:
            return
        dead, how = lost
        if deaths.server_died(self._children, dead, how, self._on_exit):
            return  # charged to the jobs that ran: their count stops a job that causes it
        deaths_in_window = self._spawner.unblamed_death()
        if deaths_in_window >= server.MAX_DEATHS:
            self._break(
                f"the pool's fork server died {deaths_in_window} times within "
                f"{server.DEATH_WINDOW_S:g} s (last pid {dead})"
            )

    def _start_guard(self) -> None:
        if (fd := self._guard.start()) is not None:
            self._selector.register(fd, selectors.EVENT_READ, self._on_guard_death)

    def _on_guard_death(self, fd: int) -> None:
        """The guard process died (killed, crashed): start another on the same table. Until
        it reads it, the supervisor's own fence is the only one."""
        self._selector.unregister(fd)
        pid = self._guard.pid
        how = self._guard.lost()
        log.error("the pool's fence guard (pid %s) %s; starting a new one", pid, how)
        self._start_guard()

    # -- messages from children ------------------------------------------------------------

    def _on_messages(self, child: Child) -> None:
        if child.conn.closed:
            # A stale readiness from this select batch: an earlier event of the batch (a
            # kill's collect, the child's exit) already read this channel to its end and
            # closed it. (Read to its end and still open: receive_available finds nothing.)
            return
        try:
            messages = child.conn.receive_available()
        except (EOFError, OSError):  # died mid-message or closed; the sentinel follows
            self._hang_up(child)
            return
        except BadMessage as exc:  # the stream cannot be trusted past that frame
            log.warning("child %d sent a message that could not be decoded: %s", child.pid, exc)
            self._hang_up(child)
            child.refuse(exc)  # killed, and replaced as any dead child
            return
        for msg in messages:
            self._on_message(child, msg)

    def _on_message(self, child: Child, msg: Any) -> None:
        run = child.running
        kind = type(msg)  # most frequent first: this runs once or twice per job
        if kind is Finished or kind is Failed:
            if run is None or run.task_id != msg.task_id or run.kill_outcome is not None:
                return  # stale, or being killed: the kill decides the outcome
            now, at_ms = child.finish(run, msg, self._max_growth_mb)
            self._assigner.observe(now - run.started)
            self._advance(child, now, at_ms)
            child.sync_fence()
        elif kind is Progress:
            if run and run.task_id == msg.task_id and run.progress_deadline is not None:
                run.progressed(time.monotonic())  # the watchdog counts again
            if run and run.task_id == msg.task_id and run.task.on_progress:
                call(run.task.on_progress, msg.fraction, msg.message)
        elif kind is Ready:
            child.ready = True
            if self._contain.pid_namespace:
                # Signals and memory samples go to the handler's own process, two below
                # the one the pool started (pid_namespace.py).
                child.pid = inner_pid(child.process.pid) or child.pid
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
        self._hang_up(child)
        self._spawn()

    def _hang_up(self, child: Child) -> None:
        """Stop reading the child's channel, and close it (the child sees EOF)."""
        self._selector.unregister(child.conn)
        child.conn.close()
        self._exits_due[child] = time.monotonic() + EXIT_LATE_S

    def _look_at_late_exits(self, now: float, timeout: float | None) -> float | None:
        """A child's exit reaches the pool through its fork server, which reaps it: a
        stopped fork server reported none, and the attempt waited for its hard timeout
        (reported as one: an ``os._exit(3)`` became ``hard_timeout``) or forever. An exit
        later than EXIT_LATE_S has the server continued if it is stopped, as the guard
        is (guard.check). Returns the select timeout, shortened to the next exit due."""
        late = [child for child, due in self._exits_due.items() if due <= now]
        for child in late:
            del self._exits_due[child]
        if late:
            self._spawner.continue_stopped_server()
        if not self._exits_due:
            return timeout
        wait = max(0.0, min(self._exits_due.values()) - now)
        return wait if timeout is None else min(timeout, wait)

    # -- a child died ----------------------------------------------------------------------

    def _on_exit(self, child: Child) -> None:
        self._exits_due.pop(child, None)
        if child not in self._children:
            return  # a stale event of this select batch: its exit was handled already
        # 255 is also what multiprocess reports when the fork server closed the child's
        # sentinel by dying (its files close before its pidfd says so): look again, briefly.
        lost = child.process.exitcode == 255 and not child.server_died
        if self._spawner.server_dead(SERVER_DEATH_WAIT_S * lost):
            self._on_server_death()  # it explains this death (and handles this exit)
            return
        if not child.conn.closed:
            self._collect(child)
        self._selector.unregister(child.process.sentinel)
        if not child.conn.closed:
            self._hang_up(child)
        child.process.join(deaths.EXIT_GRACE_S)
        exitcode = child.process.exitcode
        self._children.remove(child)
        if child in self._idle:
            self._idle.remove(child)
        deaths.bury(child, exitcode, self._pending, self._contain)
        child.warn_if_retired_itself()
        self._guard.remove(child.fence)
        if not child.ready and not child.retiring and not child.server_died:
            self._start_failures += 1
            if self._start_failures >= MAX_START_FAILURES:
                self._break(
                    f"children exit before they are ready (last exit code {exitcode}); "
                    "see the child's stderr"
                )
        if not self._closing and not child.retiring and self.broken is None:
            self._replace += 1

    def _break(self, why: str, *, quiet: bool = False) -> None:
        """Give up: no more children. Attempts that never started end as interrupted."""
        if not quiet:
            log.error("the pool is broken: %s", why)
        self.broken = PoolBroken(why)
        self._closing = True
        while self._pending:
            self._pending.popleft().settle(Outcome.INTERRUPTED, None, detail=why)

    def _shutdown(self) -> None:
        """Stop every child (``deaths.stop_all``), then the guard, and close the fork
        server's pidfd, the control groups and the selector."""
        self._on_wake(None)  # commands that raced with close: submits end as interrupted
        commands.cancel_all(self._children, self._pending)
        # Stopped, the fork server would report no child's exit, and the stop would wait
        # for each and could not close it (the supervisor crashed, the worker never ended)
        self._spawner.continue_stopped_server()
        deaths.stop_all(self._children, self._pending)
        self._children.clear()
        if (fd := self._guard.pidfd) is not None:
            self._selector.unregister(fd)
        self._guard.close()
        if self._relay is not None:
            self._relay.close()
        self._spawner.close()
        self._contain.close()
        self._selector.close()
        self._mail.shut()
        with self._end_lock:
            self._ended = True
            if self._abandoned:  # a dropped pool's: nobody is left to close it
                self._mail.close()
