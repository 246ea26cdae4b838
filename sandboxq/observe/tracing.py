"""One OpenTelemetry span per attempt, kept by the worker (the parent), so it is recorded
however the child ended: SIGKILLed, OOM-killed, recycled, or stopped with the worker.

    claim ─► attach(job, task) ── CONSUMER span "process <queue>", a child of the
    (fetcher thread or            producer's context stored with the job (tracing.py);
     main thread)                 its traceparent goes to the child (Task.trace)
    pool (supervisor) ─► pool_event ── span events: soft signal, hard kill, self-fence,
                         memory kill (told just before the kill: the child's peak memory
                         is read while it still lives)
    worker hooks ─► event ── span events: the lease renewal was rejected, cancelled
    pool on_done ─► ended(token, result) ── outcome, exit code or signal, pid, peak memory
    main thread ─► acked(token, action) ── the exit policy's answer; the span ends at the
                   moment the pool reported the attempt's end
    worker exit ─► end_all ── spans whose ack never came (the stop deadline passed)

Spans are found by lease token under one lock: every thread above may touch them, and
each attempt has exactly one span, ended exactly once. ``for_worker`` gives None while
tracing is off, so a worker without a tracer provider pays one ``is None`` per hook.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from opentelemetry.trace import SpanKind, StatusCode

from sandboxq import tracing
from sandboxq.backends.base import Claimed
from sandboxq.models import Outcome
from sandboxq.pool.attempt import AttemptResult, Task, signal_name
from sandboxq.tracing import peak_rss_bytes

#: Span event names, by what the pool or the worker told (pool/attempt.py's names).
EVENT_NAMES = {
    "soft_signal": "sandboxq.soft_signal",
    "hard_kill": "sandboxq.hard_kill",
    "self_fence": "sandboxq.self_fence",
    "memory_kill": "sandboxq.memory_kill",
    "renewal_lost": "sandboxq.renewal_lost",
    "cancelled": "sandboxq.cancelled",
}

#: Outcomes that are not the attempt's failure: their span status stays unset.
_NOT_FAILED = frozenset({Outcome.OK, Outcome.INTERRUPTED})


class _Open:
    """An attempt's span while it is open."""

    __slots__ = ("end_ns", "peak", "peaks", "recording", "span")

    def __init__(self, span: Any) -> None:
        self.span = span
        #: False for a span the sampler left out: nothing is read or set for it.
        self.recording: bool = span.is_recording()
        #: Whether the child resets its peak memory for this attempt (a sampled span's
        #: only: tracing.enter_attempt), so that reading it means the attempt's peak.
        self.peaks = self.recording and span.get_span_context().trace_flags.sampled
        self.end_ns: int | None = None  # the attempt's own end, once its outcome came
        self.peak: int | None = None  # read just before a kill


