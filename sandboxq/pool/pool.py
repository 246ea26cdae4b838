"""The public pool: sandboxed children for one processor, usable without any backend.

    with Pool(processor="pkg.mod:fn", size=4, hard_timeout_s=30) as pool:
        future = pool.submit(*args, **kwargs)     # concurrent.futures.Future
        future.result()                           # value, or AttemptFailed(.outcome, ...)

``submit`` is a thin layer over ``execute(task, on_done)``, which the worker uses: it
takes payloads already encoded (JSON from Redis, passed through without decoding) and
reports each attempt's ``AttemptResult`` on the supervisor thread.
"""

from __future__ import annotations

import atexit
import os
import weakref
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from datetime import timedelta
from typing import Any

import multiprocess
from multiprocess import process

from sandboxq import codec
from sandboxq.errors import PoolBroken, ProcessorError, SerializationError
from sandboxq.models import Outcome
from sandboxq.pool import server, tracker
from sandboxq.pool.attempt import AttemptResult, Task
from sandboxq.pool.commands import EndUnstarted, Fence, Kill, Soft
from sandboxq.pool.containment import detect
from sandboxq.pool.limits import ChildSetup
from sandboxq.pool.privileges import Asked, resolve_user
from sandboxq.pool.supervisor import Supervisor
from sandboxq.processor import default_import_timeout_s, resolve_within, split_path
from sandboxq.settings import (
    DEFAULT_MAX_PROCESSES,
    ChildSettings,
    ContainmentSetting,
    PoolSettings,
    StartMethod,
    from_call,
)

Seconds = float | timedelta | None

#: How often a child's tree memory is sampled in process_tree mode (PoolSettings' default).
DEFAULT_MEMORY_CHECK_S = PoolSettings.model_fields["memory_check_interval_s"].default

#: Imported by the fork server before it forks anything (see forkserver_hooks).
_FORKSERVER_PRELOAD = ["sandboxq.pool.forkserver_hooks", "sandboxq.pool.child"]

#: Every supervisor whose thread may still run. Its thread holds it while it runs, so a
#: dropped pool's stays here until the work it was given has ended.
_supervisors: weakref.WeakSet[Supervisor] = weakref.WeakSet()


def _context(start_method: StartMethod, processor: str, preload: bool = True) -> Any:
    ctx = multiprocess.get_context(start_method)
    if start_method == "forkserver":
        # The preload list is global and only read when the fork server starts; every
        # pool adds its processor's module so replacements start without re-importing.
        module = split_path(processor)[0]
        if preload and module not in _FORKSERVER_PRELOAD:
            _FORKSERVER_PRELOAD.append(module)
        ctx.set_forkserver_preload(list(_FORKSERVER_PRELOAD))
    return ctx


def _no_preload(start_method: StartMethod, processor: str) -> None:
    """Take ``processor``'s module off the fork server's preload list (its import hung
    there: ``Supervisor.start``)."""
    module = split_path(processor)[0]
    if start_method == "forkserver" and module in _FORKSERVER_PRELOAD:
        _FORKSERVER_PRELOAD.remove(module)
        multiprocess.get_context("forkserver").set_forkserver_preload(list(_FORKSERVER_PRELOAD))


