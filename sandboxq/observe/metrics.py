"""A worker's Prometheus metrics, recorded in its parent process only, served when asked.

    dispatcher (main thread) ── attempt_ended / acked, per ack batch ──► counters, histograms
                             ── stale_dropped: an outcome whose lease is no longer held
    scrape (HTTP thread) ── collect() ──► those, the containment mode, and what ``bind``
    gave the worker's parts to read (worker.py ``_bind_metrics``), as snapshots:
        pool.child_states()  children by state, their RSS (pool/kill.py)
        inflight             held jobs
        heartbeat.renewed_at lease renewal age
        stats["rejected_acks"] / reaper.recovered / pool.restarts   counters
        reaper.trims.trimmed   retention's trims, by reason (worker/retention.py)

Children never touch any of this: it lives in the worker's parent and reads the pool's
bookkeeping. Each ``WorkerMetrics`` has its own ``CollectorRegistry``, so several workers
in one process never collide, and nothing is registered in prometheus_client's global one.

Why not prometheus_client's ``Counter`` / ``Histogram``: a label lookup and a lock per
update made the four per-job updates cost about 9 us of CPU (measured, loaded 2-core VM),
some 8 % of the ~105 us the worker's parent spends on a no-op job. Here a job costs a few
list and dict updates, about 1 us (``bench/metrics_bench.py``), and the families are
built at scrape time. A scrape may read a histogram mid-update: its
count is then taken from the buckets it read, so a scrape is always self-consistent.
Per-attempt values are recorded on the dispatcher's main thread only; finished jobs, which
the fetcher thread can also produce (a job that cannot run), under a lock per ack batch.
"""

from __future__ import annotations

import logging
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from sandboxq.models import Outcome
from sandboxq.observe.exposition import TextServer

if TYPE_CHECKING:
    from sandboxq.backends.base import Ack, Claimed
    from sandboxq.pool.attempt import AttemptResult

log = logging.getLogger("sandboxq.metrics")

#: Durations and waits: from a millisecond to four hours.
TIME_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 14400.0,
)  # fmt: skip
#: How late a kill lands: from half a millisecond to ten seconds.
OVERSHOOT_BUCKETS_S: tuple[float, ...] = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip

#: Every series a worker exports: name (as Prometheus shows it), type, labels, help.
#: The README's metric table is checked against this list, and this list against a scrape.
WORKER_SERIES: tuple[tuple[str, str, str, str], ...] = (
    ("sandboxq_attempts_total", "counter", "queue, outcome", "attempts ended, by outcome"),
    ("sandboxq_jobs_finished_total", "counter", "queue, state",
     "jobs this worker finished: completed, failed, cancelled"),
    ("sandboxq_attempt_duration_seconds", "histogram", "queue, outcome",
     "run time of each attempt, start to outcome"),
    ("sandboxq_wait_seconds", "histogram", "queue",
     "from enqueue (or due / retry time) to claim"),
    ("sandboxq_kill_overshoot_seconds", "histogram", "queue, reason",
     "how late each deadline kill landed (hard_timeout, lease_lost, deadline, progress_timeout)"),
    ("sandboxq_children", "gauge", "queue, state", "children by state: busy, idle, starting"),
    ("sandboxq_held_jobs", "gauge", "queue", "jobs this worker holds a lease on"),
    ("sandboxq_lease_renewal_age_seconds", "gauge", "queue",
     "time since the last successful lease renewal (self-fencing comes at lease_s)"),
    ("sandboxq_children_rss_bytes", "gauge", "queue", "resident memory of all children"),
    ("sandboxq_rejected_acks_total", "counter", "queue",
     "acks the backend refused: the lease had been lost, the result was discarded"),
    ("sandboxq_stale_events_dropped_total", "counter", "queue",
     "attempt results for jobs this worker no longer held"),
    ("sandboxq_stalled_recoveries_total", "counter", "queue",
     "expired leases (of any worker) this worker's reaper recovered"),
    ("sandboxq_jobs_trimmed_total", "counter", "queue, reason",
     "finished jobs the queue's retention removed since this worker started: by the "
     "count cap (cap: logged) or past their time to live (age)"),
    ("sandboxq_pool_restarts_total", "counter", "queue",
     "children started to replace others (crashed, killed, recycled)"),
    ("sandboxq_containment_info", "info", "queue, mode", "how children are contained"),
)  # fmt: skip

