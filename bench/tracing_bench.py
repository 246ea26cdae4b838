"""What tracing costs: no-op worker throughput with OpenTelemetry tracing on and off.

    python bench/tracing_bench.py [--runs N] [--jobs N] [--json OUT] [--url URL] [--quick]

Each run works through the same number of no-op jobs three times, back to back (each
mode first in turn), with real ``sandboxq worker`` processes: "off" runs
``bench_jobs:noop`` (no tracer provider anywhere); "on" runs ``bench_traced:noop``, whose
import sets the SDK's provider with a batch span processor and an exporter that drops
the spans after counting them, in the worker parent and its children; "unsampled" is the
same with a sampler that records nothing, so what is left is sandboxq's own work on each
attempt, not the SDK's recording. Traced jobs each carry a traceparent of their own (as
one enqueue call per job would give them), so every claim parses its own context. The
spans the worker exported are counted, so a run that recorded nothing cannot pass for a
cheap one.

Also, in this process: the CPU per attempt of the worker's span bookkeeping (start,
ended, acked, with the same SDK set-up), the SDK's own CPU for such a span without
sandboxq (the floor under the bookkeeping), and what the hooks cost while tracing is off
(one ``enqueue_span`` with no provider).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import figures  # noqa: E402
from queue_bench import _remaining, backlog_rate, stop, worker  # noqa: E402

from sandboxq import Queue, tracing  # noqa: E402
from sandboxq.backends.base import Claimed, NewJob  # noqa: E402
from sandboxq.codec import encode_call  # noqa: E402
from sandboxq.models import JobOptions, Outcome  # noqa: E402
from sandboxq.pool.attempt import AttemptResult  # noqa: E402
from sandboxq.testing.redis_server import RedisServer  # noqa: E402

SLOWDOWN = figures.Target("<=", 3, "%")
CHUNK = 5000


def new_traceparent() -> str:
    return f"00-{os.urandom(16).hex()}-{os.urandom(8).hex()}-01"


def fill(q: Queue, n: int, traced: bool) -> None:
    """``n`` no-op jobs; traced ones each with a traceparent of their own."""
    for start in range(0, n, CHUNK):
        jobs = []
        for i in range(start, min(n, start + CHUNK)):
            options = f'{{"traceparent":"{new_traceparent()}"}}' if traced else "{}"
            jobs.append(NewJob(encode_call("json", (i,), {}), options_json=options))
        q.backend.enqueue(jobs)


#: What a run's worker has: no provider; the SDK recording every span; the SDK sampling
#: none (what is left is sandboxq's own work on the attempt, not the SDK's recording).
MODES = ("off", "on", "unsampled")


#: The workers' --containment (main's --containment).
CONTAINMENT = ["auto"]


def run_backlog(url: str, n: int, mode: str) -> tuple[float, float, int | None]:
    """Jobs/s working through ``n`` no-op jobs, the worker parent's CPU per job in us, and
    (traced) how many spans the worker exported."""
    traced = mode != "off"
    name = f"tb-{uuid.uuid4().hex[:8]}"
    q = Queue(name, url=url)
    fill(q, n, traced)
    spans_file = Path(tempfile.mkdtemp()) / "spans"
    os.environ["SANDBOXQ_BENCH_SPANS"] = str(spans_file)
    os.environ["SANDBOXQ_BENCH_SAMPLED"] = "0" if mode == "unsampled" else "1"
    processor = "bench_traced:noop" if traced else "bench_jobs:noop"
    w = worker(url, name, processor, "--containment", CONTAINMENT[0])
    try:
        parent = psutil.Process(w.pid)
        cpu: list[Any] = []
        started = threading.Event()

        def sample_start() -> None:  # CPU from the first finished job on, not start-up
            while _remaining(q) >= n:
                time.sleep(0.01)
            cpu.append(parent.cpu_times())
            started.set()

        threading.Thread(target=sample_start, daemon=True).start()
        rate = backlog_rate(q, n)
        started.wait(10)
        cpu1 = parent.cpu_times()
        busy_s = (cpu1.user - cpu[0].user) + (cpu1.system - cpu[0].system)
    finally:
        stop(w)
        q.close()
    # one file per process that imported bench_traced (the worker, its fork server)
    counts = [int(f.read_text()) for f in spans_file.parent.glob(f"{spans_file.name}.*")]
    spans = sum(counts) if counts else None
    return rate, busy_s / n * 1e6, spans


def bookkeeping_us_per_attempt(attempts: int = 20_000) -> float:
    """CPU per attempt of the worker's spans (start, ended, acked) with the SDK's batch
    processor and a dropping exporter, as the "on" runs have them."""
    from bench_traced import CountingExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from sandboxq.observe.tracing import AttemptSpans

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(CountingExporter()))
    spans = AttemptSpans(provider.get_tracer("bench"), "bench", "w1")
    options = JobOptions(traceparent=new_traceparent())
    jobs = [Claimed(f"id{i}", f"tok.{i}", b"", "json", options, 1, 0.0) for i in range(attempts)]
    result = AttemptResult(1, Outcome.OK, result=b"null", runtime_s=0.0008)
    t0 = time.process_time()
    for job in jobs:
        spans.start(job)
        spans.ended(job.token, result)  # pid None: no /proc read
        spans.acked(job.token, "complete")
    took = time.process_time() - t0
    provider.shutdown()
    return took / attempts * 1e6


def sdk_alone_us_per_span(spans_n: int = 20_000, sampled: bool = True) -> float:
    """CPU of the SDK alone for what an attempt's span asks of it, without sandboxq: a
    CONSUMER span started with the same attributes under a producer's context, its
    outcome attributes set, ended; the same provider set-up (``sampled`` False: a sampler
    that records nothing). The floor under the bookkeeping figure: what is left above it
    is sandboxq's own."""
    from bench_traced import CountingExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
    from opentelemetry.trace import SpanKind

    provider = TracerProvider(sampler=None if sampled else ALWAYS_OFF)
    provider.add_span_processor(BatchSpanProcessor(CountingExporter()))
    tracer = provider.get_tracer("bench")
    context = tracing.context_of(new_traceparent())
    t0 = time.process_time()
    for i in range(spans_n):
        span = tracer.start_span(
            "process bench",
            context=context,
            kind=SpanKind.CONSUMER,
            attributes={
                "messaging.system": "sandboxq",
                "messaging.operation.type": "process",
                "messaging.destination.name": "bench",
                "messaging.message.id": f"id{i}",
                "sandboxq.worker.id": "w1",
                "sandboxq.attempt": 1,
                "sandboxq.lease.token": f"tok.{i}",
            },
        )
        span.set_attributes({"sandboxq.outcome": "ok"})
        span.set_attribute("sandboxq.action", "complete")
        span.end()
    took = time.process_time() - t0
    provider.shutdown()
    return took / spans_n * 1e6