class AttemptSpans:
    """The open span of every attempt this worker holds, by lease token."""

    def __init__(self, tracer: Any, queue: str, worker_id: str) -> None:
        self._tracer = tracer
        self._queue = queue
        self._worker_id = worker_id
        self._name = f"process {queue}"
        self._open: dict[str, _Open] = {}
        self._lock = threading.Lock()

    @classmethod
    def for_worker(cls, queue: str, worker_id: str) -> AttemptSpans | None:
        """Spans for a worker, or None while tracing is off."""
        tracer = tracing.tracer()
        return None if tracer is None else cls(tracer, queue, worker_id)

    def start(self, job: Claimed) -> str:
        """Open the span of the attempt ``job`` was claimed for; returns its traceparent
        (for the child)."""
        span = self._tracer.start_span(
            self._name,
            context=tracing.context_of(job.options.traceparent),
            kind=SpanKind.CONSUMER,
            attributes={
                "messaging.system": tracing.SYSTEM,
                "messaging.operation.type": "process",
                "messaging.destination.name": self._queue,
                "messaging.message.id": job.id,
                "sandboxq.worker.id": self._worker_id,
                "sandboxq.attempt": job.attempt,
                "sandboxq.lease.token": job.token,
            },
        )
        with self._lock:
            self._open[job.token] = _Open(span)
        return tracing.traceparent_of(span)

    def attach(self, job: Claimed, task: Task) -> None:
        """Open ``job``'s attempt span for ``task``: the child continues it (``Task.trace``)
        and the pool tells it what it does to the attempt (``Task.on_event``)."""
        token = job.token
        task.trace = self.start(job)

        def on_event(name: str, detail: str, pid: int | None) -> None:
            self.pool_event(token, name, detail, pid)

        task.on_event = on_event

    def pool_event(self, token: str, name: str, detail: str, pid: int | None) -> None:
        """The pool is about to act on the attempt (``Task.on_event``)."""
        with self._lock:
            held = self._open.get(token)
        if held is None or not held.recording:
            return
        if held.peaks and pid is not None and name != "soft_signal":  # a kill: the peak
            held.peak = peak_rss_bytes(pid)
        held.span.add_event(EVENT_NAMES.get(name, name), {"sandboxq.detail": detail})

    def event(self, token: str, name: str, detail: str) -> None:
        """Something the worker did to the attempt (the heartbeat, a cancellation)."""
        with self._lock:
            held = self._open.get(token)
        if held is not None and held.recording:
            held.span.add_event(EVENT_NAMES.get(name, name), {"sandboxq.detail": detail})

    def ended(self, token: str, result: AttemptResult) -> None:
        """The attempt's outcome came (pool's on_done, supervisor thread); the peak memory
        is the one the child read as the attempt ended, when it answered."""
        with self._lock:
            held = self._open.get(token)
        if held is None:
            return
        # Now, not result.ended_ms: that is whole milliseconds, which can fall before the
        # span's start for an attempt that ended within the millisecond it was claimed.
        held.end_ns = time.time_ns()
        if not held.recording:
            return
        span = held.span
        attributes: dict[str, Any] = {"sandboxq.outcome": str(result.outcome)}
        if result.pid is not None:
            attributes["sandboxq.child.pid"] = result.pid
        if held.peaks and result.peak_rss is not None:  # it answered: its own reading
            held.peak = result.peak_rss
        if held.peak is not None:
            attributes["sandboxq.peak_rss_bytes"] = held.peak
        if result.exitcode is not None:
            attributes["process.exit.code"] = result.exitcode
        if result.signal is not None:
            attributes["sandboxq.signal"] = result.signal
            attributes["sandboxq.signal.name"] = signal_name(result.signal)
        if result.error is not None:
            attributes["error.type"] = result.error.type_name
        elif result.outcome is not Outcome.OK:
            attributes["error.type"] = str(result.outcome)
        span.set_attributes(attributes)
        if result.outcome not in _NOT_FAILED:
            span.set_status(StatusCode.ERROR, result.cause[:500])

    def acked(self, token: str, action: str | None) -> None:
        """The main thread decided what the outcome means (``action``; None: not acked,
        the lease was lost or the job cancelled): the span ends."""
        with self._lock:
            held = self._open.pop(token, None)
        if held is None:
            return
        if action is not None and held.recording:
            held.span.set_attribute("sandboxq.action", action)
        held.span.end(end_time=held.end_ns)

    def refused(self, job: Claimed, cause: str) -> None:
        """An attempt that could not start on this worker (tasks.refusal): failed at once."""
        self.start(job)
        with self._lock:
            held = self._open.pop(job.token)
        held.span.set_attributes(
            {"sandboxq.outcome": str(Outcome.ERROR), "sandboxq.action": "fail"}
        )
        held.span.set_status(StatusCode.ERROR, cause[:500])
        held.span.end()

    def abandon(self, token: str, why: str) -> None:
        """An attempt the pool never took (it broke): the job went back unstarted."""
        with self._lock:
            held = self._open.pop(token, None)
        if held is not None:
            held.span.set_attribute("sandboxq.outcome", "not_started")
            held.span.set_status(StatusCode.ERROR, why[:500])
            held.span.end()

    def end_all(self, why: str) -> int:
        """End every span still open (the worker stops): those whose outcome came end as
        it said; the others say ``why``. Returns how many there were."""
        with self._lock:
            left, self._open = self._open, {}
        for held in left.values():
            if held.end_ns is None:
                held.span.set_attribute("sandboxq.outcome", "unknown")
                held.span.set_status(StatusCode.ERROR, why)
            held.span.end(end_time=held.end_ns)
        return len(left)

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)