class Pool:
    """Long-lived sandboxed children running ``processor``, one attempt per child at a time.

    Each attempt gets a soft timeout (``SoftTimeout`` raised in the handler), a hard timeout
    (the child's whole process tree is killed) and an optional memory limit. A failed
    attempt's future raises ``AttemptFailed`` whose ``.outcome`` names how it ended.
    Leaving the ``with`` block waits for submitted work, then stops every child (after an
    exception in the block, what has not ended yet ends as ``interrupted``).

    Whatever an attempt starts is killed before its outcome is reported; ``keep_strays=True``
    lets processes a handler started outlive its attempt (a helper kept across jobs on
    purpose); they still end when their child does.
    """

    def __init__(
        self,
        processor: str,
        size: int | None = None,
        *,
        soft_timeout_s: Seconds = None,
        hard_timeout_s: Seconds = None,
        max_memory_mb: float | None = None,
        max_jobs_per_child: int | None = None,
        start_method: StartMethod = "forkserver",
        max_result_bytes: int = codec.DEFAULT_MAX_BYTES,
        memory_check_interval_s: float = DEFAULT_MEMORY_CHECK_S,
        import_timeout_s: float | None = None,
        keep_strays: bool = False,
        max_child_growth_mb: float | None = None,
        containment: ContainmentSetting = "auto",
        max_processes: int | None = DEFAULT_MAX_PROCESSES,
        cpu_time_s: float | None = None,
        max_open_files: int | None = None,
        max_file_size_mb: float | None = None,
        max_address_space_mb: float | None = None,
        core_dumps: bool = False,
        capture_output: bool = True,
        pool_memory_mb: float | None = None,
        user: str | int | None = None,
        group: str | int | None = None,
        network: bool = True,
        pid_namespace: bool = False,
    ) -> None:
        # Every keyword is the setting of that name, with its default.
        s = from_call(PoolSettings, locals())
        # An unimportable processor fails here, with the import error; one that hangs at
        # import fails after import_timeout_s, and never reaches the fork server's preload.
        resolve_within(processor, s.import_timeout_s)
        self._open(s, s.size, s.max_result_bytes, s.memory_check_interval_s)

    @classmethod
    def from_settings(
        cls, settings: ChildSettings, size: int, stop_asked: Callable[[], bool] | None = None
    ) -> Pool:
        """A pool of ``size`` children from settings validated elsewhere, whose processor
        the caller already imported (the worker's: nothing is checked or imported twice).
        ``stop_asked`` ends a start that waits for its fork server (``PoolBroken``)."""
        pool = cls.__new__(cls)
        pool._open(settings, size, codec.DEFAULT_MAX_BYTES, DEFAULT_MEMORY_CHECK_S, stop_asked)
        return pool

    def _open(
        self,
        settings: ChildSettings,
        size: int,
        max_result_bytes: int,
        memory_check_interval_s: float,
        stop_asked: Callable[[], bool] | None = None,
    ) -> None:
        self.settings = s = settings
        self._size = size
        limits = ChildSetup(
            core_dumps=s.core_dumps,
            cpu_time_s=s.cpu_time_s,
            max_open_files=s.max_open_files,
            max_file_size_mb=s.max_file_size_mb,
            max_address_space_mb=s.max_address_space_mb,
        )
        uid, gid = resolve_user(s.user, s.group)
        asked = Asked(uid, gid, s.network, s.pid_namespace)
        self._containment = detect(s.containment, limits, s.max_processes, asked=asked)
        try:
            self._supervisor = Supervisor(
                # A processor run as another user is imported by each child once it is
                # that user, never by the fork server (root) beforehand.
                _context(s.start_method, s.processor, preload=uid is None and gid is None),
                s.processor,
                size,
                max_jobs_per_child=s.max_jobs_per_child,
                max_result_bytes=max_result_bytes,
                memory_check_interval_s=memory_check_interval_s,
                keep_strays=s.keep_strays,
                max_child_growth_mb=s.max_child_growth_mb,
                containment=self._containment,
                capture_output=s.capture_output,
                pool_memory_mb=s.pool_memory_mb,
            )
        except BaseException:
            # The pool never started (the kernel refused its memory budget, say): its
            # groups go now, as when a setting fails the containment's own start, rather
            # than wait for the next pool to find them stale. Once the supervisor runs,
            # its children are in them and its shutdown removes them.
            self._containment.close()
            raise
        limit = settings.import_timeout_s or default_import_timeout_s()
        try:
            self._supervisor.start(limit, stop_asked)
        except ProcessorError:
            # Its next fork server must not hang on it again, nor every other pool's here:
            # children import it themselves.
            _no_preload(s.start_method, s.processor)
            raise
        _supervisors.add(self._supervisor)
        # A pool dropped unclosed (made in a function that returned, one per file in a
        # loop) stops as ProcessPoolExecutor's does: what it was given runs to its end,
        # then its children and helpers stop. Without this they lived on, and the
        # program hung at exit on children nobody would ever stop.
        self._on_drop = weakref.finalize(self, self._supervisor.abandon)
        self._on_drop.atexit = False  # at exit, _stop_running_pools stops it

    @property
    def size(self) -> int:
        return self._size

    @property
    def broken(self) -> PoolBroken | None:
        """Why the pool gave up (its children cannot be started, or its fork server keeps
        dying), or None. Once set, ``submit``/``execute`` raise it, attempts that had not
        started ended as ``interrupted``, and the pool runs nothing more."""
        return self._supervisor.broken

    @property
    def alive(self) -> bool:
        """Whether the pool's supervisor thread still runs (it stops at shutdown, or when
        it crashes: then nothing settles the attempts it holds)."""
        return self._supervisor.is_alive()

    @property
    def containment(self) -> str:
        """The containment mode in force: ``cgroup_v2``, ``cgroup_v1`` or ``process_tree``."""
        return self._containment.mode

    @property
    def protections(self) -> tuple[str, ...]:
        """What keeps a handler from lifting its limits (``privileges.py``), in words:
        empty where nothing is given up."""
        return self._containment.protections

    @property
    def pids(self) -> list[int]:
        """Process ids of the current children."""
        return self._supervisor.pids

    def child_states(self) -> dict[str, list[int]]:
        """Child pids by state (starting, busy, idle): a snapshot, for metrics."""
        return self._supervisor.child_states()

    @property
    def restarts(self) -> int:
        """Children started to replace others (crashed, killed, recycled)."""
        return max(0, self._supervisor.spawned - self.size)

    @property
    def helper_restarts(self) -> int:
        """Helpers of the pool (its fork server, its guard) started again after they died."""
        return self._supervisor.helper_restarts

    def submit(self, *args: Any, **kwargs: Any) -> Future[Any]:
        """Run ``processor(*args, **kwargs)`` in a child; returns a Future of its result.

        ``cancel()`` on it, until it is done, ends the attempt (as pebble's pool does, and
        unlike ``ProcessPoolExecutor``, whose running futures cannot be cancelled): one not
        started yet never starts, a running one's tree is killed."""
        future = _AttemptFuture()
        task = self.make_task(*args, **kwargs)
        # Its id once execute returns: nobody holds the future to cancel it before then.
        future.attempt = (self, self.execute(task, lambda attempt: _settle(future, attempt)))
        return future

    def make_task(self, *args: Any, **kwargs: Any) -> Task:
        """A task for ``processor(*args, **kwargs)`` with this pool's limits (for ``execute``)."""
        s = self.settings
        return Task(
            codec.encode_call("pickle", args, kwargs),
            "pickle",
            soft_timeout_s=s.soft_timeout_s,
            hard_timeout_s=s.hard_timeout_s,
            max_memory_mb=s.max_memory_mb,
        )

    def execute(
        self,
        task: Task,
        on_done: Callable[[AttemptResult], None],
        *,
        task_id: int | None = None,
    ) -> int:
        """Queue one attempt; ``on_done`` is called once, on the supervisor thread.

        Returns the attempt's task id, which ``kill``, ``extend_fence`` and ``soft_stop``
        take: ``task_id`` when given (from ``new_task_id``), else a new one.
        """
        return self._supervisor.submit(task, on_done, task_id)

    def new_task_id(self) -> int:
        """A task id to give ``execute``. The attempt may start, and be worth killing,
        before ``execute`` returns to its caller's thread: a caller that others may ask
        to kill it (a cancel, a lost lease) records its id first. A ``kill``,
        ``soft_stop`` or ``extend_fence`` that names it before ``execute`` is kept and
        done when the attempt comes (a kill then ends it unstarted)."""
        return self._supervisor.new_task_id()

    def kill(
        self, task_id: int, outcome: Outcome, detail: str, *, stack_first: bool = False
    ) -> None:
        """End attempt ``task_id`` now with ``outcome``; kills its child's tree if it runs.
        With ``stack_first``, a running child is asked for its stack (the attempt's
        traceback) and killed ``stacks.DUMP_EARLY_S`` (50 ms) later, whatever the dump did."""
        self._supervisor.command(Kill(task_id, outcome, detail, stack_first))

    def extend_fence(self, task_id: int, deadline: float) -> None:
        """Move attempt ``task_id``'s fence deadline to ``deadline`` (``time.monotonic()``)."""
        self._supervisor.command(Fence(task_id, deadline))

    def soft_stop(self, task_id: int) -> None:
        """Send attempt ``task_id`` its soft-timeout signal now (``SoftTimeout`` in the handler);
        however it ends after that, its outcome is ``interrupted`` (a shutdown, not a fault)."""
        self._supervisor.command(Soft(task_id))

    def end_unstarted(self, outcome: Outcome, detail: str) -> None:
        """End every attempt not yet handed to a child with ``outcome``, without running it."""
        self._supervisor.command(EndUnstarted(outcome, detail))

    def running_pids(self) -> dict[int, int]:
        """Task id → pid of the child running it, right now."""
        return self._supervisor.running_pids()

    def running_starts(self) -> dict[int, tuple[int, int | None]]:
        """Task id → (pid of the child running it, when it started it: ms), right now."""
        return self._supervisor.running_starts()

    def shutdown(self, wait: bool = True, *, cancel: bool = False) -> None:
        """Stop the pool. ``cancel`` ends queued and running attempts as ``interrupted``.
        In a process forked from the pool's, nothing: the pool is the parent's."""
        if self._supervisor.forked_from is not None:
            return
        self._supervisor.close(cancel=cancel)
        if wait:
            self._supervisor.join()
            self._supervisor.close_wake_pipe()
            self._on_drop.detach()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown(wait=True, cancel=exc[0] is not None)


