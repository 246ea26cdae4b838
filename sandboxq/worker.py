"""SandboxWorker: claims jobs under leases and runs them in the sandboxed pool.

    SandboxWorker.run() ─┬─ Pool (pool/)            the sandboxed children
                         ├─ Dispatcher (dispatch.py) fetcher thread: claim → pool;
                         │                           main thread: acks → finish + claim
                         ├─ Heartbeat (heartbeat.py) renews leases; a lost one is killed
                         ├─ Reaper (reaper.py)       recovers other workers' expired leases
                         └─ cancellation watch       a cancelled job's child is killed

This module only wires the parts together and owns their lifetime: start, the signals
that stop it (drain.py runs the graceful stop), and what the worker publishes about
itself for ``sandboxq info``.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from sandboxq.backends import open_backend
from sandboxq.dispatch import Dispatcher
from sandboxq.errors import BackendError
from sandboxq.heartbeat import Heartbeat, Lease
from sandboxq.inflight import InFlight
from sandboxq.models import Outcome
from sandboxq.pool.pool import Pool, Seconds
from sandboxq.processor import resolve_within
from sandboxq.reaper import Reaper
from sandboxq.settings import (
    DEFAULT_MAX_PROCESSES,
    ContainmentSetting,
    ContainmentSettings,
    StartMethod,
    WorkerSettings,
    build,
)

log = logging.getLogger("sandboxq.worker")


class SandboxWorker:
    """Runs ``processor`` for jobs of ``queue``; ``run()`` blocks until stopped.

    SIGTERM / SIGINT (or ``stop()``) drain: stop claiming, keep renewing, let running jobs
    finish for up to ``stop_timeout_s``, then soft-signal, then kill; interrupted jobs go
    back to the queue without being charged an attempt. A second signal stops at once.
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
        containment: ContainmentSetting = "auto",
        max_processes: int | None = DEFAULT_MAX_PROCESSES,
        cpu_time_s: float | None = None,
        max_open_files: int | None = None,
        max_file_size_mb: float | None = None,
        max_address_space_mb: float | None = None,
        core_dumps: bool = False,
    ) -> None:
        self.settings = s = build(
            WorkerSettings,
            queue=queue,
            processor=processor,
            url=url,
            # 0 is an error, not "the default": only None means "one child per CPU"
            concurrency=concurrency if concurrency is not None else os.cpu_count() or 1,
            lease_s=lease_s,
            soft_timeout_s=soft_timeout_s,
            hard_timeout_s=hard_timeout_s,
            retries=retries,
            max_memory_mb=max_memory_mb,
            max_jobs_per_child=max_jobs_per_child,
            exit_codes=exit_codes or {},
            prefetch=prefetch,
            stop_timeout_s=stop_timeout_s,
            renew_interval_s=renew_interval_s,
            stall_check_s=stall_check_s,
            start_method=start_method,
            allow_pickle=allow_pickle,
            import_timeout_s=import_timeout_s,
            containment=containment,
            max_processes=max_processes,
            cpu_time_s=cpu_time_s,
            max_open_files=max_open_files,
            max_file_size_mb=max_file_size_mb,
            max_address_space_mb=max_address_space_mb,
            core_dumps=core_dumps,
        )
        # an unimportable processor fails here, with its import error (or after
        # import_timeout_s if its import hangs)
        resolve_within(processor, s.import_timeout_s)
        self.id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.backend = open_backend(url, queue, **(backend_options or {}))
        self.stats: dict[str, int] = dict.fromkeys(
            (
                "completed",
                "failed",
                "retried",
                "requeued",
                "rejected_acks",
                "lease_lost",
                "cancelled",
                "malformed",
            ),
            0,
        )
        self._stopping = threading.Event()
        self._stop_now = threading.Event()
        self._inflight = InFlight(s.concurrency, s.prefetch, self._stopping)
        self._pool: Pool | None = None
        self._dispatcher: Dispatcher | None = None
        self._started_ms = int(time.time() * 1000)

    def run(self, burst: bool = False) -> None:
        """Work until stopped; with ``burst``, return once no job is waiting or delayed and
        nothing is in flight. Raises ``BackendError`` at once if the backend cannot be
        reached when it starts."""
        s = self.settings
        # An unreachable backend fails the start before any child exists, and nothing
        # that failed to start is left running.
        try:
            self._register(raise_errors=True)
            unwatch = self.backend.watch_cancellations(self._on_cancel)
        except BaseException:
            self._unregister()
            self.backend.close()
            raise
        log.info("worker %s started on queue %r: %s", self.id, s.queue, s.processor)
        try:
            pool = self._pool = Pool(
                s.processor,
                s.concurrency,
                max_jobs_per_child=s.max_jobs_per_child,
                start_method=s.start_method,
                import_timeout_s=s.import_timeout_s,
                **s.model_dump(include=set(ContainmentSettings.model_fields)),
            )
        except BaseException:
            unwatch()
            self._unregister()
            self.backend.close()
            raise
        dispatcher = self._dispatcher = Dispatcher(
            self.id,
            s,
            self.backend,
            pool,
            self._inflight,
            self.stats,
            self._stopping,
            self._stop_now,
            self.stop,
        )
        heartbeat = self.heartbeat = Heartbeat(
            self.backend,
            self.id,
            s.lease_s,
            s.renew_every_s,
            self._inflight.leases,
            pool.extend_fence,
            self._lease_lost,
            self._register,
        )
        reaper = Reaper(self.backend, s.stall_every_s)
        restore = self._install_signal_handlers()
        try:
            heartbeat.start()
            reaper.start()
            dispatcher.start_fetcher(burst)
            dispatcher.run()
        finally:
            self.stop()
            if dispatcher.fetcher is not None:
                dispatcher.fetcher.join()
            unwatch()
            reaper.stop()
            heartbeat.stop()
            pool.shutdown(cancel=True)
            self._unregister()
            self.backend.close()
            restore()

    def stop(self, now: bool = False) -> None:
        """Drain (or with ``now``, interrupt at once); safe from any thread or signal handler."""
        if now:
            self._stop_now.set()
        self._stopping.set()
        if self._dispatcher is not None:
            self._dispatcher.events.put(("stop",))
        self._inflight.wake()

    def _install_signal_handlers(self) -> Callable[[], None]:
        """SIGTERM / SIGINT drain; a second one stops at once. Returns a function that puts
        the previous handlers back. Only the main thread can install handlers."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def handler(signum: int, frame: object) -> None:
            log.warning(
                "received %s: %s",
                signal.Signals(signum).name,
                "stopping now" if self._stopping.is_set() else "draining",
            )
            self.stop(now=self._stopping.is_set())

        old = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}

        def restore() -> None:
            for sig, previous in old.items():
                signal.signal(sig, previous)

        return restore

    # -- heartbeat and cancellation hooks (their own threads) ----------------------------------

    def _lease_lost(self, lease: Lease, why: str) -> None:
        assert self._pool is not None
        self._pool.kill(lease.attempt_token, Outcome.LEASE_LOST, why)

    def _on_cancel(self, job_id: str) -> None:
        held = self._inflight.get(job_id)
        if held is not None and self._pool is not None:
            self._pool.kill(held.lease.attempt_token, Outcome.CANCELLED, "cancelled by a user")

    def _register(self, raise_errors: bool = False) -> None:
        """Publish this worker and its current jobs (``sandboxq info``); refreshed by the
        heartbeat, gone ``lease_s`` after the last refresh."""
        pids = self._pool.running_pids() if self._pool is not None else {}
        now = time.monotonic()
        jobs: list[dict[str, Any]] = [
            {
                "id": held.job.id,
                "attempt": held.job.attempt,
                "pid": pids.get(held.lease.attempt_token),
                "lease_renewed_s_ago": round(now - held.lease.renewed_at, 3),
            }
            for held in self._inflight.snapshot()
        ]
        info = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "queue": self.settings.queue,
            "concurrency": self.settings.concurrency,
            "started_ms": self._started_ms,
            "lease_s": self.settings.lease_s,
            "registered_ms": int(time.time() * 1000),  # what lease_renewed_s_ago counts from
            "jobs": jobs,
            "containment": self._pool.containment if self._pool is not None else None,
        }
        try:
            self.backend.register_worker(self.id, info, ttl_s=self.settings.lease_s)
        except BackendError as exc:
            if raise_errors:
                raise
            log.warning("could not register worker: %s", exc)

    def _unregister(self) -> None:
        try:
            self.backend.unregister_worker(self.id)
        except BackendError:
            pass
