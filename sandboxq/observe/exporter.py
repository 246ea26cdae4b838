"""Queue gauges from Redis, not from workers: ``sandboxq exporter --url ... --port N``.

    Prometheus ── GET /metrics ──► QueueExporter.collect()
        queues named, or discovered (backends/redis/stats.py; cached DISCOVER_EVERY_S)
        read_stats: two pipelined round trips for all of them ──► gauges

Workers report what they did; only Redis knows what waits. One exporter per Redis is
enough, and a scrape costs a bounded number of commands per queue, never a scan of jobs,
so it can be scraped as often as the autoscaler likes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sandboxq.backends import REDIS_SCHEMES
from sandboxq.errors import ConfigError
from sandboxq.models import JobState, check_queue_name
from sandboxq.observe.metrics import MetricsServer

log = logging.getLogger("sandboxq.exporter")

#: How often the list of queues is refreshed when none were named.
DISCOVER_EVERY_S = 60.0

#: Every series the exporter serves: name, type, labels, help (the README table's source).
EXPORTER_SERIES: tuple[tuple[str, str, str, str], ...] = (
    ("sandboxq_queue_jobs", "gauge", "queue, state",
     "jobs by state: waiting, delayed, active, completed, failed, cancelled (finished "
     "ones as retained)"),
    ("sandboxq_queue_oldest_waiting_age_seconds", "gauge", "queue",
     "age of the job at the head of the waiting line, since it was ready (0: none waits)"),
    ("sandboxq_workers", "gauge", "queue", "live registered workers"),
)  # fmt: skip


def _help(name: str) -> str:
    return next(text for series, _, _, text in EXPORTER_SERIES if series == name)


class QueueExporter(Collector):
    """Serves the gauges of ``queues`` on ``url`` (all queues found there when None)."""

    def __init__(self, url: str, queues: Sequence[str] | None = None) -> None:
        if not url.startswith(REDIS_SCHEMES):
            raise ConfigError(f"the exporter reads Redis: a redis:// URL, got {url!r}")
        from sandboxq.backends.redis.connection import Connections

        self._named = [check_queue_name(q) for q in queues] if queues else None
        self._conns = Connections(url, 5.0, "sq:{sandboxq-exporter}:x")
        self._found: list[str] = []
        self._found_at = -DISCOVER_EVERY_S
        self._lock = threading.Lock()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self._http: MetricsServer | None = None
        self.address: tuple[str, int] | None = None

    def queues(self) -> list[str]:
        if self._named is not None:
            return self._named
        from sandboxq.backends.redis.stats import discover_queues

        with self._lock:
            if time.monotonic() - self._found_at >= DISCOVER_EVERY_S:
                self._found = discover_queues(self._conns)
                self._found_at = time.monotonic()
            return self._found

    def collect(self) -> Iterator[Metric]:
        from sandboxq.backends.redis.stats import read_stats

        stats = read_stats(self._conns, self.queues())
        jobs = GaugeMetricFamily(
            "sandboxq_queue_jobs", _help("sandboxq_queue_jobs"), labels=["queue", "state"]
        )
        oldest = GaugeMetricFamily(
            "sandboxq_queue_oldest_waiting_age_seconds",
            _help("sandboxq_queue_oldest_waiting_age_seconds"),
            labels=["queue"],
        )
        workers = GaugeMetricFamily("sandboxq_workers", _help("sandboxq_workers"), labels=["queue"])
        for s in stats:
            if s.damaged is not None:
                log.warning("queue %r left out of this scrape: %s", s.queue, s.damaged)
                continue
            for state in JobState:
                jobs.add_metric([s.queue, state.value], s.jobs.get(state, 0))
            oldest.add_metric([s.queue], s.oldest_waiting_age_s or 0.0)
            workers.add_metric([s.queue], s.workers)
        yield jobs
        yield oldest
        yield workers

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
