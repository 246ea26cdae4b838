"""OpenTelemetry tracing where a job's trace begins: the producer's span and the child's context.

    producer ── enqueue_span(queue, jobs) ── PRODUCER span "send <queue>"; each job's options
                get its context: {"traceparent": "00-<trace id>-<span id>-<flags>"}, stored
                with the job (55 characters, checked again when read back: models.py)
    worker   ── observe/tracing.py: one CONSUMER span per attempt, a child of that context,
                opened at claim and closed by the parent; its own traceparent goes to the
                child with the task (Run.trace)
    child    ── enter_attempt(Run.trace) makes it the current context while the processor
                runs, so the handler's own spans are children of the attempt span; at the
                end, attempt_peak reads the attempt's peak memory for the reply

Everything here is a no-op costing one check unless ``opentelemetry-api`` is installed
(the ``otel`` extra) *and* a tracer provider has been set: the API's default provider
records nothing, so neither does sandboxq. Only the API is used; which SDK, exporter and
sampler record the spans is the application's choice, in the producer, the worker and
(for the handler's own spans) the processor module the children import.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any, Protocol

from sandboxq.traceparent import is_traceparent

try:
    from opentelemetry import context as _context
    from opentelemetry import trace as _trace
except ImportError:  # the otel extra is not installed: tracing is off
    _context = _trace = None  # type: ignore[assignment]

#: The OpenTelemetry API's modules, or None without the otel extra.
otel_context: Any = _context
otel_trace: Any = _trace

#: The instrumentation scope every sandboxq span is recorded under.
SCOPE = "sandboxq"
#: ``messaging.system`` of every sandboxq span.
SYSTEM = "sandboxq"

# The provider last seen and the tracer made from it (None: it records nothing).
_seen: tuple[object, Any] = (None, None)
_UNKNOWN = object()
#: The API loads a provider named by this variable at its first get_tracer_provider().
_PROVIDER_FROM_ENV = "OTEL_PYTHON_TRACER_PROVIDER" in os.environ


def tracer() -> Any:
    """The tracer sandboxq records with, or None while tracing is off (no
    ``opentelemetry-api``, or no tracer provider set)."""
    global _seen
    if otel_trace is None:
        return None
    # The API's own global, read first: get_tracer_provider() looks the environment up
    # each time no provider is set, which was most of an untraced enqueue's hook (~1 us).
    if getattr(otel_trace, "_TRACER_PROVIDER", _UNKNOWN) is None and not _PROVIDER_FROM_ENV:
        return None
    provider = otel_trace.get_tracer_provider()
    if provider is _seen[0]:
        return _seen[1]
    made = None
    if not isinstance(provider, otel_trace.ProxyTracerProvider | otel_trace.NoOpTracerProvider):
        made = provider.get_tracer(SCOPE)
    _seen = (provider, made)
    return made


def traceparent_of(span: Any) -> str:
    """The W3C ``traceparent`` of ``span``."""
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def context_of(traceparent: str | None) -> Any:
    """An OpenTelemetry context whose parent is ``traceparent`` (None: none given, tracing
    is off, or it is not a valid traceparent)."""
    if traceparent is None or otel_trace is None or not is_traceparent(traceparent):
        return None
    _version, trace_id, span_id, flags = traceparent.split("-")
    parent = otel_trace.SpanContext(
        int(trace_id, 16),
        int(span_id, 16),
        is_remote=True,
        trace_flags=otel_trace.TraceFlags(int(flags, 16)),
    )
    return otel_trace.set_span_in_context(otel_trace.NonRecordingSpan(parent))


def with_traceparent(options_json: str, traceparent: str) -> str:
    """A job's options JSON (``JobOptions.model_dump_json``) with ``traceparent`` added; one
    that names a traceparent already (a user's own) keeps it."""
    if '"traceparent"' in options_json:
        return options_json
    if options_json == "{}":
        return f'{{"traceparent":"{traceparent}"}}'
    return f'{options_json[:-1]},"traceparent":"{traceparent}"}}'


class _Stamped(Protocol):
    """What a producer's new job (``backends.base.NewJob``) is to the producer's span."""

    options_json: str


class EnqueueSpan:
    """The span of one enqueue call (``with``): stamps its jobs with its context on entry."""

    __slots__ = ("_jobs", "_scope", "_span")

    def __init__(self, scope: Any, jobs: Sequence[_Stamped]) -> None:
        self._scope = scope
        self._jobs = jobs
        self._span: Any = None

    def __enter__(self) -> EnqueueSpan:
        self._span = self._scope.__enter__()
        traceparent = traceparent_of(self._span)
        for job in self._jobs:
            job.options_json = with_traceparent(job.options_json, traceparent)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._scope.__exit__(*exc)

    def added(self, ids: Sequence[str]) -> None:
        """The enqueue answered: name the job when it was one."""
        if len(ids) == 1:
            self._span.set_attribute("messaging.message.id", ids[0])


class _NoSpan:
    """What ``enqueue_span`` gives while tracing is off: does nothing."""

    __slots__ = ()

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def added(self, ids: Sequence[str]) -> None:
        return None


_NO_SPAN = _NoSpan()


def enqueue_span(
    queue: str, jobs: Sequence[_Stamped], batch_id: str | None = None
) -> EnqueueSpan | _NoSpan:
    """A PRODUCER span around enqueueing ``jobs`` (one per call, however many jobs), a
    child of the caller's current span; each job carries its context."""
    traced = tracer()
    if traced is None:
        return _NO_SPAN
    attributes: dict[str, Any] = {
        "messaging.system": SYSTEM,
        "messaging.operation.type": "send",
        "messaging.operation.name": "enqueue",
        "messaging.destination.name": queue,
    }
    if len(jobs) != 1:
        attributes["messaging.batch.message_count"] = len(jobs)
    if batch_id is not None:
        attributes["sandboxq.batch.id"] = batch_id
    # A job given a trace of its own (options(traceparent=...)) keeps it, and its span
    # belongs there: a child of the caller's current span, it began a trace no job was in.
    own = _own_traceparent(jobs[0].options_json) if len(jobs) == 1 else None
    scope = traced.start_as_current_span(
        f"send {queue}",
        context=context_of(own),
        kind=otel_trace.SpanKind.PRODUCER,
        attributes=attributes,
    )
    return EnqueueSpan(scope, jobs)


_OWN_TRACEPARENT = re.compile(r'"traceparent":"([^"]*)"')


def _own_traceparent(options_json: str) -> str | None:
    found = _OWN_TRACEPARENT.search(options_json)
    return found.group(1) if found else None


# -- in the child -----------------------------------------------------------------------------

#: Writing "5" here resets the process's peak resident memory (VmHWM, Linux 4.0+), so the
#: worker's reading after an attempt is that attempt's peak, not the child's lifetime one.
_CLEAR_REFS = "/proc/self/clear_refs"


def enter_attempt(trace: str | None) -> object | None:
    """In the child, before the processor runs: make the attempt span (``trace``, its
    traceparent; None when the attempt is not traced) the current context, and, when it
    is sampled, reset the peak memory the worker reads for it. Returns what
    ``leave_attempt`` takes."""
    if trace is None or otel_context is None:
        return None
    context = context_of(trace)
    if context is None:
        return None
    # The worker reads the peak of sampled spans only (observe/tracing.py); the reset costs
    # 4 us a time through os.open, 13 us through a file object (a no-op attempt's child
    # spends about 40 us in all).
    if int(trace[-2:], 16) & 1:  # the sampled flag (context_of checked the form)
        try:
            fd = os.open(_CLEAR_REFS, os.O_WRONLY)
        except OSError:  # not Linux, or not allowed: the peak counts from the child's start
            pass
        else:
            try:
                os.write(fd, b"5")
            except OSError:
                pass
            finally:
                os.close(fd)
    token: object = otel_context.attach(context)
    return token


def leave_attempt(token: object | None) -> None:
    if token is not None and otel_context is not None:
        otel_context.detach(token)


def attempt_peak(trace: str | None) -> int | None:
    """In the child, as an attempt ends: its peak resident memory in bytes when it is
    traced and sampled (``enter_attempt`` reset the peak as it began), else None. Read
    here, not by the parent after the reply: by then the child may have gone on to the
    next task queued in its channel, which resets the peak."""
    if trace is None or otel_context is None or not is_traceparent(trace):
        return None
    return peak_rss_bytes("self") if int(trace[-2:], 16) & 1 else None


def peak_rss_bytes(pid: int | str) -> int | None:
    """The peak resident memory (VmHWM) of process ``pid`` ("self": this one) in bytes,
    or None when it cannot be read (the process is gone)."""
    # one read of the whole file, not line by line: half the cost (it is a few kB)
    try:
        fd = os.open(f"/proc/{pid}/status", os.O_RDONLY)
    except OSError:
        return None
    try:
        status = os.read(fd, 8192)
        at = status.index(b"VmHWM:") + 6
        return int(status[at : status.index(b"kB", at)]) * 1024
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
