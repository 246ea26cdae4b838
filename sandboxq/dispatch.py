"""The dispatcher: moves jobs between the backend and the pool, on two threads.

    fetcher thread ── claim(free slots) ──► start: Task(fence = lease) ──► pool
         │ nothing to claim: the claim blocks (no polling) until a job     │ on_done
    main thread ◄─────────────── events queue (done, progress, stop) ──────┘
         └── acks.py (exit policy) ──► finish(acks, claim = freed slots) ──► start the next

The main thread owns every ``finish``: one round trip acks the attempts that ended and
claims into the slots they free. The fetcher only fills slots the finishes left empty, so
an idle worker blocks in the backend and a busy one costs about one round trip per batch
of jobs. ``InFlight`` keeps the two from holding more than the capacity between them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from queue import Empty, SimpleQueue
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from sandboxq.acks import ack_for
from sandboxq.backends.base import Ack, Backend, Claimed
from sandboxq.drain import Drain
from sandboxq.errors import BackendError
from sandboxq.heartbeat import Lease, fence_margin_s
from sandboxq.inflight import Held, InFlight
from sandboxq.models import Action, AttemptRecord, JobState, Outcome, parse_job_options
from sandboxq.outcomes import ExitPolicy
from sandboxq.pool.attempt import AttemptResult, Task
from sandboxq.pool.pool import Pool
from sandboxq.settings import WorkerSettings

if TYPE_CHECKING:
    from sandboxq.metrics import WorkerMetrics

log = logging.getLogger("sandboxq.worker")

#: How long an idle fetcher blocks in one claim (it also rechecks "stop" this often).
IDLE_WAIT_S = 1.0

_STAT = {"complete": "completed", "fail": "failed", "retry": "retried", "requeue": "requeued"}


class Dispatcher:
    def __init__(
        self,
        worker_id: str,
        settings: WorkerSettings,
        backend: Backend,
        pool: Pool,
        inflight: InFlight,
        stats: dict[str, int],
        stopping: threading.Event,
        stop_now: threading.Event,
        stop: Callable[[], None],
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self._id = worker_id
        self._settings = settings
        self._backend = backend
        self._pool = pool
        self._inflight = inflight
        self._stats = stats
        self._stopping = stopping
        self._stop_now = stop_now
        self._stop = stop
        self._metrics = metrics
        self._policy = ExitPolicy(exit_codes=settings.exit_codes)
        self.events: SimpleQueue[tuple[Any, ...]] = SimpleQueue()
        self.fetcher: threading.Thread | None = None

    def start_fetcher(self, burst: bool) -> None:
        self.fetcher = threading.Thread(
            target=self._fetch, args=(burst,), name="sandboxq-fetcher", daemon=True
        )
        self.fetcher.start()

    # -- claiming (fetcher thread) ------------------------------------------------------------

    def _fetch(self, burst: bool) -> None:
        failures = 0
        idle = False  # the last claim found nothing
        while not self._stopping.is_set():
            self._inflight.wait_for_room()
            count = self._inflight.reserve()
            if not count:
                continue
            # After an empty claim, block in the backend until a job arrives. In burst mode
            # a first empty claim returns at once, so the drained check below can end it.
            wait_s = IDLE_WAIT_S if idle or not burst else 0.0
            try:
                claimed = self._backend.claim(self._id, count, self._settings.lease_s, wait_s)
                failures = 0
            except BackendError as exc:
                self._inflight.unreserve(count)
                failures += 1
                log.warning("claim failed (%s); retrying", exc)
                self._stopping.wait(min(2.0, 0.05 * 2**failures))
                continue
            if self._stopping.is_set():
                # A waiting claim can return after stop(): hand those back untouched.
                self._give_back(claimed)
            else:
                for job in claimed:
                    self._start(job)
                # Let the pool's thread, just woken to dispatch these, take the GIL now
                # rather than after this thread's next claim blocks.
                time.sleep(0)
            self._inflight.unreserve(count)
            idle = not claimed
            if idle and burst and self._queue_is_drained():
                self.events.put(("drained",))
                return

    def _queue_is_drained(self) -> bool:
        if len(self._inflight):
            return False
        counts = self._backend.counts()
        # Another worker's active job may still come back here (a retry, a recovery).
        waiting = (JobState.WAITING, JobState.DELAYED, JobState.ACTIVE)
        return not any(counts[state] for state in waiting)

    def _start(self, job: Claimed) -> None:
        """Hand a claimed job to the pool, or fail it at once if it cannot run."""
        s = self._settings
        try:
            options = parse_job_options(job.options_json)
        except ValidationError as exc:
            self._reject(job, f"malformed job options: {exc.errors()[0]['msg']}")
            return
        if job.codec == "pickle" and not s.allow_pickle:
            self._reject(job, "pickle payloads are refused by this worker (allow_pickle=False)")
            return
        if job.codec not in ("json", "pickle"):
            self._reject(job, f"unknown payload codec {job.codec!r}")
            return
        lease = Lease(job.id, job.token, 0, job.claimed_at)
        self._inflight.add(Held(job, options, lease))
        soft = options.soft_timeout_s or s.soft_timeout_s
        hard = options.hard_timeout_s or s.hard_timeout_s
        if soft is not None and hard is not None and soft >= hard:
            soft = None  # a job's own hard timeout below the worker's soft one wins
        job_id, events = job.id, self.events
        task = Task(
            job.payload,
            job.codec,  # type: ignore[arg-type]
            soft_timeout_s=soft,
            hard_timeout_s=hard,
            max_memory_mb=options.max_memory_mb or s.max_memory_mb,
            job_id=job_id,
            attempt=job.attempt,
            on_progress=lambda f, m: events.put(("progress", job_id, f, m)),
            # The lease began no earlier than claimed_at: this falls before it can expire.
            fence_deadline=job.claimed_at + s.lease_s - fence_margin_s(s.lease_s),
        )
        lease.attempt_token = self._pool.execute(task, lambda r: events.put(("done", job_id, r)))

    def _give_back(self, claimed: list[Claimed]) -> None:
        """Release jobs claimed but never started (no attempt charged, nothing recorded)."""
        if not claimed:
            return
        try:
            self._backend.release(self._id, [(job.id, job.token) for job in claimed])
        except BackendError as exc:  # their leases expire and recovery re-queues them
            log.warning("could not hand back %d unstarted job(s): %s", len(claimed), exc)

    def _reject(self, job: Claimed, cause: str) -> None:
        log.error("job %s cannot run: %s", job.id, cause)
        self._stats["malformed"] += 1
        record = AttemptRecord(
            attempt=job.attempt,
            outcome=Outcome.ERROR,
            action=Action.FAIL,
            worker_id=self._id,
            error=cause,
            started_ms=int(time.time() * 1000),
        )
        self._finish([(job, Ack(job.id, job.token, "fail", record, error=cause))], held=False)

    # -- acknowledging (main thread) -------------------------------------------------------------

    def run(self) -> None:
        """Process events until stopped and nothing is held any more."""
        drain: Drain | None = None
        while True:
            try:
                events = [self.events.get(timeout=0.1 if self._stopping.is_set() else None)]
            except Empty:
                events = []
            while True:  # take everything already there: their acks share one round trip
                try:
                    events.append(self.events.get_nowait())
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
                    self._stop()
            if acks:
                self._finish(acks)
            if self._stopping.is_set():
                if drain is None:
                    drain = Drain(
                        self._pool,
                        self._inflight.snapshot,
                        self._settings.stop_timeout_s,
                        self._stop_now,
                    )
                # The fetcher may still be inside a claim: wait for it, so a job it starts
                # in that moment is drained like the others instead of left active.
                fetching = self.fetcher is not None and self.fetcher.is_alive()
                if not len(self._inflight) and not fetching:
                    return
                drain.advance()

    def _ack_for(self, job_id: str, attempt: AttemptResult) -> tuple[Claimed, Ack] | None:
        """What to tell the backend about an attempt that ended (None: nothing)."""
        held = self._inflight.get(job_id)
        if held is None:
            if self._metrics is not None:  # metrics
                self._metrics.stale_dropped()
            return None
        if self._metrics is not None:  # metrics
            self._metrics.attempt_ended(held.job, attempt)
        if attempt.outcome in (Outcome.LEASE_LOST, Outcome.CANCELLED):
            # Not ours to ack any more: the job was cancelled, or another worker may own it.
            stat = "lease_lost" if attempt.outcome is Outcome.LEASE_LOST else "cancelled"
            self._stats[stat] += 1
            log.warning("job %s: %s; not acknowledged", job_id, attempt.cause)
            self._inflight.discard([job_id])
            return None
        if attempt.runtime_s is not None:
            self._inflight.record_runtime(attempt.runtime_s)
        s = self._settings
        return held.job, ack_for(held.job, held.options, attempt, self._policy, s.retries, self._id)

    def _finish(self, acks: list[tuple[Claimed, Ack]], held: bool = True) -> None:
        """Ack jobs and claim into the slots they free, in one round trip (``held``: the
        jobs hold slots, which the claim may refill).

        If the backend is unreachable, keep trying while the leases live (the heartbeat
        keeps renewing them); after that the jobs are recovered elsewhere, at least once.
        """
        refill = self._inflight.reserve(finishing=len(acks) if held else 0)
        lease_s = self._settings.lease_s
        lease_ends = time.monotonic() + lease_s
        delay = 0.05
        try:
            while True:
                try:
                    accepted, claimed = self._backend.finish_many(
                        self._id, [ack for _, ack in acks], claim=refill, lease_s=lease_s
                    )
                    break
                except BackendError as exc:
                    if time.monotonic() + delay > lease_ends or self._stop_now.is_set():
                        log.error("giving up acking %d job(s): %s", len(acks), exc)
                        self._inflight.discard([job.id for job, _ in acks])
                        return
                    time.sleep(delay)
                    delay = min(delay * 2, 1.0)
            self._inflight.discard([job.id for job, _ in acks])
            self._count(acks, accepted)
            if self._metrics is not None:  # metrics, once per ack batch
                self._metrics.acked(acks, accepted)
            for job in claimed:
                self._start(job)
        finally:
            self._inflight.unreserve(refill)

    def _count(self, acks: list[tuple[Claimed, Ack]], accepted: list[bool]) -> None:
        """Stats, and one log line per job outcome.

        The lines of one batch go out as one record: under load a batch holds many jobs,
        and a record per job (format, write, flush) was a third of this thread's time.
        The command line's formatter puts its prefix in front of every line.
        """
        lines: list[str] | None = [] if log.isEnabledFor(logging.INFO) else None
        for (job, ack), ok in zip(acks, accepted, strict=True):
            if not ok:
                self._stats["rejected_acks"] += 1
                log.warning("job %s: ack rejected, the lease was lost; result discarded", job.id)
                continue
            self._stats[_STAT[ack.action]] += 1
            if lines is not None:
                cause = f" ({ack.error})" if ack.error else ""
                outcome = ack.attempt.outcome.value
                lines.append(
                    f"job {job.id} attempt {job.attempt}: {outcome} -> {ack.action}{cause}"
                )
        if lines:
            log.info("%s", "\n".join(lines))

    def _on_progress(self, job_id: str, fraction: float, message: str | None) -> None:
        held = self._inflight.get(job_id)
        if held is not None:
            try:
                self._backend.record_progress(self._id, job_id, held.job.token, fraction, message)
            except BackendError as exc:
                log.warning("could not record progress of job %s: %s", job_id, exc)
