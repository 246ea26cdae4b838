"""The dispatcher: moves jobs between the backend and the pool, on two threads.

    fetcher thread ── claim(free slots) ──► start: Task(fence = lease) ──► pool
         │ nothing to claim: the claim blocks (no polling) until a job     │ on_done
    main thread ◄─────────────── events queue (done, progress, stop) ──────┘
         └── acks.py (exit policy) ──► finish(acks, claim = freed slots) ──► start the next

The main thread owns every ``finish``: one round trip acks the attempts that ended and
claims into the slots they free. The fetcher only fills slots the finishes left empty, so
an idle worker blocks in the backend and a busy one costs about one round trip per batch
of jobs. ``InFlight`` keeps the two from holding more than the capacity between them.

Attempt identity: every event names the *lease token* it belongs to, and ``InFlight`` is
keyed by it, so an attempt's outcome is applied to its own lease or, if that lease is no
longer held, dropped and counted (``stats["stale_outcomes"]``), never to a later lease of
the same job. An attempt that ended without an ack (cancelled, lease lost, ack rejected)
is reported with ``confirm_dead``: it lifts the fence that keeps a retried job from
running elsewhere while the old child may live.

The watch: the main thread also checks, every ``WATCH_S``, that the fetcher, the pool and
the worker's other threads (``health``) still live. When one does not, ``fail`` stops the
worker at once: nothing more is claimed, every running attempt is killed and requeued
uncharged, and ``run()`` ends with ``failure`` naming the cause.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from queue import Empty, SimpleQueue
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import ValidationError

from sandboxq.acks import ack_for
from sandboxq.backends.base import Ack, Backend, Claimed
from sandboxq.bounded import call_until
from sandboxq.drain import Drain
from sandboxq.errors import BackendError
from sandboxq.heartbeat import Lease, fence_margin_s
from sandboxq.inflight import Held, InFlight
from sandboxq.models import Action, AttemptRecord, JobState, Outcome, parse_job_options
from sandboxq.outcomes import ExitPolicy
from sandboxq.pool.attempt import AttemptResult, Task
from sandboxq.pool.pool import Pool
from sandboxq.progress import ProgressWriter
from sandboxq.settings import WorkerSettings

if TYPE_CHECKING:
    from sandboxq.metrics import WorkerMetrics

log = logging.getLogger("sandboxq.worker")

#: How long an idle fetcher blocks in one claim (it also rechecks "stop" this often, so
#: it stays below the second a stop(now=True) is given).
IDLE_WAIT_S = 0.5
#: How often the main thread checks that every part of the worker still lives.
WATCH_S = 0.25


def one_line(text: str, limit: int = 300) -> str:
    """``text`` on one line, short enough for a log line and an exit message."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


