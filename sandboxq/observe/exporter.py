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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sandboxq.backends import REDIS_SCHEMES
from sandboxq.backends.index import QueueIndex
from sandboxq.errors import ConfigError, DamagedRecord, SandboxqError
from sandboxq.models import JobState, check_queue_name
from sandboxq.observe.exposition import TextServer

if TYPE_CHECKING:
    from sandboxq.backends.redis.stats import QueueStats

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


#: The exporter's Redis calls' timeout, seconds (``QueueExporter.__init__`` says why).
SCRAPE_CALL_TIMEOUT_S = 3.0


class QueueExporter(Collector):
    """Serves the gauges of ``queues`` on ``url`` (every queue in the index when None).

    A scrape never fails: with Redis unreachable it answers ``sandboxq_exporter_redis_up
    0`` alone, and the log gets one line when Redis goes away and one when it is back.
    A damaged queue key leaves that queue out, a damaged index every queue (Redis is up
    all the same): one line each when found, and one when repaired."""

    def __init__(self, url: str, queues: Sequence[str] | None = None) -> None:
        if not url.startswith(REDIS_SCHEMES):
            raise ConfigError(f"the exporter reads Redis: a redis:// URL, got {url!r}")
        from sandboxq.backends.redis.connection import Connections

        self._named = [check_queue_name(q) for q in queues] if queues else None
        # A hung Redis costs a call its timeout twice (one retry on a fresh connection):
        # 5 s made a scrape 10 s, Prometheus' default scrape_timeout, and the target read
        # as down instead of as sandboxq_exporter_redis_up 0. 3 s answers in about 6.
        self._conns = Connections(url, SCRAPE_CALL_TIMEOUT_S, "sq:{sandboxq-exporter}:x")
        self._lock = threading.Lock()
        self._up: bool | None = None  # what the last scrape found (None: no scrape yet)
        self._capped: set[str] = set()
        #: What is damaged now (the queue index, a queue's key) and why: logged when it
        #: starts or changes and when it is repaired, not on every scrape.
        self._damaged: dict[str, str] = {}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self._http: TextServer | None = None
        self.address: tuple[str, int] | None = None

    def queues(self) -> tuple[list[str], QueueIndex | None]:
        """The queues to read: those named, or the index's (read on every scrape: a few
        commands, never a scan, so a new queue is exported at the next scrape)."""
        if self._named is not None:
            return self._named, None
        from sandboxq.backends.redis.stats import read_index

        index = read_index(self._conns, prune=False)  # stats.lua checks the same
        if index.capped:
            # More entries than one look reads: names no queue is behind (a flood of them,
            # added by hand) can fill the cap on every scrape and hide the real queues. A
            # pruning look, as the dashboard's, removes those it reads (where the ACL
            # lets it), so the index is clean after a few scrapes.
            index = read_index(self._conns)
        return index.names, index

    def snapshot(self) -> Snapshot:
        """One scrape's numbers: the queues with a queue behind them, Redis up or not,
        the caps hit. Never raises for an unreachable or damaged Redis."""
        from sandboxq.backends.redis.stats import read_stats

        with self._lock:  # one scrape at a time: the state-change log lines stay in order
            damaged: dict[str, str] = {}
            try:
                try:
                    names, index = self.queues()
                except DamagedRecord as exc:  # the server answers: only discovery is lost
                    names, index = [], None
                    damaged["the queue index"] = f"{exc}; no queue is exported"
                stats = read_stats(self._conns, names)
            except SandboxqError as exc:
                self._note_up(False, exc)
                return Snapshot(up=False)
            self._note_up(True, None)
            shown = []
            for s in stats:
                if s.damaged is not None:
                    damaged[f"queue {s.queue!r}"] = f"left out of the scrape: {s.damaged}"
                elif index is None or s.exists:  # an unbacked index entry: no series
                    shown.append(s)
            self._note_damaged(damaged)
            hit = {
                "queues": index is not None and index.capped,
                "workers": any(s.workers_capped for s in shown),
            }
            self._note_capped(hit, index)
        return Snapshot(up=True, stats=shown, capped=hit)

    def collect(self) -> Iterator[Metric]:
        """The families, for ``self.registry`` (a library user's own scrape)."""
        snap = self.snapshot()
        if not snap.up:
            yield _gauge("sandboxq_exporter_redis_up", [], [], 0.0)
            return
        jobs = GaugeMetricFamily(
            "sandboxq_queue_jobs", _help("sandboxq_queue_jobs"), labels=["queue", "state"]
        )
        oldest = GaugeMetricFamily(
            "sandboxq_queue_oldest_waiting_age_seconds",
            _help("sandboxq_queue_oldest_waiting_age_seconds"),
            labels=["queue"],
        )
        workers = GaugeMetricFamily("sandboxq_workers", _help("sandboxq_workers"), labels=["queue"])
        for s in snap.stats:
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
        for what, flag in snap.capped.items():
            capped.add_metric([what], float(flag))
        yield capped

    def exposition(self) -> bytes:
        """The same series as ``collect``, as Prometheus text, written directly: with
        1,000 queues prometheus_client's per-sample formatting was half of a scrape."""
        snap = self.snapshot()
        out = [
            _head("sandboxq_exporter_redis_up"),
            f"sandboxq_exporter_redis_up {float(snap.up)!r}",
        ]
        if snap.up:
            out.append(_head("sandboxq_queue_jobs"))
            for s in snap.stats:
                q = s.queue  # check_queue_name's characters: nothing to escape in a label
                out += [
                    f'sandboxq_queue_jobs{{queue="{q}",state="{state.value}"}} '
                    f"{float(s.jobs.get(state, 0))!r}"
                    for state in JobState
                ]
            out.append(_head("sandboxq_queue_oldest_waiting_age_seconds"))
            out += [
                f'sandboxq_queue_oldest_waiting_age_seconds{{queue="{s.queue}"}} '
                f"{float(s.oldest_waiting_age_s or 0.0)!r}"
                for s in snap.stats
            ]
            out.append(_head("sandboxq_workers"))
            out += [
                f'sandboxq_workers{{queue="{s.queue}"}} {float(s.workers)!r}' for s in snap.stats
            ]
            out.append(_head("sandboxq_exporter_capped"))
            out += [
                f'sandboxq_exporter_capped{{what="{what}"}} {float(flag)!r}'
                for what, flag in snap.capped.items()
            ]
        return ("\n".join(out) + "\n").encode()

    def _note_up(self, up: bool, exc: SandboxqError | None) -> None:
        """One log line per change of reachability, never a traceback."""
        if up == self._up:
            return
        if not up:
            log.warning("Redis unreachable, serving sandboxq_exporter_redis_up 0: %s", exc)
        elif self._up is not None:
            log.warning("Redis reachable again at %s", self._conns.where)
        self._up = up

    def _note_damaged(self, now: dict[str, str]) -> None:
        for what, why in now.items():
            if self._damaged.get(what) != why:
                log.warning("%s is damaged, %s", what, why)
        for what in self._damaged.keys() - now.keys():
            log.warning("%s is readable again (or no longer read)", what)
        self._damaged = now

    def _note_capped(self, hit: dict[str, bool], index: QueueIndex | None) -> None:
        now = {what for what, flag in hit.items() if flag}
        for what in now - self._capped:
            detail = index.note() if what == "queues" and index is not None else ""
            log.warning("read cap hit for %s; %s", what, detail or "some were not read")
        self._capped = now

    def serve(self, port: int, host: str = "127.0.0.1") -> tuple[str, int]:
        self._http = TextServer(self.exposition, port, host)
        self.address = self._http.address
        log.info("queue metrics on http://%s:%d/metrics", *self.address)
        return self.address

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None
        self._conns.close()


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What one scrape read."""

    up: bool
    stats: list[QueueStats] = field(default_factory=list)
    capped: dict[str, bool] = field(default_factory=dict)


def _head(name: str) -> str:
    text = _help(name).replace("\\", "\\\\").replace("\n", "\\n")
    return f"# HELP {name} {text}\n# TYPE {name} gauge"


def _gauge(name: str, labels: list[str], values: list[str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, _help(name), labels=labels)
    family.add_metric(values, value)
    return family
