"""OpenTelemetry traces that survive a kill: one span per attempt, kept by the worker.

The worker runs on a thread of this process, whose tracer provider (the SDK's, set once
for the session) exports to an in-memory exporter; the handler (tests/support/traced.py)
runs in a real pool child and writes its own spans to a file, one JSON object per line.
Every attempt ends for real: a handler SIGKILLs itself, hangs past its hard deadline,
raises, runs again; a Redis link stalls until the fence kills; a renewal is rejected
because the test took the lease's token away; a worker stops while its job still runs.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from sandboxq import Queue, aio, tracing
from sandboxq.backends.base import NewJob
from sandboxq.errors import ConfigError, JobFailed
from sandboxq.models import JobState
from sandboxq.testing.redis_server import RedisServer
from sandboxq.testing.waiting import wait_for
from sandboxq.testing.workers import BackgroundWorkers
from tests.support.proxy import TcpProxy

ACT = "tests.support.traced:act"
MB = 1024 * 1024

_exporter = InMemorySpanExporter()


@pytest.fixture
def exported() -> Iterator[InMemorySpanExporter]:
    """The spans this process records, from an SDK provider set once per session (the
    API allows one); emptied for each test."""
    provider = trace.get_tracer_provider()
    if not getattr(provider, "_sandboxq_test", False):
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(_exporter))
        provider._sandboxq_test = True  # type: ignore[attr-defined]
        trace.set_tracer_provider(provider)
    assert getattr(trace.get_tracer_provider(), "_sandboxq_test", False)
    _exporter.clear()
    yield _exporter
    _exporter.clear()


def producers(exp: InMemorySpanExporter, queue: str) -> list[ReadableSpan]:
    return [
        s
        for s in exp.get_finished_spans()
        if s.kind is SpanKind.PRODUCER and s.attributes["messaging.destination.name"] == queue
    ]


def attempts(exp: InMemorySpanExporter, queue: str) -> list[ReadableSpan]:
    return [
        s
        for s in exp.get_finished_spans()
        if s.kind is SpanKind.CONSUMER and s.attributes["messaging.destination.name"] == queue
    ]


def of_job(spans: list[ReadableSpan], job_id: str) -> list[ReadableSpan]:
    found = [s for s in spans if s.attributes["messaging.message.id"] == job_id]
    return sorted(found, key=lambda s: s.attributes["sandboxq.attempt"])


def handler_spans(path: Path) -> list[dict[str, Any]]:
    """The spans the handlers wrote, as (name, trace id, span id, parent span id)."""
    if not path.exists():
        return []
    spans = []
    for line in path.read_text().splitlines():
        raw = json.loads(line)
        spans.append(
            {
                "name": raw["name"],
                "trace_id": int(raw["context"]["trace_id"], 16),
                "span_id": int(raw["context"]["span_id"], 16),
                "parent_id": int(raw["parent_id"], 16) if raw["parent_id"] else None,
                "attempt": raw["attributes"]["test.attempt"],
            }
        )
    return spans


def is_child(child: ReadableSpan, parent: ReadableSpan) -> bool:
    return (
        child.parent is not None
        and child.parent.span_id == parent.context.span_id
        and child.context.trace_id == parent.context.trace_id
    )


def event_names(span: ReadableSpan) -> list[str]:
    return [e.name for e in span.events]


# -- one span per attempt, however it ended ---------------------------------------------------


@pytest.mark.timeout(90)
def test_every_attempt_has_one_span_with_its_outcome_and_the_handlers_spans_below_it(
    redis_url: str, queue_name: str, workers: BackgroundWorkers, tmp_path: Path, exported: Any
) -> None:
    spans_file = str(tmp_path / "handler-spans.jsonl")
    q = Queue(queue_name, url=redis_url)
    once = q.options(retries=0)
    normal = once.enqueue(spans_file, "return")
    killed = once.enqueue(spans_file, "sigkill")
    hung = q.options(retries=0, soft_timeout_s=0.5, hard_timeout_s=1.5).enqueue(spans_file, "hang")
    retried = q.options(retries=1, backoff_s=0).enqueue(spans_file, "fail_first")
    workers.start(q, ACT, concurrency=2)
    assert normal.result(timeout_s=30) == 1
    assert retried.result(timeout_s=30) == 2
    for failed in (killed, hung):
        with pytest.raises(JobFailed):
            failed.result(timeout_s=30)
    q.close()

    sent = {s.attributes["messaging.message.id"]: s for s in producers(exported, queue_name)}
    assert set(sent) == {normal.id, killed.id, hung.id, retried.id}  # one per enqueue
    spans = attempts(exported, queue_name)
    assert len(spans) == 5, [(s.attributes["messaging.message.id"], s.name) for s in spans]
    by_job = {job.id: of_job(spans, job.id) for job in (normal, killed, hung, retried)}
    assert [len(v) for v in by_job.values()] == [1, 1, 1, 2]
    for job_id, own in by_job.items():
        for span in own:  # every attempt continues the trace of its enqueue
            assert is_child(span, sent[job_id]), span.name
            assert span.end_time is not None and span.end_time >= span.start_time

    (ok,) = by_job[normal.id]
    assert ok.attributes["sandboxq.outcome"] == "ok"
    assert ok.attributes["sandboxq.action"] == "complete"
    assert ok.attributes["sandboxq.peak_rss_bytes"] > MB
    assert ok.status.status_code is StatusCode.UNSET

    (sigkilled,) = by_job[killed.id]  # the child died by its own hand: the parent kept it
    assert sigkilled.attributes["sandboxq.outcome"] == "crashed"
    assert sigkilled.attributes["sandboxq.signal"] == 9
    assert sigkilled.attributes["sandboxq.signal.name"] == "SIGKILL"
    assert sigkilled.attributes["sandboxq.action"] == "fail"
    assert sigkilled.status.status_code is StatusCode.ERROR

    (timed_out,) = by_job[hung.id]
    assert timed_out.attributes["sandboxq.outcome"] == "hard_timeout"
    assert event_names(timed_out) == ["sandboxq.soft_signal", "sandboxq.hard_kill"]
    soft, hard = timed_out.events
    assert hard.timestamp - soft.timestamp >= 0.9e9  # 0.5 s, then 1.5 s from the start
    assert timed_out.attributes["sandboxq.peak_rss_bytes"] > MB  # read before the kill

    first, second = by_job[retried.id]
    assert (first.attributes["sandboxq.attempt"], second.attributes["sandboxq.attempt"]) == (1, 2)
    assert first.attributes["sandboxq.outcome"] == "error"
    assert first.attributes["sandboxq.action"] == "retry"
    assert first.attributes["error.type"] == "builtins.ValueError"
    assert second.attributes["sandboxq.outcome"] == "ok"
    tokens = {s.attributes["sandboxq.lease.token"] for s in (first, second)}
    assert len(tokens) == 2  # one lease, one attempt, one span

    # The handler's own spans, recorded in the child, are children of their attempt's span.
    mine = handler_spans(tmp_path / "handler-spans.jsonl")
    assert len(mine) == 5
    for span in spans:
        below = [h for h in mine if h["parent_id"] == span.context.span_id]
        assert len(below) == 1, span.attributes["messaging.message.id"]
        assert below[0]["trace_id"] == span.context.trace_id
        assert below[0]["attempt"] == span.attributes["sandboxq.attempt"]


@pytest.mark.timeout(60)
def test_peak_memory_is_each_attempts_own(
    queue: Queue, workers: BackgroundWorkers, tmp_path: Path, exported: Any
) -> None:
    """One child runs a job that holds 200 MB, then a small one: the second attempt's peak
    is its own, not the child's high-water mark from the first."""
    spans_file = str(tmp_path / "spans.jsonl")
    big = queue.enqueue(spans_file, "grow", mb=200)
    small = queue.enqueue(spans_file, "return")
    workers.start(queue, ACT, concurrency=1)
    assert big.result(timeout_s=30) == 200 * MB
    small.result(timeout_s=30)
    spans = attempts(exported, queue.name)
    (big_span,), (small_span,) = of_job(spans, big.id), of_job(spans, small.id)
    assert big_span.attributes["sandboxq.child.pid"] == small_span.attributes["sandboxq.child.pid"]
    assert big_span.attributes["sandboxq.peak_rss_bytes"] >= 200 * MB
    assert small_span.attributes["sandboxq.peak_rss_bytes"] < 150 * MB