_FINISHED = {"complete": "completed", "fail": "failed"}


class _Histogram:
    """Bucket counts and a sum, updated by one thread, read by scrapes."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = list(bounds)
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def buckets(self) -> list[tuple[str, float]]:
        counts = list(self.counts)  # one copy: cumulative sums below agree with each other
        out, running = [], 0
        for bound, count in zip([*map(repr, self.bounds), "+Inf"], counts, strict=True):
            running += count
            out.append((bound, float(running)))
        return out


class WorkerMetrics:
    """The metrics of one worker of ``queue``. ``bind`` attaches the running parts whose
    state the gauges read; until then (and after ``unbind``) those gauges are absent."""

    def __init__(self, queue: str, containment: str = "process_tree") -> None:
        self.queue = queue
        self.containment = containment
        self.registry = CollectorRegistry(auto_describe=False)
        self.attempts: dict[str, int] = {}
        #: jobs failed unstarted, by outcome (expired, deadline), counted among the attempts
        self.unstarted: dict[str, int] = {}
        self.finished: dict[str, int] = {}
        self._finished_lock = threading.Lock()
        self.durations: dict[str, _Histogram] = {}
        self.waits = _Histogram(TIME_BUCKETS_S)
        self.overshoots: dict[str, _Histogram] = {}
        self.stale = 0
        self._sources: dict[str, Callable[..., Any]] = {}
        self._http: TextServer | None = None
        #: (host, port) the metrics are served on, once ``serve`` has run.
        self.address: tuple[str, int] | None = None
        self.registry.register(_Collector(self))

    # -- recording (the dispatcher's main thread) -----------------------------------------

    def attempt_ended(self, job: Claimed, attempt: AttemptResult) -> None:
        """One attempt ended (acked or not): its outcome, duration, wait and kill lateness."""
        outcome = attempt.outcome.value
        self.attempts[outcome] = self.attempts.get(outcome, 0) + 1
        if attempt.runtime_s is not None:
            hist = self.durations.get(outcome)
            if hist is None:
                hist = self.durations[outcome] = _Histogram(TIME_BUCKETS_S)
            hist.observe(attempt.runtime_s)
        if job.wait_s is not None:
            self.waits.observe(job.wait_s)
        if attempt.kill_overshoot_s is not None:
            late = self.overshoots.get(outcome)
            if late is None:
                late = self.overshoots[outcome] = _Histogram(OVERSHOOT_BUCKETS_S)
            late.observe(attempt.kill_overshoot_s)
        if attempt.outcome is Outcome.CANCELLED:
            with self._finished_lock:
                self.finished["cancelled"] = self.finished.get("cancelled", 0) + 1

    def acked(self, acks: Iterable[tuple[Claimed, Ack]], accepted: Sequence[bool]) -> None:
        """One ack batch the backend answered: the jobs it finished. (Usually on the main
        thread; the fetcher's thread too when it fails a job that cannot run: a lock per
        batch keeps the two from losing a count.)"""
        with self._finished_lock:
            for (_, ack), ok in zip(acks, accepted, strict=True):
                state = _FINISHED.get(ack.action) if ok else None
                if state is not None:
                    self.finished[state] = self.finished.get(state, 0) + 1

    def not_started(self, outcome: Outcome) -> None:
        """A job this worker claimed and failed without running it, past its deadline_s
        or max_queue_s (``tasks.unstarted``; the fetcher's thread too: under the lock).
        Jobs the backend failed at claim for their own budget never reach a worker: the
        events stream has them (``failed`` with their outcome)."""
        with self._finished_lock:
            self.unstarted[outcome.value] = self.unstarted.get(outcome.value, 0) + 1

    def stale_dropped(self) -> None:
        self.stale += 1

    # -- the running parts the gauges read ------------------------------------------------

    def bind(self, **sources: Callable[..., Any]) -> None:
        """Snapshot functions read at scrape time: ``child_states``, ``held``,
        ``renewed_at`` (monotonic time of the last renewal), ``rejected_acks``,
        ``recovered``, ``trimmed`` (by reason), ``restarts``, ``rss`` (bytes of a list of
        pids)."""
        self._sources = dict(sources)

    def unbind(self) -> None:
        self._sources = {}

    def read(self, name: str) -> Any:
        source = self._sources.get(name)
        return None if source is None else source()

    def read_rss(self, pids: list[int]) -> float:
        rss = self._sources.get("rss")
        return float(rss(pids)) if rss is not None else 0.0

    # -- serving --------------------------------------------------------------------------

    def serve(self, port: int, host: str = "127.0.0.1") -> tuple[str, int]:
        """Serve ``/metrics`` on ``host:port`` (0: a free port) on a daemon thread."""
        # Not prometheus_client's server: a thread per connection, for as long as a client
        # that sends nothing keeps it open, counted against the worker's own process limit.
        registry = self.registry
        self._http = TextServer(lambda: generate_latest(registry), port, host)
        self.address = self._http.address
        return self.address

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None


class _Collector(Collector):
    def __init__(self, metrics: WorkerMetrics) -> None:
        self._m = metrics

    def collect(self) -> Iterator[Metric]:
        m, q = self._m, [self._m.queue]
        attempts = dict(m.attempts)
        for outcome, n in list(m.unstarted.items()):
            attempts[outcome] = attempts.get(outcome, 0) + n
        yield _counter("sandboxq_attempts", ["queue", "outcome"], q, attempts)
        yield _counter("sandboxq_jobs_finished", ["queue", "state"], q, m.finished)
        yield _histograms("sandboxq_attempt_duration_seconds", ["queue", "outcome"], q, m.durations)
        yield _histograms("sandboxq_wait_seconds", ["queue"], q, {"": m.waits})
        yield _histograms("sandboxq_kill_overshoot_seconds", ["queue", "reason"], q, m.overshoots)
        info = InfoMetricFamily("sandboxq_containment", _help("sandboxq_containment_info"))
        info.add_metric(["queue"], {"queue": m.queue, "mode": m.containment})
        yield info
        trimmed = m.read("trimmed")
        if trimmed is not None:
            yield _counter("sandboxq_jobs_trimmed", ["queue", "reason"], q, trimmed)
        counters = {
            "sandboxq_rejected_acks": m.read("rejected_acks"),
            "sandboxq_stale_events_dropped": m.stale,
            "sandboxq_stalled_recoveries": m.read("recovered"),
            "sandboxq_pool_restarts": m.read("restarts"),
        }
        for name, value in counters.items():
            if value is not None:
                yield _counter(name, ["queue"], q, {"": value})
        yield from self._gauges(m, q)

    def _gauges(self, m: WorkerMetrics, q: list[str]) -> Iterator[Metric]:
        states: dict[str, list[int]] | None = m.read("child_states")
        if states is not None:
            children = GaugeMetricFamily(
                "sandboxq_children", _help("sandboxq_children"), labels=["queue", "state"]
            )
            for state in ("busy", "idle", "starting"):
                children.add_metric([*q, state], len(states.get(state, ())))
            yield children
            pids = [pid for group in states.values() for pid in group]
            yield _gauge("sandboxq_children_rss_bytes", q, m.read_rss(pids))
        held = m.read("held")
        if held is not None:
            yield _gauge("sandboxq_held_jobs", q, held)
        renewed_at = m.read("renewed_at")
        if renewed_at is not None:
            age = max(0.0, time.monotonic() - renewed_at)
            yield _gauge("sandboxq_lease_renewal_age_seconds", q, age)


def _help(name: str) -> str:
    return next(text for series, _, _, text in WORKER_SERIES if series == name)


def _counter(
    name: str, labels: list[str], fixed: list[str], values: dict[str, int] | dict[str, Any]
) -> CounterMetricFamily:
    family = CounterMetricFamily(name, _help(name + "_total"), labels=labels)
    for key, value in list(values.items()):
        family.add_metric(fixed + ([key] if key else []), float(value))
    return family


def _gauge(name: str, fixed: list[str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, _help(name), labels=["queue"])
    family.add_metric(fixed, float(value))
    return family


def _histograms(
    name: str, labels: list[str], fixed: list[str], hists: dict[str, _Histogram]
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, _help(name), labels=labels)
    for key, hist in list(hists.items()):
        buckets = hist.buckets()
        family.add_metric(fixed + ([key] if key else []), buckets, sum_value=hist.total)
    return family
