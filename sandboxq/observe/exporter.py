"""Queue gauges from Redis, not from workers: ``sandboxq exporter --url ... --port N``.

    Prometheus ── GET /metrics ──► QueueExporter.collect()
        queues named, or the queue index's (backends/redis/stats.py read_index: capped,
        only well-formed names, never a SCAN) ──► read_stats: two pipelined round
        trips for all of them ──► gauges, sandboxq_exporter_redis_up, _capped

Workers report what they did; only Redis knows what waits. One exporter per Redis is
enough, and a scrape costs a bounded number of commands per queue, never a scan of jobs,
so it can be scraped as often as the autoscaler likes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sandboxq.backends import REDIS_SCHEMES
from sandboxq.backends.index import QueueIndex
from sandboxq.errors import ConfigError, SandboxqError
from sandboxq.models import JobState, check_queue_name
from sandboxq.observe.metrics import MetricsServer

log = logging.getLogger("sandboxq.exporter")

#: Every series the exporter serves: name, type, labels, help (the README table's source).
EXPORTER_SERIES: tuple[tuple[str, str, str, str], ...] = (
    ("sandboxq_queue_jobs", "gauge", "queue, state",
     "jobs by state: waiting, delayed, active, completed, failed, cancelled (finished "
     "ones as retained)"),
    ("sandboxq_queue_oldest_waiting_age_seconds", "gauge", "queue",
     "age of the job at the head of the waiting line, since it was ready (0: none waits)"),
    ("sandboxq_workers", "gauge", "queue", "live registered workers"),
    ("sandboxq_exporter_redis_up", "gauge", "",
     "1 when this scrape could read Redis, 0 when it could not (the queues' series are "
     "then absent)"),
    ("sandboxq_exporter_capped", "gauge", "what",
     "1 when a read cap was hit this scrape: queues (index entries past the cap were not "
     "read) or workers (a queue has more registered than are read)"),
)  # fmt: skip


def _help(name: str) -> str:
    return next(text for series, _, _, text in EXPORTER_SERIES if series == name)


class QueueExporter(Collector):
    """Serves the gauges of ``queues`` on ``url`` (every queue in the index when None).

    A scrape never fails: with Redis unreachable it answers ``sandboxq_exporter_redis_up
    0`` alone, and the log gets one line when Redis goes away and one when it is back."""

    def __init__(self, url: str, queues: Sequence[str] | None = None) -> None:
        if not url.startswith(REDIS_SCHEMES):
            raise ConfigError(f"the exporter reads Redis: a redis:// URL, got {url!r}")
        from sandboxq.backends.redis.connection import Connections

        self._named = [check_queue_name(q) for q in queues] if queues else None
        self._conns = Connections(url, 5.0, "sq:{sandboxq-exporter}:x")
        self._lock = threading.Lock()
        self._up: bool | None = None  # what the last scrape found (None: no scrape yet)
        self._capped: set[str] = set()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self._http: MetricsServer | None = None
        self.address: tuple[str, int] | None = None

    def queues(self) -> tuple[list[str], QueueIndex | None]:
        """The queues to read: those named, or the index's (read on every scrape: a few
        commands, never a scan, so a new queue is exported at the next scrape)."""
        if self._named is not None:
            return self._named, None
        from sandboxq.backends.redis.stats import read_index

        index = read_index(self._conns)
        return index.names, index

    def collect(self) -> Iterator[Metric]:
        from sandboxq.backends.redis.stats import read_stats

        with self._lock:  # one scrape at a time: the state-change log lines stay in order
            try:
                names, index = self.queues()
                stats = read_stats(self._conns, names)
            except SandboxqError as exc:
                self._note_up(False, exc)
                yield _gauge("sandboxq_exporter_redis_up", [], [], 0.0)
                return
            self._note_up(True, None)
        jobs = GaugeMetricFamily(
            "sandboxq_queue_jobs", _help("sandboxq_queue_jobs"), labels=["queue", "state"]
        )
        oldest = GaugeMetricFamily(
            "sandboxq_queue_oldest_waiting_age_seconds",
            _help("sandboxq_queue_oldest_waiting_age_seconds"),
            labels=["queue"],
        )
        workers = GaugeMetricFamily("sandboxq_workers", _help("sandboxq_workers"), labels=["queue"])
        workers_capped = False
        for s in stats:
            if s.damaged is not None:
                log.warning("queue %r left out of this scrape: %s", s.queue, s.damaged)
                continue
            if index is not None and not s.exists:
                continue  # an index entry no queue stands behind: no series for it
            workers_capped |= s.workers_capped
            for state in JobState:
                jobs.add_metric([s.queue, state.value], s.jobs.get(state, 0))
            oldest.add_metric([s.queue], s.oldest_waiting_age_s or 0.0)
            workers.add_metric([s.queue], s.workers)
        yield jobs
        yield oldest
        yield workers
        yield _gauge("sandboxq_exporter_redis_up", [], [], 1.0)
        capped = GaugeMetricFamily(
            "sandboxq_exporter_capped", _help("sandboxq_exporter_capped"), labels=["what"]
        )
        hit = {"queues": index is not None and index.capped, "workers": workers_capped}
        for what, flag in hit.items():
            capped.add_metric([what], float(flag))
        yield capped
        self._note_capped(hit, index)

    def _note_up(self, up: bool, exc: SandboxqError | None) -> None:
        """One log line per change of reachability, never a traceback."""
        if up == self._up:
            return
        if not up:
            log.warning("Redis unreachable, serving sandboxq_exporter_redis_up 0: %s", exc)
        elif self._up is not None:
            log.warning("Redis reachable again at %s", self._conns.where)
        self._up = up

    def _note_capped(self, hit: dict[str, bool], index: QueueIndex | None) -> None:
        now = {what for what, flag in hit.items() if flag}
        for what in now - self._capped:
            detail = index.note() if what == "queues" and index is not None else ""
            log.warning("read cap hit for %s; %s", what, detail or "some were not read")
        self._capped = now

    def serve(self, port: int, host: str = "127.0.0.1") -> tuple[str, int]:
        self._http = MetricsServer(self.registry, port, host)
        self.address = self._http.address
        log.info("queue metrics on http://%s:%d/metrics", *self.address)
        return self.address

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None
        self._conns.close()


def _gauge(name: str, labels: list[str], values: list[str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, _help(name), labels=labels)
    family.add_metric(values, value)
    return family
