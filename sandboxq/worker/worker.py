"""SandboxWorker: claims jobs under leases and runs them in the sandboxed pool.

    SandboxWorker.run() ─┬─ Pool (pool/)            the sandboxed children
                         ├─ Dispatcher (dispatch.py) fetcher thread (fetcher.py): claim →
                         │                           pool; main thread: acks → finish + claim
                         ├─ Heartbeat (heartbeat.py) renews leases; a lost one is killed
                         ├─ RegistryRefresh          republishes this worker's WorkerRecord
                         ├─ Reaper (reaper.py)       recovers expired leases (a dead worker's jobs);
                         │                           logs and counts retention's cap trims
                         │                           (retention.py)
                         ├─ cancellation watch       a cancelled job's child is killed
                         └─ WorkerMetrics (observe/metrics.py, only with metrics_port)
                                                     served on its own thread; reads the parts

This module only wires the parts together and owns their lifetime: start, the signals
that stop it (drain.py runs the graceful stop; every part reads it from one StopRequest),
the hooks the heartbeat and the cancellation watch call, and what the worker publishes
about itself for ``sandboxq info``.

Lifetime promises: ``run()`` returns within ``stop_timeout_s`` + 1 s of ``stop()`` and
within 1 s of ``stop(now=True)`` (a second signal), whatever the backend is doing: every
backend call and thread join after that point is given only until that deadline. If a part
of the worker dies (a thread, the pool), the dispatcher's watch stops it, the jobs it held
go back uncharged, and ``run()`` raises ``WorkerFailed`` naming the cause.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sandboxq import tracing
from sandboxq.backends import open_backend
from sandboxq.errors import BackendError, ConfigError, PoolBroken, WorkerFailed
from sandboxq.models import (
    DEFAULT_MAX_INFRA_DEATHS,
    FAILURE_TTL_S,
    RESULT_TTL_S,
    RETAIN_COMPLETED,
    RETAIN_FAILED,
    Outcome,
    WorkerJobRecord,
    WorkerRecord,
    now_ms,
)
from sandboxq.observe.quiet import install as quiet_outage_warnings
from sandboxq.pool.kill import tree_rss
from sandboxq.pool.pool import Pool, Seconds
from sandboxq.processor import resolve_within
from sandboxq.settings import (
    DEFAULT_MAX_PROCESSES,
    ContainmentSetting,
    StartMethod,
    WorkerSettings,
    from_call,
)
from sandboxq.text import guarded_logger
from sandboxq.worker.bounded import run_until
from sandboxq.worker.dispatch import Dispatcher
from sandboxq.worker.drain import DEREGISTER_MIN_S, StopRequest
from sandboxq.worker.events import StopAsked
from sandboxq.worker.heartbeat import Heartbeat, Lease, RegistryRefresh
from sandboxq.worker.inflight import InFlight
from sandboxq.worker.outcomes import WorkerStats
from sandboxq.worker.reaper import Reaper
from sandboxq.worker.retention import TrimWatch

if TYPE_CHECKING:
    from sandboxq.observe.metrics import WorkerMetrics
    from sandboxq.observe.tracing import AttemptSpans

log = guarded_logger("sandboxq.worker")


class SandboxWorker:
    """Runs ``processor`` for jobs of ``queue``; ``run()`` blocks until stopped.

    SIGTERM / SIGINT / SIGHUP (or ``stop()``) drain: stop claiming, keep renewing, let
    running jobs finish; a grace before ``stop_timeout_s`` they get the soft signal, at it
    they are killed; interrupted jobs go back to the queue without being charged an
    attempt, and ``run()`` returns within a second more. A second signal stops at once
    (within a second); ``signals`` lists those received. If a part of the worker dies,
    ``run()`` raises ``WorkerFailed``.

    ``metrics_port`` serves Prometheus metrics (sandboxq/observe/metrics.py) on ``metrics_host``
    (127.0.0.1 by default) while ``run()`` runs; 0 picks a free port, logged and kept in
    ``metrics_address``. Without it nothing is recorded or imported.
    """

    def __init__(
        self,
        queue: str,
        processor: str,
        url: str | None = None,
        concurrency: int | None = None,
        *,
        lease_s: float = 30.0,
        soft_timeout_s: Seconds = None,
        hard_timeout_s: Seconds = None,
        retries: int = 0,
        max_infra_deaths: int = DEFAULT_MAX_INFRA_DEATHS,
        max_memory_mb: float | None = None,
        max_jobs_per_child: int | None = None,
        exit_codes: dict[int, str] | None = None,
        prefetch: int | None = None,
        stop_timeout_s: float = 30.0,
        renew_interval_s: float | None = None,
        stall_check_s: float | None = None,
        start_method: StartMethod = "forkserver",
        allow_pickle: bool = False,
        backend_options: dict[str, Any] | None = None,
        import_timeout_s: float | None = None,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
        containment: ContainmentSetting = "auto",
        max_processes: int | None = DEFAULT_MAX_PROCESSES,
        cpu_time_s: float | None = None,
        max_open_files: int | None = None,
        max_file_size_mb: float | None = None,
        max_address_space_mb: float | None = None,
        core_dumps: bool = False,
        keep_strays: bool = False,
        max_child_growth_mb: float | None = None,
        capture_output: bool = True,
        result_ttl_s: float = RESULT_TTL_S,
        failure_ttl_s: float = FAILURE_TTL_S,
        retain_completed: int = RETAIN_COMPLETED,
        retain_failed: int = RETAIN_FAILED,
        max_queue_s: Seconds = None,
        deadline_s: Seconds = None,
        progress_timeout_s: Seconds = None,
        memory_retry_factor: float | None = None,
        memory_retry_max_mb: float | None = None,
        pool_memory_mb: float | None = None,
        user: str | int | None = None,
        group: str | int | None = None,
        network: bool = True,
        pid_namespace: bool = False,
    ) -> None:
        # Every keyword but backend_options is the setting of that name, with its default.
        self.settings = s = from_call(WorkerSettings, locals())
        # an unimportable processor fails here, with its import error (or after
        # import_timeout_s if its import hangs)
        resolve_within(processor, s.import_timeout_s)
        self.id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        # the queue keeps the jobs this worker finishes as its settings say (README
        # "Retention"); backend_options, where they name the same, win
        self.backend = open_backend(url, queue, **{**s.retention, **(backend_options or {})})
        self.stats = WorkerStats()
        #: The stop signals received while ``run()`` ran, in order (``sandboxq worker``
        #: exits 130 when one was SIGINT: stopped by Ctrl-C).
        self.signals: list[signal.Signals] = []
        #: Set once ``run()`` has its pool up and claims jobs (a start that fails raises
        #: from ``run()`` instead): what a caller that runs it on a thread waits for.
        self.started = threading.Event()
        self._stop = StopRequest(s.stop_timeout_s)
        self._inflight = InFlight(s.concurrency, s.prefetch, self._stop.asked)
        self._pool: Pool | None = None
        self._dispatcher: Dispatcher | None = None
        self._started_ms = now_ms()
        # metrics: only when a port is asked for; otherwise nothing is imported or recorded
        self._metrics: WorkerMetrics | None = None
        self._spans: AttemptSpans | None = None  # tracing, set by run() (observe/tracing.py)
        if s.metrics_port is not None:
            from sandboxq.observe.metrics import WorkerMetrics

            self._metrics = WorkerMetrics(s.queue)
        #: ``(host, port)`` the metrics are served on while ``run()`` runs (port 0: the
        #: port that was picked); None without metrics.
        self.metrics_address: tuple[str, int] | None = None

    def run(self, burst: bool = False) -> None:
        """Work until stopped; with ``burst``, return once nothing is held here and no job
        of the queue is waiting, delayed or active. Raises ``BackendError`` at once if the
        backend cannot be reached when it starts."""
        s = self.settings
        quiet_outage_warnings()  # an outage is one line per cause per 10 s, with a count
        # An unreachable backend fails the start before any child exists, and nothing
        # that failed to start is left running. The handlers first: a SIGTERM while the
        # pool started killed the worker with no word, its registration and control
        # groups left behind; now it drains once started (at once: nothing is held).
        unwatch: Callable[[], None] | None = None
        restore = self._install_signal_handlers()
        try:
            self._serve_metrics()
            self._register(raise_errors=True)
            unwatch = self.backend.watch_cancellations(self._on_cancel)
            log.info("worker %s started on queue %r: %s", self.id, s.queue, s.processor)
            # A stop while the pool starts ends the start: its fork server may be stuck
            # importing the processor (cut off at import_timeout_s, ProcessorError).
            pool = self._pool = Pool.from_settings(s, s.concurrency, self._stop.asked.is_set)
            # Once more with what the pool chose (containment, protections): the next
            # refresh is renew_every_s away, and `sandboxq info` showed them empty till then.
            self._register()
        except BaseException as exc:
            self._disconnect(unwatch)
            restore()
            if isinstance(exc, PoolBroken) and self._stop.asked.is_set():
                log.info("worker %s stopped while its pool started", self.id)
                return
            raise
        heartbeat = self.heartbeat = Heartbeat(
            self.backend,
            self.id,
            s.lease_s,
            s.renew_every_s,
            self._inflight.leases,
            pool.extend_fence,
            self._lease_lost,
        )
        spans = self._spans = attempt_spans(s.queue, self.id)
        registry = RegistryRefresh(s.renew_every_s, self._register)
        self._inflight.on_change = registry.changed
        reaper = Reaper(self.backend, s.stall_every_s, s.max_infra_deaths, TrimWatch(self.backend))
        parts = (heartbeat, registry, reaper)
        dispatcher = self._dispatcher = Dispatcher(
            self.id,
            s,
            self.backend,
            pool,
            self._inflight,
            self.stats,
            self._stop,
            self.stop,
            parts,
            self._metrics,
            spans,
        )
        if self._metrics is not None:
            self._bind_metrics(self._metrics, pool, heartbeat, reaper)
        try:
            for part in parts:
                part.start()
            dispatcher.start_fetcher(burst)
            self.started.set()
            dispatcher.run()
        finally:
            self.stop()
            left = self._stop.time_left
            dispatcher.progress.stop(0)
            if dispatcher.fetcher is not None:
                dispatcher.fetcher.join(left())
            for part in reversed(parts):
                part.stop(left())
            pool.shutdown(cancel=True)
            if spans is not None:  # tracing: attempts whose ack never came end here
                spans.end_all("the worker stopped before the attempt was acknowledged")
            run_until(lambda: self._disconnect(unwatch), left(DEREGISTER_MIN_S))
            restore()
        if dispatcher.failure is not None:
            raise WorkerFailed(f"worker {self.id} stopped: {dispatcher.failure}")

    def stop(self, now: bool = False) -> None:
        """Drain (or with ``now``, interrupt at once); safe from any thread or signal handler."""
        self._stop.ask(now)
        if self._dispatcher is not None:
            self._dispatcher.events.put(StopAsked())
        self._inflight.wake()

    def _install_signal_handlers(self) -> Callable[[], None]:
        """SIGTERM / SIGINT / SIGHUP drain; a second one stops at once. Returns a function
        that puts the previous handlers back. Only the main thread can install handlers.
        SIGHUP is what closing the terminal sends: it ended the worker at once, its
        running jobs cut off with no drain."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def handler(signum: int, frame: object) -> None:
            self.signals.append(signal.Signals(signum))
            log.warning(
                "received %s: %s",
                signal.Signals(signum).name,
                "stopping now" if self._stop.asked.is_set() else "draining",
            )
            self.stop(now=self._stop.asked.is_set())

        drains = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
        old = {sig: signal.signal(sig, handler) for sig in drains}

        def restore() -> None:
            for sig, previous in old.items():
                signal.signal(sig, previous)

        return restore

    # -- metrics (sandboxq/observe/metrics.py) ----------------------------------------------

    def _serve_metrics(self) -> None:
        if self._metrics is None:
            return
        port, host = self.settings.metrics_port or 0, self.settings.metrics_host
        try:
            self.metrics_address = self._metrics.serve(port, host)
        except OSError as exc:
            raise ConfigError(f"cannot serve metrics on {host}:{port}: {exc}") from exc
        log.info("worker %s: metrics on http://%s:%d/metrics", self.id, *self.metrics_address)

    def _bind_metrics(
        self, metrics: WorkerMetrics, pool: Pool, heartbeat: Heartbeat, reaper: Reaper
    ) -> None:
        """What the scrape-time gauges read: snapshots, so a job pays nothing for them."""
        since = time.monotonic()
        metrics.containment = pool.containment
        metrics.bind(
            child_states=pool.child_states,
            held=self._inflight.__len__,
            renewed_at=lambda: heartbeat.renewed_at[-1] if heartbeat.renewed_at else since,
            rejected_acks=lambda: self.stats.rejected_acks,
            recovered=lambda: reaper.recovered,
            trimmed=lambda: reaper.trims.trimmed if reaper.trims is not None else None,
            restarts=lambda: pool.restarts,
            rss=lambda pids: sum(tree_rss(pid)[0] for pid in pids),
        )

    def _close_metrics(self) -> None:
        if self._metrics is not None:
            self._metrics.unbind()
            self._metrics.close()
            self.metrics_address = None

    # -- heartbeat and cancellation hooks (their own threads) ----------------------------------

    def _lease_lost(self, lease: Lease, why: str) -> None:
        assert self._pool is not None
        if self._spans is not None:  # tracing
            self._spans.event(lease.lease_token, "renewal_lost", why)
        self._pool.kill(lease.task_id, Outcome.LEASE_LOST, why)

    def _on_cancel(self, job_id: str, lease_token: str | None) -> None:
        # Only the attempt of the revoked lease: a later lease of the same job, claimed
        # after that attempt ended, is not what the user cancelled.
        held = self._inflight.get(lease_token) if lease_token is not None else None
        if held is not None and self._pool is not None:
            if self._spans is not None:  # tracing
                self._spans.event(held.job.token, "cancelled", "cancelled by a user")
            self._pool.kill(held.lease.task_id, Outcome.CANCELLED, "cancelled by a user")

    def _register(self, raise_errors: bool = False) -> None:
        """Publish this worker and its current jobs (``sandboxq info``); refreshed by the
        heartbeat, gone ``lease_s`` after the last refresh."""
        running = self._pool.running_starts() if self._pool is not None else {}
        now = time.monotonic()
        jobs = []
        for held in self._inflight.snapshot():
            # a job claimed ahead waits for a child: its attempt starts when one takes it
            pid, started_ms = running.get(held.lease.task_id, (None, None))
            jobs.append(
                WorkerJobRecord(
                    id=held.job.id,
                    attempt=held.job.number or held.job.attempt,
                    pid=pid,
                    started_ms=started_ms,
                    rss_mb=round(tree_rss(pid)[0] / 2**20, 1) if pid else None,
                    lease_renewed_s_ago=round(now - held.lease.renewed_at, 3),
                )
            )
        record = WorkerRecord(
            host=socket.gethostname(),
            pid=os.getpid(),
            queue=self.settings.queue,
            concurrency=self.settings.concurrency,
            started_ms=self._started_ms,
            lease_s=self.settings.lease_s,
            registered_ms=now_ms(),  # what lease_renewed_s_ago counts from
            jobs=jobs,
            containment=self._pool.containment if self._pool is not None else None,
            protections=", ".join(self._pool.protections) if self._pool is not None else None,
        )
        try:
            self.backend.register_worker(self.id, record.model_dump(), ttl_s=self.settings.lease_s)
        except BackendError as exc:
            if raise_errors:
                raise
            log.warning("could not register worker: %s", exc)

    def _disconnect(self, unwatch: Callable[[], None] | None) -> None:
        """Let go of the backend: in this order, on one thread, so nothing reads a
        connection once it closes."""
        if unwatch is not None:
            unwatch()
        self._close_metrics()
        self._unregister()
        self.backend.close()

    def _unregister(self) -> None:
        try:
            self.backend.unregister_worker(self.id)
        except BackendError:
            pass


def attempt_spans(queue: str, worker_id: str) -> AttemptSpans | None:
    """A span per attempt while a tracer provider is set (observe/tracing.py); None, and
    nothing of OpenTelemetry imported, otherwise."""
    if tracing.tracer() is None:
        return None
    from sandboxq.observe.tracing import AttemptSpans

    return AttemptSpans.for_worker(queue, worker_id)
