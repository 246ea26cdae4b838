"""The child's main loop. Runs in the child process; never imports Redis code.

    start: only its channel and stdio kept (descriptors.py) → (pid_namespace=True: on
           as pid 2 of a PID namespace of its own, pid_namespace.py) → join its control
           group, set rlimits (limits.py) → setsid (own process group) → subreaper → stop
           when the parent dies → import the processor → Ready
    loop:  Run ─► decode args ─► processor(*args, **kwargs) ─► encode result ─┐
                                        │ raised / SoftTimeout                 │
                                        ▼                                      ▼
                         sweep: kill and reap every process the attempt started
                                        ▼                                      ▼
                                     Failed                                 Finished
           sys.exit(N) / os._exit(N) in the handler ends the child with code N; the parent
           reads the code from the process sentinel. A reply that cannot be sent (the
           handler closed or broke the channel) is marked in ``shared[CHANNEL_LOST]``
           and the child exits: that attempt is an error saying so.

The attempt boundary: the child is a subreaper, so whatever its handler starts (a
daemon that double-forks, a helper in its own session) stays below it, and after every
attempt, before the outcome is sent, ``kill.sweep_own_tree`` kills and reaps all of it.
A process started with ``clone(CLONE_PARENT)`` is its parent's child instead: in a PID
namespace the child kills it too (``pid_namespace.sweep_namespace``), in a cgroup mode the
group sweep does (limits.py), and in the process-tree mode the supervisor does, among the
fork server's children (``server.sweep_escaped``).
A Python thread the attempt left running cannot be killed (threads.py): the child marks
the attempt (``shared[THREADS_LEFT]``) and the parent replaces it before its next task; so too when
the attempt left no descriptor free (``shared[DESCRIPTORS_FULL]``, descriptors.py).
After the reply, off the job's path, the child sets back what the attempt changed of
its process (timers, signal handlers, stdio flags: baseline.py); when it changed what
cannot be set back, the child marks ``shared[STATE_CHANGED]`` and ends itself before it
reads another task.
``keep_strays`` (a pool setting, off by default) skips both for handlers that keep a
helper alive across jobs on purpose; the child still sweeps when it exits.

The soft timeout arrives as SIGSOFT: the handler raises ``SoftTimeout`` in the main thread
only while the processor is running, so a late signal can never break the loop itself.

With ``capture_output`` its stdout and stderr are pipes to the parent (output.py),
line-buffered, and flushed at the end of every attempt, before its reply.

The stack of every thread is dumped (``faulthandler``, stacks.py) into a file the parent
holds when the parent asks (at the soft signal, just before the hard kill) and when the
child crashes.

The fence deadline of the running attempt is not the child's to enforce: the pool's
guard process (guard.py) kills the child's tree when it passes, whatever the child or
its parent are doing.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]
import dataclasses
import math
import numbers
import os
import pickle
import signal
import socket
import sys
import threading
import traceback
from types import FrameType, TracebackType
from typing import Any

from sandboxq import codec, tracing
from sandboxq.errors import SandboxqError, SerializationError, SoftTimeout
from sandboxq.pool import (
    baseline,
    descriptors,
    limits,
    linux,
    output,
    pid_namespace,
    stacks,
    threads,
)
from sandboxq.pool.channel import Channel
from sandboxq.pool.kill import sweep_own_tree
from sandboxq.pool.messages import Failed, Finished, Progress, Ready, RemoteError, Run
from sandboxq.processor import resolve
from sandboxq.text import bounded_traceback, storable

#: The signal the parent sends at the soft deadline.
SIGSOFT = signal.SIGUSR1

#: The ``shared`` array between parent and child: [0] the id of the task the child
#: started last (written before it runs anything of it), [1] how many tasks the parent
#: has withdrawn, [2] the task whose reply could not be sent because the child's own code
#: closed or broke its channel, [3] the task that left threads running (written before
#: its reply), [4] the task that left no descriptor free, [5] the task after whose reply
#: the child ended itself, having changed what the next one relies on (baseline.py),
#: [6:] a ring of the withdrawn task ids. A withdrawn task is skipped, never run.
STARTED, WITHDRAWN, CHANNEL_LOST, THREADS_LEFT, DESCRIPTORS_FULL, STATE_CHANGED, RING = range(7)
WITHDRAWN_RING = 64
SHARED_SIZE = RING + WITHDRAWN_RING

#: Longest progress message that crosses the pipe; a longer one is cut to this many chars.
MAX_PROGRESS_MESSAGE = 4096


class JobContext:
    """What a handler can learn and say about the job it runs (``current_job()``).

    ``attempt`` is the retry budget's count (``info().attempts``: 1 on the first try, 2 on
    the first retry), which a requeued attempt (interrupted, lease lost) does not move,
    so two attempts can see the same number; the history's records number every attempt.
    """

    __slots__ = ("_conn", "_lock", "armed", "attempt", "job_id", "task_id")

    def __init__(self, conn: Channel, lock: threading.Lock, run: Run) -> None:
        self._conn = conn
        self._lock = lock
        self.task_id = run.task_id
        self.job_id = run.job_id
        self.attempt = run.attempt
        self.armed = False  # True only while the processor itself runs

    def progress(self, fraction: float, message: str | None = None) -> None:
        """Report progress (0.0 to 1.0) to the parent; safe to call from any thread.

        ``message`` longer than ``MAX_PROGRESS_MESSAGE`` characters is cut to that length.
        """
        given: object = fraction  # checked as what a caller may really pass, not as typed
        if isinstance(given, bool) or not isinstance(given, numbers.Real):
            raise TypeError(f"progress fraction must be a number, got {fraction!r}")
        value = float(given)
        if not (math.isfinite(value) and 0.0 <= value <= 1.0):
            raise ValueError(f"progress fraction must be within 0..1, got {fraction!r}")
        said: object = message
        if said is not None:
            if not isinstance(said, str):
                raise TypeError(f"progress message must be a str or None, got {message!r}")
            # a plain str, not a subclass; storable: Redis keeps it as UTF-8
            message = storable(str.__str__(said)[:MAX_PROGRESS_MESSAGE])
        with self._lock:
            self._conn.send(Progress(self.task_id, value, message))


_current: JobContext | None = None


def current_job() -> JobContext:
    """The job the calling handler is running; only valid inside a processor."""
    if _current is None:
        raise SandboxqError("current_job() is only available inside a running processor")
    return _current


#: The most of an exception's pickle sent to the parent (``describe``): the exception
#: itself, rebuilt there, is a convenience; its type, message and traceback are the record.
MAX_PICKLED_ERROR_BYTES = 1024 * 1024

_soft_task_id: Any = None  # shared with the parent: which task the soft signal is meant for


def _told_to_stop(job: JobContext) -> SoftTimeout:
    """What a handler raises at its soft signal (the outcome says what sent it: its soft
    timeout, deadline_s, the progress watchdog)."""
    return SoftTimeout(f"job {job.job_id or job.task_id} was told to stop (its soft signal)")


def _on_soft_timeout(signum: int, frame: FrameType | None) -> None:
    job = _current
    if job is not None and job.armed and _soft_task_id.value == job.task_id:
        job.armed = False  # once per attempt
        raise _told_to_stop(job)


def _from_handler(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` from the handler's first frame on: the frames of this module and of
    ``limits.wrap`` that called it say nothing about the user's code. An error raised in
    them (the call itself refused: a wrong number of arguments) keeps them all."""
    start = tb
    while start is not None and start.tb_frame.f_code.co_filename in _CALLER_FILES:
        start = start.tb_next
    return start or tb


