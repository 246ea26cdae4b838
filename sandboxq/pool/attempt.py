"""One attempt as the parent sees it: what to run (``Task``), how it ended (``AttemptResult``).

Both are made once per job on the hot path and never change after, but they are not
``frozen``: a frozen dataclass sets each field through ``object.__setattr__``, which made
building these two records cost several times more than the rest of their handling
(measured: 11 fields, 7 µs frozen against 2 µs plain).
"""

from __future__ import annotations

import pickle
import signal as signals
from collections.abc import Callable
from dataclasses import dataclass

from sandboxq.codec import CodecName
from sandboxq.errors import AttemptFailed
from sandboxq.models import Outcome
from sandboxq.pool.messages import RemoteError

#: How long an attempt ended by a policy (``deadline_s``, the progress watchdog) has from
#: its soft signal to clean up before its tree is killed, when it has no soft and hard
#: timeout of its own to take the gap between them from.
END_GRACE_S = 1.0


@dataclass(slots=True)
class Task:
    """One attempt to run the processor, with its limits already resolved."""

    payload: bytes  # encoded [args, kwargs]
    codec: CodecName
    soft_timeout_s: float | None = None
    hard_timeout_s: float | None = None
    max_memory_mb: float | None = None
    job_id: str | None = None
    attempt: int = 1
    on_progress: Callable[[float, str | None], None] | None = None
    #: ``time.monotonic()`` by which the attempt must end unless ``Pool.extend_fence`` moves
    #: it: a worker's lease that was not renewed in time (self-fencing, design invariant 2).
    fence_deadline: float | None = None
    #: Run with no other attempt of the pool beside it (assign.py): a job suspected of
    #: killing the pool's helpers, whose next kill must be charged to it alone.
    alone: bool = False
    #: ``time.monotonic()`` at which the job's whole budget (``deadline_s``) runs out: the
    #: attempt is then ended as a hard timeout is (soft signal, a grace, a tree kill) with
    #: outcome ``deadline``.
    deadline_at: float | None = None
    #: ``time.monotonic()`` by which the attempt must have started (the job's
    #: ``max_queue_s``, counted from when it became runnable): one still waiting for a
    #: child then ends ``expired``, never run.
    start_by: float | None = None
    #: The watchdog: an attempt silent (no ``progress()``) this long since it started or
    #: last reported is ended the same way, with outcome ``progress_timeout``.
    progress_timeout_s: float | None = None
    #: Between the soft signal of such an end and the tree kill.
    end_grace_s: float = END_GRACE_S
    #: The attempt span's W3C traceparent, passed to the child with ``Run`` (tracing.py).
    trace: str | None = None
    #: Told what the pool does to the running attempt, on the supervisor thread, just
    #: before it is done: (an event name below, detail, child pid or None once dead).
    on_event: Callable[[str, str, int | None], None] | None = None


#: What the pool tells a task's ``on_event`` (deadlines.py): the soft signal, and the kills
#: at the hard deadline, at the lease's fence deadline and over the memory limit.
SOFT_SIGNAL, HARD_KILL, SELF_FENCE, MEMORY_KILL = (
    "soft_signal",
    "hard_kill",
    "self_fence",
    "memory_kill",
)


@dataclass(slots=True)
class AttemptResult:
    task_id: int
    outcome: Outcome
    result: bytes | None = None  # encoded, when the outcome is ok
    pid: int | None = None
    exitcode: int | None = None
    signal: int | None = None
    started_ms: int | None = None
    ended_ms: int | None = None
    runtime_s: float | None = None  # start to outcome, on the monotonic clock
    error: RemoteError | None = None
    #: Why, in words: the whole cause when there is no remote error; beside it, what ended
    #: an attempt that raised at its soft signal (its soft timeout, deadline_s, the watchdog).
    detail: str | None = None
    #: A deadline kill (hard timeout, lease fence): how long after the deadline the child
    #: was reaped (the worker's ``sandboxq_kill_overshoot_seconds``; reason: ``outcome``).
    kill_overshoot_s: float | None = None
    #: A helper of the pool (the fork server) died while this attempt ran, taking it down:
    #: what died and how, in words. The worker counts it against the job: a job present
    #: at ``max_infra_deaths`` such deaths is ``poison`` (design invariant 11).
    infra_death: str | None = None
    #: Where the attempt was: the handler's traceback when it raised, else the Python
    #: stack of every thread captured when it was killed at its hard deadline, at its
    #: soft timeout, or when it crashed (SIGSEGV...); None when there is none. Bounded
    #: (``text.bounded_traceback``).
    traceback: str | None = None
    #: The last 8 KiB the child wrote to its stdout and stderr during this attempt (None:
    #: nothing, or ``capture_output=False``); decoded with errors="replace".
    output: str | None = None
    #: The memory limit it ran under (``Task.max_memory_mb``) and the most its process
    #: tree grew over its start, MB: the control group's high-water mark where there is
    #: one, else the largest sampled tree RSS (None: not measured, no limit was set).
    memory_limit_mb: float | None = None
    peak_memory_mb: float | None = None
    #: A traced (sampled) attempt that answered: the child's peak resident memory during
    #: it, bytes, as the child read it at its end (``tracing.attempt_peak``).
    peak_rss: int | None = None

    @property
    def cause(self) -> str:
        """One line that answers "why did this attempt end like this"."""
        if self.error is not None:
            what = f"{self.error.type_name}: {self.error.message}"
            if self.outcome is Outcome.ERROR:
                return what
            if self.detail:  # what ended it (a deadline, the watchdog), then what it raised
                return f"{self.outcome}: {self.detail} ({what})"
            return f"{self.outcome}: {what}"
        return f"{self.outcome}: {self.detail}" if self.detail else str(self.outcome)

    def to_error(self) -> AttemptFailed:
        err = AttemptFailed(
            self.cause,
            outcome=str(self.outcome),
            pid=self.pid,
            exitcode=self.exitcode,
            signal=self.signal,
            error_type=self.error.type_name if self.error else None,
            remote_traceback=self.traceback or (self.error.traceback if self.error else None),
        )
        if self.error is not None and self.error.pickled is not None:
            try:
                err.__cause__ = pickle.loads(self.error.pickled)
            except Exception:  # the class may exist only in the child
                pass
        return err


def signal_name(signum: int) -> str:
    try:
        return signals.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