@pytest.mark.timeout(90)
def test_peak_memory_is_each_attempts_own_when_the_next_waits_in_the_channel(
    queue: Queue, workers: BackgroundWorkers, tmp_path: Path, exported: Any
) -> None:
    """While jobs are short, the next task waits in the child's channel and the child goes
    straight on to it, resetting its peak: the big attempt's peak is still its own."""
    spans_file = str(tmp_path / "spans.jsonl")
    shorts = [((spans_file, "return"), {}) for _ in range(300)]  # the pool learns: short jobs
    queue.enqueue_many(shorts)
    big = queue.enqueue(spans_file, "grow", mb=200)
    after = queue.enqueue_many(shorts[:20])
    workers.start(queue, ACT, concurrency=1)
    assert big.result(timeout_s=60) == 200 * MB
    for job in after:
        job.result(timeout_s=60)
    spans = attempts(exported, queue.name)
    (big_span,) = of_job(spans, big.id)
    assert big_span.attributes["sandboxq.peak_rss_bytes"] >= 200 * MB
    (next_span,) = of_job(spans, after[0].id)
    assert next_span.attributes["sandboxq.peak_rss_bytes"] < 150 * MB


@pytest.mark.timeout(60)
def test_an_attempt_killed_over_its_memory_limit_has_its_span(
    containment: str, queue: Queue, workers: BackgroundWorkers, tmp_path: Path, exported: Any
) -> None:
    """The kernel's OOM kill (a control group) or the pool's memory kill (process tree):
    either way the child dies unannounced, and the parent still ends its span."""
    spans_file = tmp_path / "spans.jsonl"
    job = queue.options(retries=0, max_memory_mb=100).enqueue(str(spans_file), "bloat")
    workers.start(queue, ACT, concurrency=1, containment=containment)
    with pytest.raises(JobFailed):
        job.result(timeout_s=30)
    (span,) = of_job(attempts(exported, queue.name), job.id)
    assert span.attributes["sandboxq.outcome"] == "memory_limit"
    assert span.attributes["sandboxq.action"] == "fail"
    assert span.status.status_code is StatusCode.ERROR
    if containment == "process_tree":  # the pool's own kill, told before it struck
        assert event_names(span) == ["sandboxq.memory_kill"]
        assert span.attributes["sandboxq.peak_rss_bytes"] > 100 * MB
    (mine,) = handler_spans(spans_file)
    assert mine["parent_id"] == span.context.span_id