class _AttemptFuture(Future[Any]):
    """``Pool.submit``'s future: cancelling it ends its attempt. (A done-callback on each
    future did the same and cost 18 % of the pool's no-op throughput, 16,800 against
    20,400 jobs/s: ``add_done_callback`` was the costliest call of a submit.)"""

    attempt: tuple[Pool, int] | None = None

    def cancel(self) -> bool:
        cancelled = super().cancel()
        if cancelled and self.attempt is not None:
            pool, task_id = self.attempt
            pool.kill(task_id, Outcome.CANCELLED, "its future was cancelled")
        return cancelled


def _settle(future: Future[Any], attempt: AttemptResult) -> None:
    try:
        if attempt.outcome is not Outcome.OK or attempt.result is None:
            future.set_exception(attempt.to_error())
            return
        try:
            value = codec.decode("pickle", attempt.result, what="result")
        except SerializationError as exc:
            future.set_exception(exc)
            return
        future.set_result(value)
    except InvalidStateError:  # the caller cancelled the future: nobody wants the outcome
        pass


def _forked_copies() -> None:
    """In a process forked from one that holds pools (``os.fork``, a preloading server):
    each is the parent's. It refuses work (its supervisor thread did not come along, so a
    submit waited forever), and nothing here stops it or joins the parent's children
    (multiprocess's own exit hook failed on them: "can only join a child process"). A
    Pool made here works, with a fork server of its own."""
    parent = os.getppid()
    for supervisor in list(_supervisors):
        supervisor.forked_from = parent
    _supervisors.clear()
    process._children.clear()  # none of them is this process's child
    server.forget_the_parents()  # a Pool made here starts a fork server of its own
    tracker.forget_the_parents()  # and follows the tracker without waking the parent's


os.register_at_fork(after_in_child=_forked_copies)


@atexit.register
def _stop_running_pools() -> None:
    # Runs before multiprocess's own exit hook, which would otherwise wait forever for
    # children that are blocked reading their pipes. Dropped pools' too: their
    # supervisors may still be finishing what they were given.
    for supervisor in list(_supervisors):
        supervisor.close(cancel=True)
        supervisor.join()
