"""The no-op processor of bench_jobs, in a module that turns tracing on where it is imported.

Importing it (the worker parent imports its processor; the fork server preloads it for the
children) sets the OpenTelemetry SDK's tracer provider, with the batch span processor a
production deployment uses and an exporter that only counts the spans. At exit the count
is written to ``$SANDBOXQ_BENCH_SPANS.<pid>`` (when set), so the benchmark can check that
every attempt was recorded. A file per process: the fork server imports this module too,
and its count (none) must not overwrite the worker's when it happens to exit last.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF


class CountingExporter(SpanExporter):
    """Drops every span after counting it: the cost measured is sandboxq's and the SDK's,
    not a collector's."""

    def __init__(self) -> None:
        self.spans = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.spans += len(spans)
        return SpanExportResult.SUCCESS


_exporter = CountingExporter()
# SANDBOXQ_BENCH_SAMPLED=0: a provider that samples nothing, so what is left is sandboxq's
# own work (contexts, attributes on non-recording spans, peak memory), not the SDK's.
_sampled = os.environ.get("SANDBOXQ_BENCH_SAMPLED", "1") != "0"
_provider = TracerProvider(sampler=None if _sampled else ALWAYS_OFF)
_provider.add_span_processor(BatchSpanProcessor(_exporter))
trace.set_tracer_provider(_provider)
_main_pid = os.getpid()


@atexit.register
def _report() -> None:
    if os.getpid() != _main_pid:  # a child: the worker parent reports
        return
    _provider.shutdown()  # flushes the batch processor
    path = os.environ.get("SANDBOXQ_BENCH_SPANS")
    if path:
        with open(f"{path}.{os.getpid()}", "w") as out:
            out.write(str(_exporter.spans))


def noop(x: object = None) -> object:
    return x