def describe(exc: BaseException) -> RemoteError:
    """Describe an exception so it always crosses the pipe, pickleable or not."""
    try:
        message = str(exc)
    except Exception:
        message = object.__repr__(exc)
    # Bounded here, before it crosses the pipe: a recursion error's traceback is megabytes,
    # and a message can be anything (a frame over the pipe's limit would lose it all); and
    # storable: a file name that is not UTF-8 made the record unwritable (text.storable).
    message = bounded_traceback(storable(message))
    lines = traceback.format_exception(type(exc), exc, _from_handler(exc.__traceback__))
    tb = bounded_traceback(storable("".join(lines)))
    pickled: bytes | None
    try:
        pickled = pickle.dumps(exc)
        if len(pickled) > MAX_PICKLED_ERROR_BYTES:
            pickled = None  # described by its type, message and traceback alone
        else:
            pickle.loads(pickled)  # some exceptions pickle but cannot be rebuilt
    except Exception:
        pickled = None
    kind = type(exc)
    return RemoteError(storable(f"{kind.__module__}.{kind.__qualname__}"), message, tb, pickled)


def _is_exit_status(code: object) -> bool:
    """False for an integer ``sys.exit`` code the system would wrap (256 exits as 0, a
    completed job; -1 as 255): None, a message and 0-255 are exit statuses."""
    return not isinstance(code, int) or 0 <= code <= 255


def _not_a_status(exc: SystemExit) -> SystemExit:
    """``exc`` as the error it is: a code that is not an exit status, named."""
    code = exc.code
    assert isinstance(code, int)
    shown = str(code) if len(str(code)) <= 40 else f"{str(code)[:20]}...({len(str(code))} digits)"
    error = SystemExit(
        f"sys.exit({shown}): an exit code is 0-255 (the system would report it as {code & 0xFF})"
    )
    return error.with_traceback(exc.__traceback__)