def off_hook_ns(calls: int = 200_000) -> float:
    """One producer hook while tracing is off (no provider set in this process)."""
    assert tracing.tracer() is None, "a tracer provider is set: this measures the off path"
    jobs = [NewJob(b"[[], {}]")]
    t0 = time.perf_counter()
    for _ in range(calls):
        with tracing.enqueue_span("bench", jobs) as span:
            span.added(["id"])
    return (time.perf_counter() - t0) / calls * 1e9


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=6, help="a multiple of 3: each order")
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--json", default=str(HERE / "results" / "tracing.json"))
    parser.add_argument("--url", help="an existing redis-server (default: start one)")
    parser.add_argument("--quick", action="store_true", help="fewer jobs: a smoke check")
    parser.add_argument(
        "--containment",
        default="auto",
        choices=["auto", "cgroup", "process_tree"],
        help="the workers' containment (process_tree where other pools share the machine's "
        "control groups)",
    )
    args = parser.parse_args()
    CONTAINMENT[0] = args.containment
    if args.quick:
        args.jobs, args.runs = min(args.jobs, 2000), 3
    rate: dict[str, list[float]] = {mode: [] for mode in MODES}
    cpu: dict[str, list[float]] = {mode: [] for mode in MODES}
    exported: dict[str, list[int | None]] = {mode: [] for mode in MODES}
    hook_off = off_hook_ns()  # before anything in this process could set a provider
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(RedisServer()).url
        for mode in MODES:  # warm-up: imports, fork server, Redis scripts
            run_backlog(url, 2000, mode)
        for i in range(args.runs):
            order = MODES[i % 3 :] + MODES[: i % 3]  # back to back, each first in turn
            for mode in order:
                jobs_s, cpu_us, spans = run_backlog(url, args.jobs, mode)
                rate[mode].append(jobs_s)
                cpu[mode].append(cpu_us)
                exported[mode].append(spans)
            print(
                f"  run {i + 1}/{args.runs}: "
                + "; ".join(
                    f"{m} {rate[m][-1]:,.0f} jobs/s, {cpu[m][-1]:.0f} us CPU/job" for m in MODES
                )
                + f"; spans exported {exported['on'][-1]}"
            )
    if any(count != args.jobs for count in exported["on"]):
        raise SystemExit(f"a traced run did not export one span per job: {exported['on']}")
    if any(count != 0 for count in exported["unsampled"]):
        raise SystemExit(f"an unsampled run exported spans: {exported['unsampled']}")

    def slower(mode: str) -> list[float]:
        return [(a - b) / a * 100 for a, b in zip(rate["off"], rate[mode], strict=True)]

    # A no-op worker is bound by its parent's CPU: the extra CPU per job is the slowdown
    # a quiet machine would show, without the load swings of a shared one.
    def extra_cpu(mode: str) -> list[float]:
        return [(b - a) / a * 100 for a, b in zip(cpu["off"], cpu[mode], strict=True)]

    bookkeeping = [bookkeeping_us_per_attempt() for _ in range(3)]
    sdk_alone = [sdk_alone_us_per_span() for _ in range(3)]
    sdk_unsampled = [sdk_alone_us_per_span(sampled=False) for _ in range(3)]
    figs = [
        figures.figure("no-op throughput, tracing off", rate["off"], "jobs/s", digits=0),
        figures.figure("no-op throughput, tracing on (SDK)", rate["on"], "jobs/s", digits=0),
        figures.figure(
            "no-op throughput, SDK sampling none", rate["unsampled"], "jobs/s", digits=0
        ),
        figures.figure("tracing on: slowdown (per run)", slower("on"), "%", SLOWDOWN),
        figures.figure("sampling none: slowdown (per run)", slower("unsampled"), "%", SLOWDOWN),
        figures.figure("worker parent CPU per job, tracing off", cpu["off"], "us", digits=1),
        figures.figure("worker parent CPU per job, tracing on", cpu["on"], "us", digits=1),
        figures.figure(
            "worker parent CPU per job, sampling none", cpu["unsampled"], "us", digits=1
        ),
        figures.figure("tracing on: extra parent CPU per job", extra_cpu("on"), "%", SLOWDOWN),
        figures.figure("sampling none: extra parent CPU", extra_cpu("unsampled"), "%", SLOWDOWN),
        figures.figure("span bookkeeping per attempt (CPU)", bookkeeping, "us", digits=2),
        figures.figure(
            "the SDK alone, one such span (CPU)",
            sdk_alone,
            "us",
            digits=2,
            note="the floor under the bookkeeping: started, attributes set, ended",
        ),
        figures.figure(
            "the SDK alone, one such span, sampling none (CPU)",
            sdk_unsampled,
            "us",
            digits=2,
            note="what asking the sampler costs; 3 % of a no-op job's parent CPU is ~1.3 us",
        ),
        figures.figure("producer hook with tracing off", [hook_off], "ns", digits=0),
    ]
    for fig in figs:
        print(figures.line(fig))
    figures.write_json(
        args.json, {"jobs": args.jobs, "containment": args.containment, "figures": figs}
    )


if __name__ == "__main__":
    main()
