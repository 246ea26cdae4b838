"""The child's main loop. Runs in the child process; never imports Redis code.

    start: join its control group, set rlimits (limits.py) → setsid (own process group)
           → die with the parent → import the processor → Ready
    loop:  Run ─► decode args ─► processor(*args, **kwargs) ─► encode result ─► Finished
                                        │ raised / SoftTimeout
                                        └────────────────────────────────────► Failed
           sys.exit(N) / os._exit(N) in the handler ends the child with code N; the parent
           reads the code from the process sentinel.

The soft timeout arrives as SIGSOFT: the handler raises ``SoftTimeout`` in the main thread
only while the processor is running, so a late signal can never break the loop itself.

The fence guard, a thread, kills the child's process group once the running attempt's
fence deadline (``time.monotonic()``, shared with the parent, which moves it on every
renewal) has passed. The parent enforces the same deadline; the guard covers a parent
that cannot: stopped (Ctrl-Z stops the worker's process group, and children have their
own), or starved. A handler holding the GIL in one long C call keeps the guard from
running, so then only the parent's fence remains.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from types import FrameType
from typing import Any

from sandboxq import codec
from sandboxq.errors import SandboxqError, SoftTimeout
from sandboxq.pool import limits, linux
from sandboxq.pool.channel import Channel
from sandboxq.pool.messages import Failed, Finished, Progress, Ready, RemoteError, Run
from sandboxq.processor import resolve

#: The signal the parent sends at the soft deadline.
SIGSOFT = signal.SIGUSR1

#: How often the fence guard looks at the deadline; it strikes up to this much early, so
#: that it is never late.
FENCE_CHECK_S = 0.05


class JobContext:
    """What a handler can learn and say about the job it runs (``current_job()``)."""

    __slots__ = ("_conn", "_lock", "armed", "attempt", "job_id", "token")

    def __init__(self, conn: Channel, lock: threading.Lock, run: Run) -> None:
        self._conn = conn
        self._lock = lock
        self.token = run.token
        self.job_id = run.job_id
        self.attempt = run.attempt
        self.armed = False  # True only while the processor itself runs

    def progress(self, fraction: float, message: str | None = None) -> None:
        """Report progress (0.0 to 1.0) to the parent; safe to call from any thread."""
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"progress fraction must be within 0..1, got {fraction!r}")
        with self._lock:
            self._conn.send(Progress(self.token, float(fraction), message))


_current: JobContext | None = None


def current_job() -> JobContext:
    """The job the calling handler is running; only valid inside a processor."""
    if _current is None:
        raise SandboxqError("current_job() is only available inside a running processor")
    return _current


_soft_token: Any = None  # shared with the parent: the token the soft signal is meant for


def _on_soft_timeout(signum: int, frame: FrameType | None) -> None:
    job = _current
    if job is not None and job.armed and _soft_token.value == job.token:
        job.armed = False  # once per attempt
        raise SoftTimeout(f"soft timeout of job {job.job_id or job.token}")


def describe(exc: BaseException) -> RemoteError:
    """Describe an exception so it always crosses the pipe, pickleable or not."""
    try:
        message = str(exc)
    except Exception:
        message = object.__repr__(exc)
    tb = "".join(traceback.format_exception(exc))
    pickled: bytes | None
    try:
        pickled = pickle.dumps(exc)
        pickle.loads(pickled)  # some exceptions pickle but cannot be rebuilt
    except Exception:
        pickled = None
    kind = type(exc)
    return RemoteError(f"{kind.__module__}.{kind.__qualname__}", message, tb, pickled)


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
    os._exit(status)


def run_one(conn: Channel, lock: threading.Lock, processor: Any, run: Run) -> None:
    global _current
    job = _current = JobContext(conn, lock, run)
    reply: Finished | Failed
    try:
        args, kwargs = codec.decode_call(run.codec, run.payload)
        job.armed = True
        try:
            value = processor(*args, **kwargs)
        finally:
            job.armed = False
        result = codec.encode(run.codec, value, what="result", max_bytes=run.max_result_bytes)
        reply = Finished(run.token, result)
    except SystemExit as exc:
        _exit_now(exc)
        raise  # unreachable: _exit_now never returns
    except BaseException as exc:  # a handler may raise anything; one job fails, not the child
        reply = Failed(run.token, describe(exc))
    finally:
        _current = None
    with lock:
        conn.send(reply)


def _guard_fence(fence: Any) -> None:
    """Kill this child's tree once the running attempt's fence deadline (0: none) is near."""
    while True:
        time.sleep(FENCE_CHECK_S)
        deadline = fence.value
        if deadline and _current is not None and time.monotonic() + FENCE_CHECK_S >= deadline:
            os.killpg(0, signal.SIGKILL)


def child_main(
    sock: socket.socket,
    processor_path: str,
    soft_token: Any,
    fence: Any,
    setup: limits.ChildSetup | None = None,
) -> None:
    """Entry point of a pool child (the target of its multiprocess.Process)."""
    global _soft_token
    setup = setup or limits.ChildSetup()
    limits.enter(setup)  # first: its control group and rlimits cover all that follows
    _soft_token = soft_token
    conn = Channel(sock)
    os.setsid()  # own session and process group: one killpg takes the whole tree
    if not linux.die_with_parent(signal.SIGKILL):
        os._exit(1)
    threading.Thread(target=_guard_fence, args=(fence,), name="sandboxq-fence", daemon=True).start()
    # The fork server's parent-death handler is inherited: a child must not run it.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(SIGSOFT, _on_soft_timeout)
    processor = limits.wrap(resolve(processor_path), setup)
    lock = threading.Lock()
    try:
        conn.send(Ready(os.getpid()))
        while True:
            run_one(conn, lock, processor, conn.receive())
    except (EOFError, OSError):
        return  # the parent closed our channel: stop quietly