T = TypeVar("T")

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
        stop: Callable[..., None],
        health: Callable[[], str | None] = lambda: None,
        deadline: Callable[[], float] = lambda: math.inf,
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
        self._health = health
        self._deadline = deadline
        self._metrics = metrics
        self._policy = ExitPolicy(exit_codes=settings.exit_codes)
        self.events: SimpleQueue[tuple[Any, ...]] = SimpleQueue()
        self.fetcher: threading.Thread | None = None
        #: Why the worker failed (one line), or None: set once, by ``fail``.
        self.failure: str | None = None
        self._drained = False  # the burst fetcher ended on purpose
        self._next_watch = 0.0
        # (job id, lease token) of attempts that ended unacked: for confirm_dead
        self._ended: list[tuple[str, str]] = []
        #: Writes progress on its own thread (closed by the worker when it stops).
        self.progress = ProgressWriter(backend, worker_id)
        for name in ("stale_outcomes", "confirmed_dead"):
            stats.setdefault(name, 0)

    def fail(self, cause: str) -> None:
        """Stop the worker at once because part of it broke; safe from any thread."""
        if self.failure is None:
            self.failure = one_line(cause)
            log.error("worker failed: %s; handing its jobs back", self.failure)
        self._stop(True)

    def start_fetcher(self, burst: bool) -> None:
        self.fetcher = threading.Thread(
            target=self._fetch_guarded, args=(burst,), name="sandboxq-fetcher", daemon=True
        )
        self.fetcher.start()

    def _fetch_guarded(self, burst: bool) -> None:
        try:
            self._fetch(burst)
        except BaseException as exc:
            log.exception("the fetcher thread crashed")
            self.fail(f"the fetcher thread died: {exc!r}")

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
                self._drained = True
                self.events.put(("drained",))
                return

    def _queue_is_drained(self) -> bool:
        if len(self._inflight):
            return False
        try:
            counts = self._backend.counts()
        except BackendError as exc:  # not drained as far as we know: the next claim waits
            log.warning("could not count jobs (%s); still working", exc)
            return False
        # Another worker's active job may still come back here (a retry, a recovery).
        waiting = (JobState.WAITING, JobState.DELAYED, JobState.ACTIVE)
        return not any(counts[state] for state in waiting)

    def _start(self, job: Claimed) -> None:
        """Hand a claimed job to the pool, or fail it at once if it cannot run."""
        if self.failure is not None:  # the worker is going down: nothing new starts
            self._give_back([job])
            return
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
        token = job.token
        lease = Lease(job.id, token, 0, job.claimed_at)
        self._inflight.add(Held(job, options, lease))
        soft = options.soft_timeout_s or s.soft_timeout_s
        hard = options.hard_timeout_s or s.hard_timeout_s
        if soft is not None and hard is not None and soft >= hard:
            soft = None  # a job's own hard timeout below the worker's soft one wins
        events = self.events
        task = Task(
            job.payload,
            job.codec,  # type: ignore[arg-type]
            soft_timeout_s=soft,
            hard_timeout_s=hard,
            max_memory_mb=options.max_memory_mb or s.max_memory_mb,
            job_id=job.id,
            attempt=job.attempt,
            on_progress=lambda f, m: events.put(("progress", token, f, m)),
            # The lease began no earlier than claimed_at: this falls before it can expire.
            fence_deadline=job.claimed_at + s.lease_s - fence_margin_s(s.lease_s),
        )
        try:
            lease.task_id = self._pool.execute(task, lambda r: events.put(("done", token, r)))
        except Exception as exc:  # a broken or closing pool: the job goes back, uncharged
            self._inflight.discard([token])
            self._give_back([job])
            self.fail(f"the pool cannot run jobs: {exc}")

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
                events = [self.events.get(timeout=0.1 if self._stopping.is_set() else WATCH_S)]
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
            if self._ended:
                self._confirm_dead()
            self._watch()
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
                if time.monotonic() > self._deadline():
                    # Redis hangs, or an attempt never ended: stop anyway. What is still
                    # held is recovered elsewhere once its lease runs out; a claim still
                    # under way gives its jobs back (the fetcher sees the stop).
                    if len(self._inflight):
                        log.error(
                            "stopping with %d job(s) not acknowledged: the stop deadline passed",
                            len(self._inflight),
                        )
                    return
                drain.advance()

    def _watch(self) -> None:
        """Fail the worker if one of its parts died (checked every ``WATCH_S``)."""
        now = time.monotonic()
        if now < self._next_watch or self.failure is not None:
            return
        self._next_watch = now + WATCH_S
        fetcher = self.fetcher
        if self._pool.broken is not None:
            self.fail(f"the pool broke: {self._pool.broken}")
        elif not self._pool.alive:
            self.fail("the pool's supervisor thread stopped")
        elif (
            fetcher is not None
            and not fetcher.is_alive()
            and not self._drained
            and not self._stopping.is_set()
        ):
            self.fail("the fetcher thread stopped")
        elif (cause := self._health()) is not None:
            self.fail(cause)

    def _confirm_dead(self) -> None:
        """Tell the backend which unacked attempts have ended: lifts their jobs' fences."""
        ended, self._ended = self._ended, []
        try:
            self._call(lambda: self._backend.confirm_dead(self._id, ended))
            self._stats["confirmed_dead"] += len(ended)
        except BackendError as exc:  # their fences lift when the old leases run out
            log.warning("could not confirm %d ended attempt(s): %s", len(ended), exc)

    def _call(self, fn: Callable[[], T]) -> T:
        """``fn()``; once a stop deadline is set, given only until then (a hung Redis
        must not hold the worker past it), raising ``BackendError`` when it runs out."""
        return call_until(fn, self._deadline())

    def _ack_for(self, token: str, attempt: AttemptResult) -> tuple[Claimed, Ack] | None:
        """What to tell the backend about the attempt of lease ``token`` that ended (None:
        nothing)."""
        held = self._inflight.get(token)
        if held is None:
            # That lease is not held any more: its outcome belongs to no current lease.
            self._stats["stale_outcomes"] += 1
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
            self._stats[stat] += 1
            log.warning(
                "job %s attempt %d: %s; not acknowledged", job.id, job.attempt, attempt.cause
            )
            self._inflight.discard([token])
            self._ended.append((job.id, token))
            return None
        if attempt.runtime_s is not None:
            self._inflight.record_runtime(attempt.runtime_s)
        s = self._settings
        ack = ack_for(job, held.options, attempt, self._policy, s.retries, self._id)
        if self.failure is not None and attempt.outcome is not Outcome.OK:
            # The worker broke, not the job: hand it back uncharged, with what happened.
            ack = Ack(job.id, job.token, "requeue", ack.attempt.model_copy(update={"action": None}))
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
        if self._deadline() == math.inf:
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
                    ends = min(lease_ends, self._deadline())
                    if time.monotonic() + delay > ends or self._stop_now.is_set():
                        log.error("giving up acking %d job(s): %s", len(acks), exc)
                        self._inflight.discard(tokens)
                        return
                    time.sleep(delay)
                    delay = min(delay * 2, 1.0)
            self._inflight.discard(tokens)
            self._count(acks, accepted, maybe_applied=tries > 0)
            if self._metrics is not None:  # metrics, once per ack batch
                self._metrics.acked(acks, accepted)
            for job in claimed:
                self._start(job)
        finally:
            self._inflight.unreserve(refill)

    def _count(
        self, acks: list[tuple[Claimed, Ack]], accepted: list[bool], maybe_applied: bool = False
    ) -> None:
        """Stats, and one log line per job outcome (``maybe_applied``: the acks were sent
        again after a call without an answer, so a rejection may be of an applied ack).

        The lines of one batch go out as one record: under load a batch holds many jobs,
        and a record per job (format, write, flush) was a third of this thread's time.
        The command line's formatter puts its prefix in front of every line.
        """
        lines: list[str] | None = [] if log.isEnabledFor(logging.INFO) else None
        for (job, ack), ok in zip(acks, accepted, strict=True):
            if not ok and maybe_applied:
                log.warning(
                    "job %s: ack rejected when sent again: it may have been applied", job.id
                )
                self._ended.append((job.id, job.token))
                continue
            if not ok:
                self._stats["rejected_acks"] += 1
                log.warning("job %s: ack rejected, the lease was lost; result discarded", job.id)
                self._ended.append((job.id, job.token))  # its child has ended all the same
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

    def _on_progress(self, token: str, fraction: float, message: str | None) -> None:
        held = self._inflight.get(token)
        if held is not None:
            self.progress.report(held.job.id, token, fraction, message)