@pytest.mark.timeout(60)
def test_recycled_children_leave_one_span_per_attempt(
    queue: Queue, workers: BackgroundWorkers, tmp_path: Path, exported: Any
) -> None:
    spans_file = tmp_path / "spans.jsonl"
    jobs = [queue.enqueue(str(spans_file), "return") for _ in range(3)]
    workers.start(queue, ACT, concurrency=1, max_jobs_per_child=1)
    for job in jobs:
        assert job.result(timeout_s=30) == 1
    spans = attempts(exported, queue.name)
    assert sorted(s.attributes["messaging.message.id"] for s in spans) == sorted(j.id for j in jobs)
    assert len({s.attributes["sandboxq.child.pid"] for s in spans}) == 3  # a child each
    parents = sorted(h["parent_id"] for h in handler_spans(spans_file))
    assert parents == sorted(s.context.span_id for s in spans)


@pytest.mark.timeout(60)
def test_a_worker_that_stops_ends_the_span_of_the_attempt_it_interrupts(
    queue: Queue, workers: BackgroundWorkers, tmp_path: Path, exported: Any
) -> None:
    spans_file = tmp_path / "spans.jsonl"
    job = queue.enqueue(str(spans_file), "wait", gate=str(tmp_path / "never"))
    worker = workers.start(queue, ACT, concurrency=1)
    wait_for(lambda: handler_spans(spans_file), 30, "the handler to start")
    assert attempts(exported, queue.name) == []  # still running: not ended yet
    workers.stop(worker, now=True)
    (span,) = of_job(attempts(exported, queue.name), job.id)
    assert span.attributes["sandboxq.outcome"] == "interrupted"
    assert span.attributes["sandboxq.action"] == "requeue"
    assert queue.job(job.id).state() is JobState.WAITING