def _exit_now(exc: SystemExit) -> None:
    """The handler asked for a process exit: honour its code so the parent sees it."""
    code = exc.code
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code & 0xFF
    else:
        print(code, file=sys.stderr)
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    sweep_own_tree()
    os._exit(status)


#: Where the frames that call a handler come from (``_from_handler``).
_CALLER_FILES = frozenset({_from_handler.__code__.co_filename, limits.wrap.__code__.co_filename})


def run_one(
    conn: Channel,
    lock: threading.Lock,
    processor: Any,
    run: Run,
    keep_strays: bool = False,
    shared: Any = None,
) -> None:
    global _current
    if shared is not None:
        output.wait_drained()  # what the last attempt wrote is read as its own (output.py)
        stacks.clear()  # and what is in its dump file, as this one's stack (stacks.py)
        # First "started", then the check: the parent withdraws a task only while this
        # process is stopped (SIGSTOP), so it either sees it started or we see the mark.
        shared[STARTED] = run.task_id
        if shared[WITHDRAWN] and run.task_id in shared[RING:]:
            return  # withdrawn while it waited in our channel: never started, no reply
    job = _current = JobContext(conn, lock, run)
    reply: Finished | Failed
    try:
        args, kwargs = codec.decode_call(run.codec, run.payload)
        job.armed = True
        traced = tracing.enter_attempt(run.trace)  # the handler's spans: the attempt's children
        try:
            if _soft_task_id is not None and _soft_task_id.value == run.task_id:
                # the soft signal came before the handler began (its job's deadline_s
                # had passed): it was meant for this task, so it counts now
                job.armed = False
                raise _told_to_stop(job)
            value = processor(*args, **kwargs)
        finally:
            limits.leave_if_a_copy()
            job.armed = False
            tracing.leave_attempt(traced)
        reply = _returned(run, value)
    except SystemExit as exc:
        if not _is_exit_status(exc.code):
            reply = Failed(
                run.task_id, describe(_not_a_status(exc)), tracing.attempt_peak(run.trace)
            )
        else:
            _exit_now(exc)
            raise  # unreachable: _exit_now never returns
    except BaseException as exc:  # a handler may raise anything; one job fails, not the child
        reply = Failed(run.task_id, describe(exc), tracing.attempt_peak(run.trace))
    finally:
        _current = None
    output.flush_stdio()  # what it printed is in the pipe before its reply leaves
    descriptors.make_room()  # a sweep needs a free descriptor (descriptors.py)
    if not keep_strays:
        sweep_own_tree()  # before the outcome leaves: nothing the attempt started outlives it
        pid_namespace.sweep_namespace()  # nor what it moved out of our tree (CLONE_PARENT)
    if shared is not None:
        _mark_leftovers(shared, run.task_id, keep_strays)
    try:
        with lock:
            conn.send(reply)
    except OSError:
        # The parent closes a channel only once it no longer wants the reply (a kill, whose
        # reason names the outcome): the handler closed or broke it. Say so, or the
        # parent would read the child's quiet exit as the handler's exit code 0.
        if shared is not None:
            shared[CHANNEL_LOST] = run.task_id
        raise
    if shared is not None:
        _after_reply(shared, run.task_id, keep_strays)


def _returned(run: Run, value: Any) -> Finished | Failed:
    """The reply for a handler that returned ``value``: Failed when the job's codec cannot
    encode it (or it is over ``max_result_bytes``), with the error alone. The handler
    raised nothing: a traceback would show only the encoder's frames (codec.py, json),
    and the worker would log them as if they were the handler's; the error's one line
    names what could not be encoded and where it sits."""
    try:
        result = codec.encode(run.codec, value, what="result", max_bytes=run.max_result_bytes)
    except SerializationError as exc:
        error = dataclasses.replace(describe(exc), traceback="")
        return Failed(run.task_id, error, tracing.attempt_peak(run.trace))
    return Finished(run.task_id, result, tracing.attempt_peak(run.trace))


def _arm_signals(stack_fd: int | None) -> None:
    """The handlers of the signals the parent sends: at the start, and after each
    attempt again (a change made with ctypes or ``siginterrupt`` is not seen)."""
    _signal.signal(SIGSOFT, _on_soft_timeout)  # signal's wrapper: 7.7 us, this 0.4
    if stack_fd is not None:
        stacks.rearm(stack_fd)


