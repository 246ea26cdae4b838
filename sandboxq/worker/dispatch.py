"""The dispatcher: moves jobs between the backend and the pool, on two threads.

    fetcher thread (fetcher.py) ── claim(free slots) ─► start ─► Task (tasks.py) ─► pool
                                                          │ cannot run: failed now    │
    main thread ◄── events (events.py) ◄──────────────────────────────────────────────┘
      ├─ AttemptEnded ─► Ack (outcomes.py) ─► finish(acks, claim = freed slots) ─► start those
      │                                         └─► count_acks (outcomes.py): stats, log lines
      ├─ ProgressReported ─► ProgressWriter (progress.py, a thread of its own)
      ├─ QueueEmpty (burst), StopAsked ─► stopping: Drain (drain.py) until nothing is held
      └─ attempts that ended unacked ─► confirm_dead

The main thread finishes every attempt that ran: one round trip acks the attempts that
ended and claims into the slots they free. The fetcher only fills slots the finishes left
empty, so an idle worker waits in the backend and a busy one costs about one round trip
per batch of jobs. ``InFlight`` keeps the two from holding more than the capacity between
them. A job that cannot run is failed at once by the thread that claimed it.

Attempt identity: every event of an attempt names its *lease token*, and ``InFlight`` is
keyed by it, so an attempt's outcome is applied to its own lease or, if that lease is no
longer held, dropped and counted (``stats.stale_outcomes``), never to a later lease of
the same job. An attempt that ended without an ack (cancelled, lease lost, ack rejected)
is reported with ``confirm_dead``: it lifts the fence that keeps a retried job from
running elsewhere while the old child may live.

The watch: the main thread also checks, every ``WATCH_S``, that the fetcher, the pool and
the worker's other threads (``parts``) still live. When one does not, ``fail`` stops the
worker at once: nothing more is claimed, every running attempt is killed and requeued
uncharged, and ``run()`` ends with ``failure`` naming the cause.
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Callable, Sequence
from queue import Empty, SimpleQueue
from typing import TYPE_CHECKING, TypeVar, assert_never

from sandboxq.backends.base import Ack, Backend, Claimed
from sandboxq.errors import BackendError
from sandboxq.models import Action, Outcome
from sandboxq.pool.attempt import AttemptResult
from sandboxq.pool.pool import Pool
from sandboxq.settings import WorkerSettings
from sandboxq.text import clip, guarded_logger
from sandboxq.worker.bounded import call_until
from sandboxq.worker.drain import Drain, StopRequest
from sandboxq.worker.events import (
    AttemptEnded,
    DispatchEvent,
    FetcherEnded,
    ProgressReported,
    QueueEmpty,
    StopAsked,
)
from sandboxq.worker.fetcher import Fetcher
from sandboxq.worker.heartbeat import Lease
from sandboxq.worker.inflight import Held, InFlight
from sandboxq.worker.memory_retry import retry_memory_mb
from sandboxq.worker.outcomes import (
    ExitPolicy,
    Unacked,
    WorkerStats,
    ack_for,
    count_acks,
    refusal_ack,
    unstarted_ack,
)
from sandboxq.worker.progress import ProgressWriter
from sandboxq.worker.tasks import deadline_at, refusal, task_for, unstarted
from sandboxq.worker.threads import BackgroundThread

if TYPE_CHECKING:
    from sandboxq.observe.metrics import WorkerMetrics
    from sandboxq.observe.tracing import AttemptSpans

log = guarded_logger("sandboxq.worker")

#: How often the main thread checks that every part of the worker still lives.
WATCH_S = 0.25


T = TypeVar("T")


class Dispatcher:
    def __init__(
        self,
        worker_id: str,
        settings: WorkerSettings,
        backend: Backend,
        pool: Pool,
        inflight: InFlight,
        stats: WorkerStats,
        stop: StopRequest,
        request_stop: Callable[[bool], None],
        parts: Sequence[BackgroundThread] = (),
        metrics: WorkerMetrics | None = None,
        spans: AttemptSpans | None = None,
    ) -> None:
        self._id = worker_id
        self._settings = settings
        self._backend = backend
        self._pool = pool
        self._inflight = inflight
        self._stats = stats
        self._stop = stop
        self._request_stop = request_stop  # SandboxWorker.stop(now): also wakes its parts
        self._parts = parts  # the worker's other threads, watched with the fetcher
        self._metrics = metrics
        self._spans = spans  # tracing: one span per attempt (observe/tracing.py), or None
        self._policy = ExitPolicy.of(settings)
        #: What the other threads tell the main thread (events.py); run() reads it.
        self.events: SimpleQueue[DispatchEvent] = SimpleQueue()
        self.fetcher: Fetcher | None = None
        #: Why the worker failed (one line), or None: set once, by ``fail``.
        self.failure: str | None = None
        self._next_watch = 0.0
        # attempts that ended without an ack, for confirm_dead
        self._unacked: list[Unacked] = []
        #: Writes progress on its own thread (stopped by the worker when it stops).
        self.progress = ProgressWriter(backend, worker_id)

    def fail(self, cause: str) -> None:
        """Stop the worker at once because part of it broke; safe from any thread."""
        if self.failure is None:
            self.failure = clip(cause, 300)
            log.error("worker failed: %s; handing its jobs back", self.failure)
        self._request_stop(True)

    def start_fetcher(self, burst: bool) -> None:
        self.fetcher = Fetcher(
            self._id,
            self._settings.lease_s,
            self._backend,
            self._inflight,
            self._stop.asked,
            burst,
            start=self._start,
            give_back=self._give_back,
            report=self.events.put,
            fail=self.fail,
        )
        self.fetcher.start()

    # -- starting (fetcher thread, and the main thread for what a finish claims) -----------

    def _start(self, job: Claimed) -> bool:
        """Hand a claimed job to the pool, or fail it at once if it cannot run. Returns
        whether it took one of the caller's reserved slots (``InFlight.add``)."""
        if self.failure is not None:  # the worker is going down: nothing new starts
            self._give_back([job])
            return False
        if (cause := refusal(job, self._settings.allow_pickle)) is not None:
            self._reject(job, cause)
            return False
        if (late := unstarted(job, self._settings)) is not None:  # the worker's budgets
            if self._metrics is not None:  # metrics
                self._metrics.not_started(late[0])
            self._finish([(job, unstarted_ack(job, *late, self._id))], held=False)
            return False
        token = job.token
        # The attempt's id first, before anything can find the lease and ask for a kill
        # by it (a cancel, a lost lease): the pool keeps such a kill until the attempt
        # comes, and the attempt can start before this thread runs again (a loaded
        # machine).
        lease = Lease(job.id, token, self._pool.new_task_id(), job.claimed_at)
        self._inflight.add(Held(job, lease))
        events = self.events
        spans = self._spans

        def ended(result: AttemptResult) -> None:
            if spans is not None:  # tracing: the outcome, read where the pool reports it
                spans.ended(token, result)
            events.put(AttemptEnded(token, result))

        def progress(fraction: float, message: str | None) -> None:
            events.put(ProgressReported(token, fraction, message))

        task = task_for(
            job, self._settings, progress, retry_memory_mb(self._backend, job, self._settings)
        )
        if spans is not None:  # tracing: the attempt's span opens at claim
            spans.attach(job, task)
        try:
            self._pool.execute(task, ended, task_id=lease.task_id)
        except Exception as exc:  # a broken or closing pool: the job goes back, uncharged
            if spans is not None:  # tracing
                spans.abandon(token, f"the pool cannot run jobs: {exc}")
            self._inflight.discard([token])
            self._give_back([job])
            self.fail(f"the pool cannot run jobs: {exc}")
        return True

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
        if self._spans is not None:  # tracing
            self._spans.refused(job, cause)
        self._stats.malformed += 1
        self._finish([(job, refusal_ack(job, cause, self._id))], held=False)

    # -- acknowledging (main thread) -------------------------------------------------------------

    def run(self) -> None:
        """Process events until stopped and nothing is held any more."""
        drain: Drain | None = None
        while True:
            acks = self._handle(self._next_events())
            if acks:
                self._finish(acks)
            if self._unacked:
                self._confirm_dead()
            self._watch()
            if self._stop.asked.is_set():
                if drain is None:
                    if self.fetcher is not None:
                        self.fetcher.stop_waiting()
                    drain = Drain(
                        self._pool,
                        self._inflight.snapshot,
                        self._settings.stop_timeout_s,
                        self._stop.now,
                    )
                if self._may_return():
                    return
                drain.advance()

    def _next_events(self) -> list[DispatchEvent]:
        """The next event (waiting ``WATCH_S`` at most, so the watch runs on time), and
        every event already there after it: their acks share one round trip."""
        try:
            events = [self.events.get(timeout=0.1 if self._stop.asked.is_set() else WATCH_S)]
        except Empty:
            events = []
        while True:
            try:
                events.append(self.events.get_nowait())
            except Empty:
                return events

    def _handle(self, events: list[DispatchEvent]) -> list[tuple[Claimed, Ack]]:
        """Act on each event; returns the acks of the attempts that ended."""
        acks = []
        for event in events:
            match event:
                case AttemptEnded(token, result):
                    ack = self._ack_for(token, result)
                    if self._spans is not None:  # tracing: the span ends with the action
                        self._spans.acked(token, ack[1].action if ack is not None else None)
                    if ack is not None:
                        acks.append(ack)
                case ProgressReported(token, fraction, message):
                    self._on_progress(token, fraction, message)
                case QueueEmpty():
                    self._request_stop(False)
                case StopAsked() | FetcherEnded():
                    pass  # it only woke this thread: what changed is read in run()
                case _:
                    assert_never(event)
        return acks

    def _may_return(self) -> bool:
        """Once stopping: True when nothing is held and no claim is under way, or when the
        stop deadline has passed."""
        # The fetcher may still be inside a claim: wait for it, so a job it starts in that
        # moment is stopped like the others instead of left active.
        fetching = self.fetcher is not None and self.fetcher.fetching()
        if not len(self._inflight) and not fetching:
            return True
        if time.monotonic() > self._stop.deadline():
            # Redis hangs, or an attempt never ended: stop anyway. What is still held is
            # recovered elsewhere once its lease runs out; a claim still under way gives
            # its jobs back (the fetcher sees the stop).
            if len(self._inflight):
                log.error(
                    "stopping with %d job(s) not acknowledged: the stop deadline passed",
                    len(self._inflight),
                )
            return True
        return False

    def _watch(self) -> None:
        """Fail the worker if one of its parts died (checked every ``WATCH_S``)."""
        now = time.monotonic()
        if now < self._next_watch or self.failure is not None:
            return
        self._next_watch = now + WATCH_S
        if self._pool.broken is not None:
            self.fail(f"the pool broke: {self._pool.broken}")
        elif not self._pool.alive:
            self.fail("the pool's supervisor thread stopped")
        else:
            parts = [*self._parts, *([self.fetcher] if self.fetcher is not None else [])]
            cause = next((c for part in parts if (c := part.dead_thread()) is not None), None)
            if cause is not None:
                self.fail(cause)

    def _confirm_dead(self) -> None:
        """Tell the backend which unacked attempts have ended: lifts their jobs' fences."""
        ended, self._unacked = self._unacked, []
        try:
            self._call(lambda: self._backend.confirm_dead(self._id, ended))
            self._stats.confirmed_dead += len(ended)
        except BackendError as exc:  # their fences lift when the old leases run out
            log.warning("could not confirm %d ended attempt(s): %s", len(ended), exc)

    def _call(self, fn: Callable[[], T]) -> T:
        """``fn()``; once a stop deadline is set, given only until then (a hung Redis
        must not hold the worker past it), raising ``BackendError`` when it runs out."""
        return call_until(fn, self._stop.deadline())

    def _ack_for(self, token: str, attempt: AttemptResult) -> tuple[Claimed, Ack] | None:
        """What to tell the backend about the attempt of lease ``token`` that ended (None:
        nothing)."""
        held = self._inflight.get(token)
        if held is None:
            # That lease is not held any more: its outcome belongs to no current lease.
            self._stats.stale_outcomes += 1
            log.warning("an outcome of a lease no longer held was dropped: %s", attempt.cause)
            if self._metrics is not None:  # metrics
                self._metrics.stale_dropped()
            return None
        job = held.job
        if self._metrics is not None:  # metrics
            self._metrics.attempt_ended(job, attempt)
        if attempt.outcome in (Outcome.LEASE_LOST, Outcome.CANCELLED):
            # Not ours to ack any more: the job was cancelled, or another worker may own it.
            stat = "lease_lost" if attempt.outcome is Outcome.LEASE_LOST else "cancelled"
            self._stats.count(stat)
            log.warning(
                "job %s attempt %d: %s; not acknowledged", job.id, job.attempt, attempt.cause
            )
            self._inflight.discard([token])
            self._unacked.append(Unacked(job.id, token))
            return None
        if attempt.runtime_s is not None:
            self._inflight.record_runtime(attempt.runtime_s)
        s = self._settings
        ack = ack_for(
            job,
            attempt,
            self._policy,
            s.retries,
            self._id,
            s.max_infra_deaths,
            deadline_at(job, s),
        )
        failed_here = self.failure is not None and attempt.outcome is not Outcome.OK
        if failed_here and ack.attempt.outcome is not Outcome.POISON:
            # The worker broke, not the job: hand it back uncharged, with what happened
            # (and a helper's death under it still counted against it).
            record = ack.attempt.model_copy(update={"action": Action.RETRY_UNCHARGED})
            ack = Ack(job.id, job.token, "requeue", record, infra_death=ack.infra_death)
        return job, ack

    def _finish(self, acks: list[tuple[Claimed, Ack]], held: bool = True) -> None:
        """Ack jobs and claim into the slots they free, in one round trip (``held``: the
        jobs hold slots, which the claim may refill).

        If the backend is unreachable, keep trying while the leases live (the heartbeat
        keeps renewing them); after that the jobs are recovered elsewhere, at least once.
        A failed call may have run with only its reply lost: each retry asks the backend
        for the jobs it claimed then (``replay_of``), so they do not wait out a lease.
        """
        refill = self._inflight.reserve(finishing=len(acks) if held else 0)
        lease_s = self._settings.lease_s
        lease_ends = time.monotonic() + lease_s
        delay = 0.05
        tokens = [job.token for job, _ in acks]
        if self._stop.deadline() == math.inf:
            self.progress.flush(tokens)  # a report after its lease's ack would be rejected
        else:
            self.progress.drop(tokens)  # stopping: a hung backend must not hold the exit
        base = os.urandom(8).hex()
        tries = 0
        try:
            while True:
                # every try's tokens start with "<base>.", so a retry replays them all
                token_base = base if not tries else f"{base}.r{tries}"
                replay_of = base if tries else None
                try:
                    accepted, claimed = self._call(
                        functools.partial(
                            self._backend.finish_many,
                            self._id,
                            [ack for _, ack in acks],
                            claim=refill,
                            lease_s=lease_s,
                            token_base=token_base,
                            replay_of=replay_of,
                        )
                    )
                    break
                except BackendError as exc:
                    tries += 1
                    ends = min(lease_ends, self._stop.deadline())
                    if time.monotonic() + delay > ends or self._stop.now.is_set():
                        log.error("giving up acking %d job(s): %s", len(acks), exc)
                        self._inflight.discard(tokens)
                        return
                    time.sleep(delay)
                    delay = min(delay * 2, 1.0)
            self._inflight.discard(tokens)
            self._unacked.extend(count_acks(acks, accepted, self._stats, maybe_applied=tries > 0))
            if self._metrics is not None:  # metrics, once per ack batch
                self._metrics.acked(acks, accepted)
            for job in claimed:
                refill -= self._start(job)
        finally:
            self._inflight.unreserve(refill)

    def _on_progress(self, token: str, fraction: float, message: str | None) -> None:
        held = self._inflight.get(token)
        if held is not None:
            self.progress.report(held.job.id, token, fraction, message)