@pytest.mark.timeout(60)
def test_a_cancelled_attempt_says_so_and_a_refused_one_has_its_span_too(
    queue: Queue, workers: BackgroundWorkers, tmp_path: Path, exported: Any
) -> None:
    spans_file = tmp_path / "spans.jsonl"
    running = queue.enqueue(str(spans_file), "wait", gate=str(tmp_path / "never"))
    pickled = NewJob(b"\x80\x04N.", codec="pickle")  # this worker does not take pickle
    ((refused_id, _),) = queue.backend.enqueue([pickled])
    workers.start(queue, ACT, concurrency=1)
    wait_for(lambda: handler_spans(spans_file), 30, "the handler to start")
    assert running.cancel()
    spans = wait_for(
        lambda: (s := attempts(exported, queue.name)) and len(s) == 2 and s, 30, "two spans"
    )
    (cancelled,) = of_job(spans, running.id)
    assert cancelled.attributes["sandboxq.outcome"] == "cancelled"
    assert event_names(cancelled) == ["sandboxq.cancelled"]
    (refused,) = of_job(spans, refused_id)
    assert refused.attributes["sandboxq.outcome"] == "error"
    assert refused.attributes["sandboxq.action"] == "fail"
    assert "pickle" in (refused.status.description or "")


def test_spans_still_open_when_the_worker_stops_are_ended_there(exported: Any) -> None:
    """The stop deadline passed before some attempts' outcomes were handled: their spans
    end anyway, those with an outcome as it said, the others saying why."""
    from sandboxq.backends.base import Claimed
    from sandboxq.models import JobOptions, Outcome
    from sandboxq.observe.tracing import AttemptSpans
    from sandboxq.pool.attempt import AttemptResult

    spans = AttemptSpans.for_worker("stopping", "w1")
    assert spans is not None
    jobs = [Claimed(f"j{i}", f"t.{i}", b"", "json", JobOptions(), 1, 0.0) for i in range(2)]
    for job in jobs:
        spans.start(job)
    spans.ended("t.0", AttemptResult(1, Outcome.INTERRUPTED, detail="the worker stopped"))
    assert spans.end_all("the worker stopped before the attempt was acknowledged") == 2
    assert len(spans) == 0
    ended = {s.attributes["messaging.message.id"]: s for s in attempts(exported, "stopping")}
    assert ended["j0"].attributes["sandboxq.outcome"] == "interrupted"
    assert ended["j1"].attributes["sandboxq.outcome"] == "unknown"
    assert ended["j1"].status.status_code is StatusCode.ERROR
    spans.acked("t.1", "complete")  # a late ack finds nothing: no second span
    assert len(attempts(exported, "stopping")) == 2


# -- the lease: a lost renewal, a self-fence ---------------------------------------------------


@pytest.mark.timeout(60)
def test_a_rejected_renewal_is_an_event_and_the_span_ends_unacked(
    redis_url: str,
    raw: redis.Redis,
    queue_name: str,
    workers: BackgroundWorkers,
    tmp_path: Path,
    exported: Any,
) -> None:
    spans_file = tmp_path / "spans.jsonl"
    q = Queue(queue_name, url=redis_url)
    job = q.enqueue(str(spans_file), "wait", gate=str(tmp_path / "never"))
    workers.start(q, ACT, concurrency=1, lease_s=3.0)
    wait_for(lambda: handler_spans(spans_file), 30, "the handler to start")
    # Another owner took the lease: the next renewal (within a second) is rejected.
    raw.hset(f"sq:{{{queue_name}}}:job:{job.id}", "token", "taken-by-another")
    spans = wait_for(lambda: of_job(attempts(exported, queue_name), job.id), 20, "the span")
    q.close()
    (span,) = spans
    assert span.attributes["sandboxq.outcome"] == "lease_lost"
    assert "sandboxq.action" not in span.attributes  # not ours to ack
    assert event_names(span)[0] == "sandboxq.renewal_lost"


