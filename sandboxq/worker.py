"""SandboxWorker: claims jobs under leases and runs them in the sandboxed pool.

    fetcher thread ── claim(free slots) ──► start: Task(fence = lease) ──► pool
         │ nothing to claim: wait_for_jobs (blocking, no polling)        │
    heartbeat thread ── renew leases ──► pool.extend_fence / kill lost   │ on_done
    reaper thread ── recover_stalled                                      ▼
    main thread ◄──────────────── events queue (done, progress, stop) ───┘
         └── exit policy ──► finish(action, claim = free slots) ──► start the next

The main thread owns every ``finish``: one round trip acks a job and claims the next. The
fetcher only fills slots the finishes left empty, so an idle worker blocks in Redis and a
busy one costs one round trip per job. Slots are reserved under a lock before any claim,
so the two never claim more than ``concurrency + prefetch`` jobs between them.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import threading
import time
import uuid
from queue import Empty, SimpleQueue
from typing import Any

from pydantic import ValidationError

from sandboxq.backends import open_backend
from sandboxq.backends.base import Ack, Claimed, FinishAction
from sandboxq.errors import BackendError
from sandboxq.heartbeat import Heartbeat, Lease, fence_margin_s
from sandboxq.models import Action, AttemptRecord, JobOptions, JobState, Outcome
from sandboxq.outcomes import ExitPolicy, backoff_s
from sandboxq.pool.attempt import AttemptResult, Task
from sandboxq.pool.pool import Pool, Seconds
from sandboxq.processor import resolve_within
from sandboxq.reaper import Reaper
from sandboxq.settings import StartMethod, WorkerSettings, build

log = logging.getLogger("sandboxq.worker")

#: How long an idle fetcher blocks in one wait (it also rechecks "stop" this often).
IDLE_WAIT_S = 1.0

#: With the default (adaptive) prefetch, claim ahead about this much work per child...
PREFETCH_WORK_S = 0.002
#: ...but never more than this many jobs beyond the children.
MAX_PREFETCH = 64

_STAT = {"complete": "completed", "fail": "failed", "retry": "retried", "requeue": "requeued"}


class _Active:
    """A job this worker owns: the claim, its resolved options, and its lease."""

    __slots__ = ("job", "lease", "options")

    def __init__(self, job: Claimed, options: JobOptions, lease: Lease) -> None:
        self.job = job
        self.options = options
        self.lease = lease


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
        )
        # an unimportable processor fails here, with its import error (or after
        # import_timeout_s if its import hangs)
        resolve_within(processor, s.import_timeout_s)
        self.id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.backend = open_backend(url, queue, **(backend_options or {}))
        self.policy = ExitPolicy(exit_codes=s.exit_codes)
        self._recent_job_s = 1.0  # moving average of attempt run times
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
        self._events: SimpleQueue[tuple[Any, ...]] = SimpleQueue()
        self._active: dict[str, _Active] = {}
        self._slots = threading.Condition()
        self._reserved = 0
        self._stopping = threading.Event()
        self._stop_now = threading.Event()
        self._pool: Pool | None = None
        self._started_ms = int(time.time() * 1000)

    # -- public -----------------------------------------------------------------------------

    def run(self, burst: bool = False) -> None:
        """Work until stopped; with ``burst``, return once no job is waiting or delayed and
        nothing is in flight."""
        s = self.settings
        # An unreachable backend fails the start before any child exists, and nothing
        # that failed to start is left running (run() closes the backend when it returns).
        try:
            unwatch = self.backend.watch_cancellations(self._on_cancel)
        except BaseException:
            self.backend.close()
            raise
        try:
            self._pool = Pool(
                s.processor,
                s.concurrency,
                max_jobs_per_child=s.max_jobs_per_child,
                start_method=s.start_method,
                import_timeout_s=s.import_timeout_s,
            )
        except BaseException:
            unwatch()
            self.backend.close()
            raise
        heartbeat = Heartbeat(
            self.backend,
            self.id,
            s.lease_s,
            s.renew_every_s,
            self._leases,
            self._pool.extend_fence,
            self._lease_lost,
            self._register,
        )
        reaper = Reaper(self.backend, s.stall_every_s)
        fetcher = threading.Thread(
            target=self._fetch, args=(burst,), name="sandboxq-fetcher", daemon=True
        )
        restore = self._install_signal_handlers()
        self.heartbeat = heartbeat
        try:
            self._register()
            heartbeat.start()
            reaper.start()
            fetcher.start()
            self._main_loop()
        finally:
            self.stop()
            fetcher.join()
            unwatch()
            reaper.stop()
            heartbeat.stop()
            self._pool.shutdown(cancel=True)
            self._unregister()
            self.backend.close()
            restore()

    def stop(self, now: bool = False) -> None:
        """Drain (or with ``now``, interrupt at once); safe from any thread or signal handler."""
        if now:
            self._stop_now.set()
        self._stopping.set()
        self._events.put(("stop",))
        with self._slots:
            self._slots.notify_all()

    # -- claiming -----------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Jobs this worker may hold: one per child, plus the prefetch.

        A prefetched job waits here while its lease runs, so for long jobs the prefetch
        stays at one (or what was configured): another worker may be idle. For short jobs
        a claim's round trip outlasts the job, so the adaptive default claims enough to
        cover ``PREFETCH_WORK_S`` of work per child.
        """
        s = self.settings
        if s.prefetch is not None:
            return s.concurrency + s.prefetch
        ahead = math.ceil(s.concurrency * PREFETCH_WORK_S / max(self._recent_job_s, 1e-6))
        return s.concurrency + max(1, min(MAX_PREFETCH, ahead))

    def _reserve(self, finishing: int = 0) -> int:
        """Reserve every free slot (``finishing`` jobs about to be acked count as free)."""
        with self._slots:
            if self._stopping.is_set():
                return 0
            free = max(0, self.capacity - len(self._active) - self._reserved + finishing)
            self._reserved += free
            return free

    def _unreserve(self, count: int) -> None:
        with self._slots:
            self._reserved -= count
            self._slots.notify_all()

    def _fetch(self, burst: bool) -> None:
        failures = 0
        while not self._stopping.is_set():
            with self._slots:
                while not self._stopping.is_set() and (
                    len(self._active) + self._reserved >= self.capacity
                ):
                    self._slots.wait()
            count = self._reserve()
            if not count:
                continue
            started = time.monotonic()
            try:
                claimed = self.backend.claim(self.id, count, self.settings.lease_s)
                failures = 0
            except BackendError as exc:
                self._unreserve(count)
                failures += 1
                log.warning("claim failed (%s); retrying", exc)
                self._stopping.wait(min(2.0, 0.05 * 2**failures))
                continue
            for job in claimed:
                self._start(job, started)
            self._unreserve(count)
            if not claimed:
                if burst and self._queue_is_drained():
                    self._events.put(("drained",))
                    return
                try:
                    self.backend.wait_for_jobs(IDLE_WAIT_S)
                except BackendError as exc:
                    log.warning("waiting for jobs failed: %s", exc)
                    self._stopping.wait(IDLE_WAIT_S)

    def _queue_is_drained(self) -> bool:
        with self._slots:
            if self._active:
                return False
        counts = self.backend.counts()
        return not any(
            counts[state] for state in (JobState.WAITING, JobState.DELAYED, JobState.ACTIVE)
        )

    def _start(self, job: Claimed, claimed_at: float) -> None:
        """Hand a claimed job to the pool, or fail it at once if it cannot run."""
        s = self.settings
        try:
            options = JobOptions.model_validate_json(job.options_json)
        except ValidationError as exc:
            self._reject(job, f"malformed job options: {exc.errors()[0]['msg']}")
            return
        if job.codec == "pickle" and not s.allow_pickle:
            self._reject(job, "pickle payloads are refused by this worker (allow_pickle=False)")
            return
        if job.codec not in ("json", "pickle"):
            self._reject(job, f"unknown payload codec {job.codec!r}")
            return
        fence = claimed_at + s.lease_s - fence_margin_s(s.lease_s)
        lease = Lease(job.id, job.token, 0, claimed_at)
        active = _Active(job, options, lease)
        with self._slots:
            self._active[job.id] = active
        soft = options.soft_timeout_s or s.soft_timeout_s
        hard = options.hard_timeout_s or s.hard_timeout_s
        if soft is not None and hard is not None and soft >= hard:
            soft = None  # a job's own hard timeout below the worker's soft one wins
        task = Task(
            job.payload,
            job.codec,  # type: ignore[arg-type]
            soft_timeout_s=soft,
            hard_timeout_s=hard,
            max_memory_mb=options.max_memory_mb or s.max_memory_mb,
            job_id=job.id,
            attempt=job.attempt,
            on_progress=lambda f, m: self._events.put(("progress", job.id, f, m)),
            fence_deadline=fence,
        )
        assert self._pool is not None
        lease.attempt_token = self._pool.execute(
            task, lambda r: self._events.put(("done", job.id, r))
        )

    def _reject(self, job: Claimed, cause: str) -> None:
        log.error("job %s cannot run: %s", job.id, cause)
        self.stats["malformed"] += 1
        record = AttemptRecord(
            attempt=job.attempt,
            outcome=Outcome.ERROR,
            action=Action.FAIL,
            worker_id=self.id,
            error=cause,
            started_ms=int(time.time() * 1000),
        )
        self._finish([(job, Ack(job.id, job.token, "fail", record, error=cause))], held_slots=False)

    # -- the main thread ------------------------------------------------------------------------

    def _main_loop(self) -> None:
        drain_deadline: float | None = None
        while True:
            try:
                events = [self._events.get(timeout=0.1 if self._stopping.is_set() else None)]
            except Empty:
                events = []
            while True:  # take everything already there: their acks share one round trip
                try:
                    events.append(self._events.get_nowait())
                except Empty:
                    break
            acks = []
            for event in events:
                if event[0] == "done":
                    if (ack := self._ack_for(event[1], event[2])) is not None:
                        acks.append(ack)
                elif event[0] == "progress":
                    self._on_progress(*event[1:])
                elif event[0] == "drained":
                    self.stop()
            if acks:
                self._finish(acks)
            if self._stopping.is_set():
                if drain_deadline is None:
                    drain_deadline = self._begin_drain()
                if not self._active:
                    return
                self._advance_drain(drain_deadline)

    def _ack_for(self, job_id: str, attempt: AttemptResult) -> tuple[Claimed, Ack] | None:
        """What to tell the backend about an attempt that ended (None: nothing)."""
        with self._slots:
            active = self._active.get(job_id)
        if active is None:
            return None
        job, opts = active.job, active.options
        if attempt.outcome in (Outcome.LEASE_LOST, Outcome.CANCELLED):
            # Not ours to ack any more: the job was cancelled, or another worker may own it.
            self.stats["lease_lost" if attempt.outcome is Outcome.LEASE_LOST else "cancelled"] += 1
            log.warning("job %s: %s; not acknowledged", job.id, attempt.cause)
            self._forget(job.id)
            return None
        if attempt.runtime_s is not None:
            self._recent_job_s += (attempt.runtime_s - self._recent_job_s) * 0.2
        error = None if attempt.outcome is Outcome.OK else attempt.cause
        action: FinishAction
        if attempt.outcome is Outcome.INTERRUPTED:
            action, decided, delay = "requeue", None, 0.0
        else:
            retries = opts.retries if opts.retries is not None else self.settings.retries
            decided = self.policy.decide(attempt.outcome, attempt.exitcode, job.attempt, retries)
            action = decided.value
            delay = backoff_s(opts.backoff_s, job.attempt) if decided is Action.RETRY else 0.0
        record = AttemptRecord(
            attempt=job.attempt,
            outcome=attempt.outcome,
            action=decided,
            worker_id=self.id,
            pid=attempt.pid,
            exitcode=attempt.exitcode,
            signal=attempt.signal,
            started_ms=attempt.started_ms,
            ended_ms=attempt.ended_ms,
            error=error,
        )
        result = attempt.result if action == "complete" else None
        return job, Ack(job.id, job.token, action, record, result, error, delay)

    def _finish(self, acks: list[tuple[Claimed, Ack]], held_slots: bool = True) -> None:
        """Ack jobs and claim into the slots they free, in one round trip.

        If the backend is unreachable, keep trying while the leases live (the heartbeat
        keeps renewing them); after that the jobs are recovered elsewhere, at least once.
        """
        refill = self._reserve(finishing=len(acks) if held_slots else 0)
        started = time.monotonic()
        lease_ends = started + self.settings.lease_s
        delay = 0.05
        try:
            while True:
                try:
                    accepted, claimed = self.backend.finish_many(
                        self.id,
                        [ack for _, ack in acks],
                        claim=refill,
                        lease_s=self.settings.lease_s,
                    )
                    break
                except BackendError as exc:
                    if time.monotonic() + delay > lease_ends or self._stop_now.is_set():
                        log.error("giving up acking %d job(s): %s", len(acks), exc)
                        for job, _ in acks:
                            self._forget(job.id)
                        return
                    time.sleep(delay)
                    delay = min(delay * 2, 1.0)
            for (job, ack), ok in zip(acks, accepted, strict=True):
                self._forget(job.id)
                if ok:
                    self.stats[_STAT[ack.action]] += 1
                    if log.isEnabledFor(logging.INFO):
                        log.info(
                            "job %s attempt %d: %s -> %s%s",
                            job.id,
                            job.attempt,
                            ack.attempt.outcome,
                            ack.action,
                            f" ({ack.error})" if ack.error else "",
                        )
                else:
                    self.stats["rejected_acks"] += 1
                    log.warning(
                        "job %s: ack rejected, the lease was lost; result discarded", job.id
                    )
            for job in claimed:
                self._start(job, started)
        finally:
            self._unreserve(refill)

    def _forget(self, job_id: str) -> None:
        with self._slots:
            self._active.pop(job_id, None)
            self._slots.notify_all()

    def _on_progress(self, job_id: str, fraction: float, message: str | None) -> None:
        with self._slots:
            active = self._active.get(job_id)
        if active is not None:
            try:
                self.backend.record_progress(self.id, job_id, active.job.token, fraction, message)
            except BackendError as exc:
                log.warning("could not record progress of job %s: %s", job_id, exc)

    # -- stopping ------------------------------------------------------------------------------

    def _begin_drain(self) -> float:
        assert self._pool is not None
        self._pool.release_unstarted(Outcome.INTERRUPTED, "the worker is stopping")
        if self._stop_now.is_set():
            self._interrupt_all()
        return time.monotonic() + self.settings.stop_timeout_s

    def _advance_drain(self, deadline: float) -> None:
        now = time.monotonic()
        if self._stop_now.is_set():
            self._interrupt_all()
        elif now >= deadline:
            assert self._pool is not None
            for active in self._snapshot():
                self._pool.soft_stop(active.lease.attempt_token)
            if now >= deadline + min(5.0, self.settings.stop_timeout_s / 2 + 0.5):
                self._interrupt_all()

    def _interrupt_all(self) -> None:
        assert self._pool is not None
        for active in self._snapshot():
            self._pool.kill(active.lease.attempt_token, Outcome.INTERRUPTED, "the worker stopped")

    def _install_signal_handlers(self) -> Any:
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
        return lambda: [signal.signal(sig, h) for sig, h in old.items()]

    # -- heartbeat hooks (heartbeat thread) ---------------------------------------------------

    def _snapshot(self) -> list[_Active]:
        with self._slots:
            return list(self._active.values())

    def _leases(self) -> list[Lease]:
        return [a.lease for a in self._snapshot()]

    def _lease_lost(self, lease: Lease, why: str) -> None:
        assert self._pool is not None
        self._pool.kill(lease.attempt_token, Outcome.LEASE_LOST, why)

    def _on_cancel(self, job_id: str) -> None:
        with self._slots:
            active = self._active.get(job_id)
        if active is not None and self._pool is not None:
            self._pool.kill(active.lease.attempt_token, Outcome.CANCELLED, "cancelled by a user")

    def _register(self) -> None:
        pids = self._pool.running_pids() if self._pool else {}
        jobs = [
            {
                "id": a.job.id,
                "attempt": a.job.attempt,
                "pid": pids.get(a.lease.attempt_token),
                "lease_renewed_s_ago": round(time.monotonic() - a.lease.renewed_at, 3),
            }
            for a in self._snapshot()
        ]
        info = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "queue": self.settings.queue,
            "concurrency": self.settings.concurrency,
            "started_ms": self._started_ms,
            "lease_s": self.settings.lease_s,
            "jobs": jobs,
        }
        try:
            self.backend.register_worker(self.id, info, ttl_s=self.settings.lease_s)
        except BackendError as exc:
            log.warning("could not register worker: %s", exc)

    def _unregister(self) -> None:
        try:
            self.backend.unregister_worker(self.id)
        except BackendError:
            pass