def _mark_leftovers(shared: Any, task_id: int, keep_strays: bool) -> None:
    """Mark, before the reply, what the attempt left that only a replacement clears and
    a look of a microsecond sees: the parent replaces the child before its next task
    (handles.py)."""
    if not keep_strays and threads.started_left():
        # A thread cannot be killed from outside it (a leftover thread would print into
        # the next attempt's output, spend its CPU and count against its max_processes).
        shared[THREADS_LEFT] = task_id
    if descriptors.spare_gone():
        shared[DESCRIPTORS_FULL] = task_id  # the next task would find none free


class _Retire(Exception):
    """The child changed in a way only a replacement clears: it ends (child_main)."""


def _after_reply(shared: Any, task_id: int, keep_strays: bool) -> None:
    """After the reply, off the job's path (the checks cost some 14 us: baseline.py):
    set back what the attempt changed and the pool can; when it changed what cannot be
    set back, or left a thread that had not counted itself by the reply (threads.py),
    mark it and end the child before it reads another task (the parent puts that task
    back in line, uncharged)."""
    baseline.restore()  # timers, the wakeup fd, stdio flags, SIGCHLD and SIGPIPE
    late_thread = not keep_strays and threads.left_running()
    if baseline.changed() is not None or late_thread:
        shared[STATE_CHANGED] = task_id
        raise _Retire


def child_main(
    sock: socket.socket,
    processor_path: str,
    soft_task_id: Any,
    keep_strays: bool = False,
    shared: Any = None,
    setup: limits.ChildSetup | None = None,
    stack_fd: int | None = None,
    output_fds: tuple[int, int] | None = None,
) -> None:
    """Entry point of a pool child (the target of its multiprocess.Process)."""
    global _soft_task_id
    if output_fds is not None:
        output.attach(*output_fds)  # stdout and stderr: pipes to the parent (output.py)
    # First, before any of the user's code: nothing of the fork server, the resource
    # tracker or another helper stays reachable (descriptors.py).
    given = (() if stack_fd is None else (stack_fd,)) + output.kept_fds()
    descriptors.isolate(sock.fileno(), *given)
    descriptors.keep_spare()
    setup = setup or limits.ChildSetup()
    if setup.privileges.pid_namespace:
        pid_namespace.enter()  # from here on: pid 2 of a PID namespace of its own
    if stack_fd is not None:
        stacks.arm(stack_fd)  # where it hangs or crashes, for the parent (stacks.py)
    limits.enter(setup)  # then its control group and rlimits cover all that follows
    _soft_task_id = soft_task_id
    conn = Channel(sock)
    os.setsid()  # own session and process group: one killpg takes the whole tree
    linux.become_subreaper()  # whatever the handler starts stays below us: see sweep
    # Why stop, not die: a child that dies hands what it started to init, out of reach of
    # any sweep; a stopped one keeps its whole tree below it, for the supervisor (the fork
    # server died alone) or the pool's guard (the worker died with it) to kill all of it.
    if not linux.die_with_parent(signal.SIGSTOP):
        os._exit(1)
    # The fork server's parent-death handler is inherited: a child must not run it. Nor
    # its blocked SIGINT and SIGHUP (supervisor.py): a handler's KeyboardInterrupt is its
    # own, and so is a hangup (this child has a session of its own, no terminal's).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # A Ctrl-C or hangup sent to the terminal's process group while this child was still
    # in it (from its fork to setsid above) waits, blocked: it was the run's, and once
    # unblocked it ended the child's start with a KeyboardInterrupt traceback. Ignoring a
    # signal discards it where it waits; then its usual handling comes back.
    for signum in (signal.SIGINT, signal.SIGHUP):
        usual = signal.signal(signum, signal.SIG_IGN)
        signal.signal(signum, signal.SIG_DFL if usual is None else usual)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGHUP})
    _arm_signals(None)  # the dump signal is armed above, with the file
    processor = limits.wrap(resolve(processor_path), setup, sweep=not keep_strays)
    # imports done: as every attempt finds the child
    threads.record()
    baseline.record(
        (SIGSOFT, stacks.DUMP_SIGNAL),
        lambda: _arm_signals(stack_fd),
        cpu_budget=setup.cpu_time_s is not None,
    )
    lock = threading.Lock()
    try:
        conn.send(Ready(os.getpid()))
        while True:
            run_one(conn, lock, processor, conn.receive(), keep_strays, shared)
    except (EOFError, OSError):
        return  # the parent closed our channel: stop quietly
    except _Retire:
        return  # changed past setting back (baseline.py): the parent starts another
    finally:
        sweep_own_tree()  # kept strays included: nothing outlives the child
        if threading.active_count() > 1:
            # A thread a handler left (kept strays, or the attempt it recycles this
            # child for): the process's normal end would wait for it, maybe forever.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