@pytest.mark.timeout(60)
def test_a_link_that_hangs_past_the_lease_fences_the_attempt_and_says_so(
    redis_server: RedisServer,
    queue_name: str,
    workers: BackgroundWorkers,
    tmp_path: Path,
    exported: Any,
) -> None:
    spans_file = tmp_path / "spans.jsonl"
    with TcpProxy("127.0.0.1", redis_server.port) as proxy:
        q = Queue(queue_name, url=redis_server.url)
        job = q.enqueue(str(spans_file), "wait", gate=str(tmp_path / "never"))
        workers.start(
            queue_name, ACT, url=proxy.url, concurrency=1, lease_s=2.0, stop_timeout_s=1.0
        )
        wait_for(lambda: handler_spans(spans_file), 30, "the handler to start")
        proxy.stall()  # renewals hang: the fence kills the child before the lease ends
        (span,) = wait_for(lambda: of_job(attempts(exported, queue_name), job.id), 20, "the span")
        assert span.attributes["sandboxq.outcome"] == "lease_lost"
        assert event_names(span) == ["sandboxq.self_fence"]
        proxy.resume()
        workers.stop_all()
        q.close()


# -- the producer: sync, async, batches; stored context ---------------------------------------


@pytest.mark.timeout(60)
def test_a_batch_is_one_send_span_and_its_members_attempts_are_its_children(
    queue: Queue, workers: BackgroundWorkers, tmp_path: Path, exported: Any
) -> None:
    spans_file = str(tmp_path / "spans.jsonl")
    batch = queue.batch([((spans_file, "return"), {}) for _ in range(3)])
    many = queue.enqueue_many([((spans_file, "return"), {}) for _ in range(2)])
    workers.start(queue, ACT, concurrency=2)
    batch.wait(timeout_s=30)
    for job in many:
        job.result(timeout_s=30)
    sent = producers(exported, queue.name)
    assert len(sent) == 2
    (batch_send,) = [s for s in sent if "sandboxq.batch.id" in s.attributes]
    (many_send,) = [s for s in sent if "sandboxq.batch.id" not in s.attributes]
    assert batch_send.attributes["messaging.batch.message_count"] == 3
    assert batch_send.attributes["sandboxq.batch.id"] == batch.id
    assert many_send.attributes["messaging.batch.message_count"] == 2
    spans = attempts(exported, queue.name)
    assert len(spans) == 5
    assert sum(is_child(s, batch_send) for s in spans) == 3
    assert sum(is_child(s, many_send) for s in spans) == 2


@pytest.mark.timeout(60)
def test_an_async_enqueue_continues_the_callers_trace(
    redis_url: str, queue_name: str, workers: BackgroundWorkers, tmp_path: Path, exported: Any
) -> None:
    spans_file = str(tmp_path / "spans.jsonl")

    async def enqueue() -> tuple[str, list[str], str, Any]:
        with trace.get_tracer("test").start_as_current_span("request") as request:
            async with aio.Queue(queue_name, url=redis_url) as aq:
                job = await aq.enqueue(spans_file, "return")
                many = await aq.enqueue_many([((spans_file, "return"), {})] * 2)
                batch = await aq.batch([((spans_file, "return"), {})] * 2)
        return job.id, [j.id for j in many], batch.id, request

    job_id, many_ids, batch_id, request = asyncio.run(enqueue())
    q = Queue(queue_name, url=redis_url)
    workers.start(q, ACT, concurrency=2)
    q.job(job_id).result(timeout_s=30)
    for member in many_ids:
        q.job(member).result(timeout_s=30)
    q.get_batch(batch_id).wait(timeout_s=30)
    q.close()
    sent = producers(exported, queue_name)
    assert len(sent) == 3  # one per call: enqueue, enqueue_many, batch
    assert all(is_child(send, request) for send in sent)  # the caller's span is their parent
    (one,) = [s for s in sent if s.attributes.get("messaging.message.id") == job_id]
    spans = attempts(exported, queue_name)
    assert len(spans) == 5
    (span,) = of_job(spans, job_id)
    assert is_child(span, one)
    assert all(s.context.trace_id == request.get_span_context().trace_id for s in spans)
    assert sorted(sum(is_child(s, send) for s in spans) for send in sent) == [1, 2, 2]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "forged",
    [
        '"00-zzzzzzzz1916cd43dd8448eb211c80319c-b7ad6b7169203331-01"',  # not hex
        '"00-00000000000000000000000000000000-b7ad6b7169203331-01"',  # zero trace id
        '"01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra"',
        '"' + "0" * 100_000 + '"',
        "12345",
        '{"trace_id": 1}',
    ],
    ids=["not-hex", "zero-trace", "long-version", "huge", "number", "object"],
)
def test_a_forged_stored_traceparent_is_ignored_and_the_job_runs(
    queue: Queue, workers: BackgroundWorkers, tmp_path: Path, exported: Any, forged: str
) -> None:
    spans_file = str(tmp_path / "spans.jsonl")
    payload = json.dumps([[spans_file, "return"], {}]).encode()
    ((job_id, _),) = queue.backend.enqueue(
        [NewJob(payload, options_json=f'{{"traceparent":{forged}}}')]
    )
    workers.start(queue, ACT, concurrency=1)
    assert queue.job(job_id).result(timeout_s=30) == 1
    assert queue.job(job_id).info().options.traceparent is None
    (span,) = attempts(exported, queue.name)
    assert span.parent is None  # a trace of its own, not the forger's
    assert span.attributes["sandboxq.outcome"] == "ok"


