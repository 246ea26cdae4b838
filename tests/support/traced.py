"""A processor that records spans of its own, for the tracing tests (tests/test_tracing.py).

    act(spans_file, how, ...)   opens a span "handler <how>" (and ends it), then ends the
                                attempt as ``how`` says: return, raise, sigkill (SIGKILLs
                                its own process), hang (sleeps: soft then hard timeout),
                                fail_first (raises on attempt 1, returns after), grow (holds
                                ``mb`` MB, then returns), bloat (grows until it is
                                stopped), wait (until ``gate`` exists)

Its spans are exported by the OpenTelemetry SDK as one JSON object per line to
``spans_file``, written when each span ends (SimpleSpanProcessor), so the test process,
which cannot see the child's memory, reads what the handler recorded.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

from sandboxq.pool.child import current_job
from tests.support.gates import _wait_for_file

# One provider per spans file: children of different tests write to different files.
_providers: dict[str, TracerProvider] = {}


def _line(span: ReadableSpan) -> str:
    return span.to_json(indent=None) + "\n"


def _tracer(spans_file: str) -> Any:
    provider = _providers.get(spans_file)
    if provider is None:
        out = open(spans_file, "a", buffering=1)  # noqa: SIM115 - lives as long as the child
        provider = TracerProvider()
        provider.add_span_processor(
            SimpleSpanProcessor(ConsoleSpanExporter(out=out, formatter=_line))
        )
        _providers[spans_file] = provider
    return provider.get_tracer("tests.support.traced")


def _hang() -> None:
    while True:  # the soft timeout raises here; a handler that swallows it is killed
        try:
            time.sleep(60)
        except BaseException:
            continue


def _hold(mb: int) -> bytearray:
    held = bytearray(mb * 1024 * 1024)
    for i in range(0, len(held), 4096):  # touched, so it is resident
        held[i] = 1
    return held


def _bloat() -> None:
    chunks = []
    while True:  # until the memory limit stops it
        chunks.append(_hold(32))
        time.sleep(0.01)


def _fail_first(attempt: int) -> int:
    if attempt == 1:
        raise ValueError("the first attempt fails")
    return attempt


def _raise(attempt: int) -> None:
    raise ValueError(f"raised on attempt {attempt}")


def act(spans_file: str, how: str, mb: int = 0, gate: str | None = None) -> Any:
    """A handler whose own span (ended before it goes on) must be a child of its attempt's."""
    attempt = current_job().attempt
    with _tracer(spans_file).start_as_current_span(f"handler {how}") as span:
        span.set_attribute("test.attempt", attempt)
        span.set_attribute("test.pid", os.getpid())
    ends = {
        "return": lambda: attempt,
        "raise": lambda: _raise(attempt),
        "sigkill": lambda: os.kill(os.getpid(), signal.SIGKILL),
        "hang": _hang,
        "fail_first": lambda: _fail_first(attempt),
        "grow": lambda: len(_hold(mb)),
        "bloat": _bloat,
        "wait": lambda: (_wait_for_file(str(gate)), attempt)[1],
    }
    return ends[how]()