@pytest.mark.timeout(60)
def test_a_trace_its_producer_did_not_sample_is_not_recorded_by_the_worker(
    queue: Queue, workers: BackgroundWorkers, tmp_path: Path, exported: Any
) -> None:
    """The sampled flag travels with the context: a job enqueued under an unsampled trace
    (flags 00) runs as usual, and neither its attempt nor its handler records a span."""
    spans_file = tmp_path / "spans.jsonl"
    unsampled = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"
    job = queue.options(traceparent=unsampled).enqueue(str(spans_file), "return")
    workers.start(queue, ACT, concurrency=1)
    assert job.result(timeout_s=30) == 1
    workers.stop_all()
    assert attempts(exported, queue.name) == []
    assert handler_spans(spans_file) == []


def test_a_bad_traceparent_given_to_options_is_refused_by_name(exported: Any) -> None:
    with Queue("tracing-options", url="memory://") as q:
        with pytest.raises(ConfigError, match="traceparent"):
            q.options(traceparent="not-a-trace")
        view = q.options(traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
        job = view.enqueue(1)
        # the user's own context is kept, not replaced by the enqueue span's
        assert job.info().options.traceparent == view._maker.options.traceparent


def test_an_enqueue_under_a_trace_of_the_jobs_own_is_a_span_of_that_trace(
    exported: Any,
) -> None:
    """A job given its own traceparent keeps it; its enqueue's span was a child of the
    caller's current span instead, a trace of its own with no job in it."""
    given = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with Queue("tracing-own", url="memory://") as q:
        q.options(traceparent=given).enqueue(1)
    (span,) = producers(exported, "tracing-own")
    assert span.parent is not None
    assert (span.context.trace_id, span.parent.span_id) == (
        0x0AF7651916CD43DD8448EB211C80319C,
        0xB7AD6B7169203331,
    )


def test_stored_context_is_small(exported: Any) -> None:
    with Queue("tracing-size", url="memory://") as q:
        plain = q._maker.new_job((1,), {}).options_json
        traced = [q._maker.new_job((1,), {})]
        with tracing.enqueue_span(q.name, traced):
            pass
        assert len(traced[0].options_json) - len(plain) <= 75  # "traceparent" and 55 chars


# -- off: nothing recorded, nothing stored ------------------------------------------------------

_OFF = """
import sys
{block}
from sandboxq import Queue, tracing
assert tracing.tracer() is None
with Queue("off", url="memory://") as q:
    job = q.enqueue(1)
    assert job.info().options.traceparent is None, job.info().options
    b = q.batch([((1,), {{}})])
print("untraced")
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "block",
    ["", "sys.modules['opentelemetry'] = None  # not installed"],
    ids=["no-provider", "no-opentelemetry"],
)
def test_without_a_provider_or_without_opentelemetry_nothing_is_traced(block: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _OFF.format(block=block)],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "untraced"
