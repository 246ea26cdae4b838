"""The in-process backend: the embedded default (``memory://``) and the reference the Redis
backend is held to by the contract suite (``sandboxq.testing.contract``).

    enqueue ──► waiting heap (-priority, seq)     delayed heap (due_ms, seq)
                   │ claim (promotes due jobs first)   ▲ retry with a delay
                   ▼                                    │
                active (owner, token, lease_ms) ── finish / recover_stalled / cancel
                   ▼
                completed | failed | cancelled   (trimmed by count and age)

One ``threading.Condition`` guards every structure. Every state change emits an event,
and emitting notifies *all* waiters: waiting claims, ``wait_for_finish`` and
``events`` share the condition, so waking only some of them could wake the wrong ones;
each re-checks its own predicate instead, which makes a missed wake-up impossible.

The heaps are pruned lazily: an entry is live only while its ``seq`` is the job's current
one, so cancelling, purging or trimming a job never has to search a heap.

Where the protocol leaves a choice open, this backend makes the Redis backend's choice, so
code tested on one behaves the same on the other: options are validated at enqueue, a
requeued or recovered job keeps its place in line, and a stalled attempt leaves a record.
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from sandboxq.backends import rules
from sandboxq.backends.base import (
    ERROR_CLIP,
    PAGE_SCAN,
    PRIORITY_BANDS,
    Ack,
    Claimed,
    Event,
    FinishAction,
    FinishResult,
    JobDetail,
    JobPage,
    JobSummary,
    NewJob,
    check_limits,
)
from sandboxq.errors import ConfigError, JobNotFound
from sandboxq.models import (
    MAX_PRIORITY,
    Action,
    AttemptRecord,
    JobInfo,
    JobOptions,
    JobState,
    Outcome,
    check_queue_name,
)

if TYPE_CHECKING:
    from sandboxq.backends.base import Backend

log = logging.getLogger("sandboxq.backends.memory")

WAITING, DELAYED, ACTIVE = JobState.WAITING, JobState.DELAYED, JobState.ACTIVE
COMPLETED, FAILED, CANCELLED = JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED
_FINISHED = (COMPLETED, FAILED, CANCELLED)
_ACTIONS = ("complete", "retry", "fail", "requeue")
HISTORY_CAP = rules.HISTORY_CAP
_ms = rules.ms


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _options(new: NewJob) -> JobOptions:
    """Validated at enqueue, so a job that is stored can always be claimed and read."""
    try:
        options = JobOptions.model_validate_json(new.options_json)
    except ValueError as exc:
        raise ConfigError(f"job {new.job_id!r}: invalid options: {exc}") from exc
    if not -MAX_PRIORITY <= new.priority <= MAX_PRIORITY:
        raise ConfigError(f"job {new.job_id!r}: priority {new.priority} is outside ±{MAX_PRIORITY}")
    return options


@dataclass(slots=True)
class _Job:
    new: NewJob  # payload, codec, options and priority as enqueued (frozen)
    id: str
    options: JobOptions
    created_ms: int
    state: JobState = WAITING
    seq: int = 0  # the seq of the job's live heap entry; a new one on every (re-)entry
    due_ms: int = 0
    ready_ms: int = 0  # when it last became claimable (enqueued, due, retried)
    attempts: int = 0
    stalls: int = 0
    owner: str | None = None
    token: str | None = None
    lease_ms: int = 0
    # the fence a cancel leaves (base.Backend.cancel): the revoked lease and its expiry
    fence_owner: str | None = None
    fence_token: str | None = None
    fenced_until_ms: int = 0
    finished_ms: int | None = None
    outcome: Outcome | None = None
    error: str | None = None
    result: bytes | None = None
    history: list[AttemptRecord] = field(default_factory=list)


class MemoryBackend:
    """All of one queue's jobs in this process. ``shared(queue)`` is the instance every
    ``memory://`` Queue and worker of the process uses; tests build private instances."""

    _registry: ClassVar[dict[str, MemoryBackend]] = {}
    _registry_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(
        self,
        queue: str,
        *,
        retain_completed: int = 1000,
        retain_failed: int = 10_000,
        retain_s: float = 7 * 24 * 3600,
        max_events: int = 10_000,
    ) -> None:
        self.queue = check_queue_name(queue)
        check_limits(
            retain_completed=retain_completed,
            retain_failed=retain_failed,
            retain_s=retain_s,
            max_events=max_events,
        )
        # Cancelled jobs count against the failed limit: both are jobs that did not succeed.
        self._retain = {
            COMPLETED: retain_completed,
            FAILED: retain_failed,
            CANCELLED: retain_failed,
        }
        self._retain_ms = _ms(retain_s)
        self._cond = threading.Condition()
        self._jobs: dict[str, _Job] = {}
        # Ids per state in the order they entered it: oldest-first is what retention trims
        # and what list_jobs reverses for "newest first".
        self._by_state: dict[JobState, dict[str, None]] = {state: {} for state in JobState}
        self._waiting: list[tuple[int, int, str]] = []
        self._delayed: list[tuple[int, int, str]] = []
        self._seq = itertools.count(1)
        self._events: deque[Event] = deque(maxlen=max_events)
        self._last_event = 0
        self._watchers: list[Callable[[str, str | None], None]] = []
        self._workers: dict[str, tuple[dict[str, Any], int]] = {}

    @classmethod
    def shared(cls, queue: str, **options: Any) -> MemoryBackend:
        """The process-wide backend for ``queue``. Options apply when it is first created;
        later callers get that instance as it is, since jobs already live in it."""
        with cls._registry_lock:
            backend = cls._registry.get(queue)
            if backend is None:
                backend = cls._registry[queue] = cls(queue, **options)
            elif options:
                cls(queue, **options)  # a misspelt or invalid option is an error all the same
            return backend

    # -- internals (the lock is held) --------------------------------------------------------

    def _emit(self, kind: str, job_id: str, **data: str) -> None:
        self._last_event += 1
        self._events.append(Event(str(self._last_event), kind, job_id, data))
        self._cond.notify_all()

    def _move(self, job: _Job, state: JobState, now: int, keep_place: bool = False) -> None:
        self._by_state[job.state].pop(job.id, None)
        if state is DELAYED:
            job.ready_ms = job.due_ms
        elif state is WAITING and not keep_place and job.state is not DELAYED:
            job.ready_ms = now
        job.state = state
        self._by_state[state][job.id] = None
        if state is not ACTIVE:
            job.owner = job.token = None
        job.finished_ms = now if state.finished else None
        if state is WAITING:
            # Keeping its place is safe: the job's old entry left the heap when it was claimed.
            job.seq = job.seq if keep_place else next(self._seq)
            heapq.heappush(self._waiting, (-job.new.priority, job.seq, job.id))
        elif state is DELAYED:
            job.seq = next(self._seq)
            heapq.heappush(self._delayed, (job.due_ms, job.seq, job.id))

    def _live(self, seq: int, job_id: str, state: JobState) -> _Job | None:
        job = self._jobs.get(job_id)
        return job if job is not None and job.state is state and job.seq == seq else None

    def _owned(self, worker_id: str, job_id: str, token: str) -> _Job | None:
        job = self._jobs.get(job_id)
        if job is None or job.state is not ACTIVE or (job.owner, job.token) != (worker_id, token):
            return None
        return job

    def _next_due_ms(self) -> int | None:
        while self._delayed:
            due_ms, seq, job_id = self._delayed[0]
            if self._live(seq, job_id, DELAYED) is not None:
                return due_ms
            heapq.heappop(self._delayed)
        return None

    def _promote(self, now: int) -> None:
        while (due_ms := self._next_due_ms()) is not None and due_ms <= now:
            job = self._jobs[heapq.heappop(self._delayed)[2]]
            job.fence_owner = job.fence_token = None  # a fenced retry falls due: fence over
            self._move(job, WAITING, now)

    def _claim(
        self,
        worker_id: str,
        count: int,
        lease_s: float,
        now: int,
        token_base: str | None = None,
    ) -> list[Claimed]:
        claimed_at = time.monotonic()
        base = token_base or uuid.uuid4().hex
        self._promote(now)
        claimed: list[Claimed] = []
        while len(claimed) < count and self._waiting:
            _, seq, job_id = heapq.heappop(self._waiting)
            job = self._live(seq, job_id, WAITING)
            if job is None:
                continue
            job.attempts += 1
            job.owner, job.token = worker_id, f"{base}.{len(claimed) + 1}"
            job.lease_ms = now + rules.lease_ms(lease_s)
            self._move(job, ACTIVE, now)
            self._emit("active", job.id, worker=worker_id, attempt=str(job.attempts))
            claimed.append(self._claimed(job, claimed_at, now))
        return claimed

    @staticmethod
    def _claimed(job: _Job, claimed_at: float, now: int | None = None) -> Claimed:
        """``job`` as its claimer sees it (``now``: the claim's time, for how long it
        waited since it was ready; None on a replay, which is no new claim)."""
        new = job.new
        assert job.token is not None
        waited_s = None if now is None else max(0, now - (job.ready_ms or job.created_ms)) / 1000
        return Claimed(
            job.id,
            job.token,
            new.payload,
            new.codec,
            new.options_json,
            job.attempts,
            claimed_at,
            waited_s,
        )

    def _replay(self, worker_id: str, token_base: str) -> list[Claimed]:
        """The jobs an earlier call with ``token_base`` claimed that the caller still owns."""
        prefix, claimed_at = token_base + ".", time.monotonic()
        return [
            self._claimed(job, claimed_at)
            for job in (self._jobs[i] for i in self._by_state[ACTIVE])
            if job.owner == worker_id and (job.token or "").startswith(prefix)
        ]

    def _record(self, job: _Job, attempt: AttemptRecord, error: str | None) -> None:
        job.history.append(attempt)
        del job.history[:-HISTORY_CAP]
        job.outcome, job.error = attempt.outcome, error or None

    def _delete(self, job_id: str) -> None:
        job = self._jobs.pop(job_id)
        del self._by_state[job.state][job_id]

    def _trim(self, now: int) -> None:
        oldest_kept_ms = now - self._retain_ms
        for state in _FINISHED:
            ids = self._by_state[state]
            excess = len(ids) - self._retain[state]
            for job_id in list(itertools.islice(ids, max(0, excess))):
                self._delete(job_id)
            # Finish order is insertion order, so the oldest are first: stop at a young one.
            while ids and (self._jobs[next(iter(ids))].finished_ms or 0) < oldest_kept_ms:
                self._delete(next(iter(ids)))

    # -- producers and workers ---------------------------------------------------------------

    def enqueue(self, jobs: Sequence[NewJob]) -> list[tuple[str, bool]]:
        # Validate the whole batch first, so a bad job adds none of it.
        checked = [(new, new.job_id or uuid.uuid4().hex, _options(new)) for new in jobs]
        added: list[tuple[str, bool]] = []
        with self._cond:
            now = _now_ms()
            for new, job_id, options in checked:
                if job_id in self._jobs:
                    added.append((job_id, False))
                    continue
                job = self._jobs[job_id] = _Job(new, job_id, options, now)
                job.due_ms = now + _ms(new.delay_s)
                self._move(job, DELAYED if job.due_ms > now else WAITING, now)
                self._emit("added", job_id)
                added.append((job_id, True))
        return added

    def claim(
        self, worker_id: str, count: int, lease_s: float, wait_s: float = 0.0
    ) -> list[Claimed]:
        deadline = time.monotonic() + wait_s
        with self._cond:
            while not (claimed := self._claim(worker_id, count, lease_s, _now_ms())):
                left = deadline - time.monotonic()
                due_ms = self._next_due_ms()
                if due_ms is not None:
                    left = min(left, (due_ms - _now_ms()) / 1000)
                if left <= 0:
                    break
                self._cond.wait(left)
            return claimed

    def renew(self, worker_id: str, leases: Sequence[tuple[str, str]], lease_s: float) -> list[str]:
        lost: list[str] = []
        with self._cond:
            now = _now_ms()
            for job_id, token in leases:
                job = self._owned(worker_id, job_id, token)
                if job is None:
                    lost.append(job_id)
                else:
                    job.lease_ms = now + rules.lease_ms(lease_s)
        return lost

    def release(self, worker_id: str, leases: Sequence[tuple[str, str]]) -> list[str]:
        kept: list[str] = []
        with self._cond:
            now = _now_ms()
            for job_id, token in leases:
                job = self._owned(worker_id, job_id, token)
                if job is None:
                    kept.append(job_id)
                    continue
                job.attempts = max(0, job.attempts - 1)
                self._move(job, WAITING, now, keep_place=True)
                self._emit("released", job_id)
        return kept

    def finish(
        self,
        worker_id: str,
        job_id: str,
        token: str,
        action: FinishAction,
        attempt: AttemptRecord,
        *,
        result: bytes | None = None,
        error: str | None = None,
        retry_delay_s: float = 0.0,
        claim: int = 0,
        lease_s: float = 30.0,
    ) -> FinishResult:
        ack = Ack(job_id, token, action, attempt, result, error, retry_delay_s)
        accepted, claimed = self.finish_many(worker_id, [ack], claim=claim, lease_s=lease_s)
        # A rejected ack claims nothing: "nothing changed".
        return FinishResult(accepted=accepted[0], claimed=claimed)

    def finish_many(
        self,
        worker_id: str,
        acks: Sequence[Ack],
        *,
        claim: int = 0,
        lease_s: float = 30.0,
        token_base: str | None = None,
        replay_of: str | None = None,
    ) -> tuple[list[bool], list[Claimed]]:
        for ack in acks:
            if ack.action not in _ACTIONS:
                raise ConfigError(f"unknown finish action {ack.action!r}: use one of {_ACTIONS}")
        with self._cond:
            now = _now_ms()
            replayed = self._replay(worker_id, replay_of) if replay_of else []
            accepted = [self._finish_one(worker_id, ack, now) for ack in acks]
            if len(acks) == 1 and not accepted[0]:
                return accepted, replayed
            self._trim(now)
            count = claim - len(replayed)
            return accepted, replayed + self._claim(worker_id, count, lease_s, now, token_base)

    def _finish_one(self, worker_id: str, ack: Ack, now: int) -> bool:
        job_id, action, attempt = ack.job_id, ack.action, ack.attempt
        result, error, retry_delay_s = ack.result, ack.error, ack.retry_delay_s
        job = self._owned(worker_id, job_id, ack.token)
        if job is None:
            return False
        self._record(job, attempt, error)
        outcome = attempt.outcome.value
        if action == "complete":
            job.result = result
            self._move(job, COMPLETED, now)
            self._emit("completed", job_id, outcome=outcome)
        elif action == "fail":
            self._move(job, FAILED, now)
            self._emit("failed", job_id, outcome=outcome, error=error or "")
        elif action == "retry":
            job.due_ms = now + _ms(retry_delay_s)
            self._move(job, DELAYED if job.due_ms > now else WAITING, now)
            delay_ms = str(job.due_ms - now)
            self._emit("retried", job_id, outcome=outcome, error=error or "", delay_ms=delay_ms)
        else:  # requeue: interrupted by a shutdown, not by the job, so it is not charged
            job.attempts = max(0, job.attempts - 1)
            self._move(job, WAITING, now, keep_place=True)
            self._emit("requeued", job_id, outcome=outcome)
        return True

    def record_progress(
        self, worker_id: str, job_id: str, token: str, fraction: float, message: str | None
    ) -> bool:
        with self._cond:
            job = self._owned(worker_id, job_id, token)
            if job is None:
                return False
            data = {"fraction": str(float(fraction))}
            if message is not None:
                data["message"] = message
            self._emit("progress", job_id, **data)
            return True

    def recover_stalled(self) -> list[tuple[str, str]]:
        recovered: list[tuple[str, str]] = []
        with self._cond:
            now = _now_ms()
            expired = [
                i
                for i in self._by_state[ACTIVE]
                if rules.lease_expired(self._jobs[i].lease_ms, now)
            ]
            for job_id in expired:
                job = self._jobs[job_id]
                job.stalls += 1
                limit = job.options.max_stalls
                state = FAILED if job.stalls > limit else WAITING
                if state is FAILED:
                    cause = rules.STALL_FAIL_TEXT % job.stalls
                else:
                    cause = rules.STALL_RETRY_TEXT % (job.stalls, limit)
                # The owner is gone and its late finish will be rejected: this is the only
                # record of the attempt, so "why did my job die" still has an answer.
                attempt = AttemptRecord(
                    attempt=job.attempts,
                    outcome=Outcome.LEASE_LOST,
                    action=Action.FAIL if state is FAILED else Action.RETRY,
                    worker_id=job.owner,
                    ended_ms=now,
                    error=cause,
                )
                self._record(job, attempt, cause)
                self._move(job, state, now, keep_place=True)  # it was first in line once
                self._emit("stalled", job_id, state=state.value, stalls=str(job.stalls))
                if state is FAILED:
                    self._emit("failed", job_id, outcome=Outcome.LEASE_LOST.value, error=cause)
                recovered.append((job_id, state.value))
            self._trim(now)
        return recovered

    def cancel(self, job_id: str) -> bool:
        with self._cond:
            job = self._jobs.get(job_id)
            if job is None or job.state.finished:
                return False
            now, was = _now_ms(), job.state.value
            cause = rules.CANCELLED_TEXT % was
            token = job.token
            if job.state is ACTIVE:
                # The fence: the revoked lease may still be running until its owner
                # confirms it dead or the lease runs out (retry_failed honours it).
                job.fence_owner, job.fence_token = job.owner, job.token
                job.fenced_until_ms = job.lease_ms
                record = AttemptRecord(
                    attempt=job.attempts,
                    outcome=Outcome.CANCELLED,
                    worker_id=job.owner,
                    ended_ms=now,
                    error=cause,
                )
                self._record(job, record, cause)
            job.outcome, job.error = Outcome.CANCELLED, cause
            self._move(job, CANCELLED, now)  # clears owner and token: the lease is revoked
            self._emit("cancelled", job_id, **{"from": was})
            self._trim(now)
            watchers = list(self._watchers)
        # Outside the lock: a callback that calls back into the backend must not deadlock.
        for callback in watchers:
            try:
                callback(job_id, token)
            except Exception:
                log.exception("cancellation callback %r failed for job %s", callback, job_id)
        return True

    # -- inspection and administration -------------------------------------------------------

    def get(self, job_id: str) -> JobInfo | None:
        with self._cond:
            job = self._jobs.get(job_id)
            if job is None:
                return None
            return JobInfo(
                id=job.id,
                queue=self.queue,
                state=job.state,
                codec=job.new.codec,
                attempts=job.attempts,
                stalls=job.stalls,
                options=job.options,
                created_ms=job.created_ms,
                finished_ms=job.finished_ms,
                outcome=job.outcome,
                error=job.error,
                history=list(job.history),
            )

    def get_result(self, job_id: str) -> bytes | None:
        with self._cond:
            job = self._jobs.get(job_id)
            return job.result if job is not None and job.state is COMPLETED else None

    def counts(self) -> dict[JobState, int]:
        with self._cond:
            return {state: len(ids) for state, ids in self._by_state.items()}

    def retry_failed(self, job_id: str) -> bool:
        with self._cond:
            job = self._jobs.get(job_id)
            if job is None or job.state not in (FAILED, CANCELLED):
                return False
            # Stalls restart too: a job failed for stalling would otherwise fail again at
            # its very next stall. The history stays; the last attempt's verdict goes.
            job.attempts = job.stalls = 0
            job.result = job.outcome = job.error = None
            now = _now_ms()
            if self._fenced(job, now):
                job.due_ms = job.fenced_until_ms + 1  # the first millisecond it is lifted
                self._move(job, DELAYED, now)
                self._emit("retried", job_id, manual="1", fenced_until_ms=str(job.fenced_until_ms))
                return True
            job.fence_owner = job.fence_token = None
            self._move(job, WAITING, now)
            self._emit("retried", job_id, manual="1")
            return True

    def confirm_dead(self, worker_id: str, leases: Sequence[tuple[str, str]]) -> list[str]:
        lifted: list[str] = []
        with self._cond:
            now = _now_ms()
            for job_id, token in leases:
                job = self._jobs.get(job_id)
                if job is None or (job.fence_owner, job.fence_token) != (worker_id, token):
                    continue
                job.fence_owner = job.fence_token = None
                if job.state is DELAYED:
                    self._move(job, WAITING, now)
                self._emit("unfenced", job_id)
                lifted.append(job_id)
        return lifted

    def purge(self, state: JobState) -> int:
        if state is ACTIVE:
            raise ConfigError("active jobs cannot be purged: cancel them instead")
        with self._cond:
            now = _now_ms()
            # a job cancelled while running keeps its fence: see Backend.purge
            ids = [i for i in self._by_state[state] if not self._fenced(self._jobs[i], now)]
            for job_id in ids:
                self._delete(job_id)
            # the heaps skip deleted entries lazily; emptied at once when nothing was kept
            if state is WAITING and not self._by_state[state]:
                self._waiting.clear()
            elif state is DELAYED and not self._by_state[state]:
                self._delayed.clear()
            self._cond.notify_all()  # wait_for_finish on a purged job returns now
            return len(ids)

    @staticmethod
    def _fenced(job: _Job, now: int) -> bool:
        """Cancelled while running, and its old owner has neither confirmed the child dead
        nor let the old lease run out."""
        return job.fence_token is not None and not rules.fence_lifted(job.fenced_until_ms, now)

    def list_jobs(self, state: JobState, limit: int = 100) -> list[str]:
        with self._cond:
            ids = self._by_state[state]
            if state.finished:
                return list(itertools.islice(reversed(ids), max(0, limit)))
            jobs = [self._jobs[i] for i in ids]
            if state is WAITING:  # claim order
                jobs.sort(key=lambda job: (-job.new.priority, job.seq))
            elif state is DELAYED:  # due order
                jobs.sort(key=lambda job: (job.due_ms, job.seq))
            return [job.id for job in jobs[: max(0, limit)]]

    # -- waiting -----------------------------------------------------------------------------

    def wait_for_finish(self, job_id: str, timeout_s: float) -> JobState | None:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not (job := self._known(job_id)).state.finished:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            return job.state

    def _known(self, job_id: str) -> _Job:
        job = self._jobs.get(job_id)
        if job is None:  # never enqueued, trimmed or purged: waiting would be for nothing
            raise JobNotFound(
                f"job {job_id!r} of queue {self.queue!r} does not exist", job_id=job_id
            )
        return job

    def events(self, since: str | None = None, block_s: float | None = None) -> Iterator[Event]:
        try:
            last = int(since) if since is not None else 0
        except ValueError:
            raise ConfigError(f"since {since!r} is not an event id of a memory:// queue") from None
        while True:
            with self._cond:
                deadline = time.monotonic() + (block_s or 0.0)
                while self._last_event <= last and (left := deadline - time.monotonic()) > 0:
                    self._cond.wait(left)
                # Ids are consecutive, so the first new event sits at a computable offset.
                first = int(self._events[0].id) if self._events else last + 1
                batch = list(itertools.islice(self._events, max(0, last + 1 - first), None))
            if not batch:
                return
            yield from batch  # never while holding the lock: the consumer may be slow
            last = int(batch[-1].id)
            if block_s is None:
                return

    def watch_cancellations(
        self, callback: Callable[[str, str | None], None]
    ) -> Callable[[], None]:
        with self._cond:
            self._watchers.append(callback)

        def stop() -> None:
            with self._cond:
                if callback in self._watchers:
                    self._watchers.remove(callback)

        return stop

    # -- workers -----------------------------------------------------------------------------

    def register_worker(self, worker_id: str, info: dict[str, Any], ttl_s: float) -> None:
        with self._cond:
            self._workers[worker_id] = ({**info, "worker_id": worker_id}, _now_ms() + _ms(ttl_s))

    def unregister_worker(self, worker_id: str) -> None:
        with self._cond:
            self._workers.pop(worker_id, None)

    def workers(self) -> list[dict[str, Any]]:
        with self._cond:
            now = _now_ms()
            for worker_id in [w for w, (_, until) in self._workers.items() if until <= now]:
                del self._workers[worker_id]
            return [dict(self._workers[w][0]) for w in sorted(self._workers)]

    def close(self) -> None:
        """Nothing to release; the jobs stay, since a shared instance outlives any one user."""

    # -- reads for the dashboard -------------------------------------------------------------
    # The dashboard's memory:// queues live in its own process and are small: these walk
    # the state's jobs in Python, with the Redis backend's order and cursor rules.

    def _page_key(self, job: _Job) -> tuple[int, int | str]:
        """A job's place in its state's order, unique within the state (see job_page)."""
        if job.state is WAITING:
            return (-job.new.priority, job.seq)
        if job.state is DELAYED:
            return (job.due_ms, job.seq)
        if job.state is ACTIVE:
            return (job.lease_ms, job.seq)
        return (job.finished_ms or 0, job.id)  # newest first: walked in reverse

    def job_page(
        self,
        state: JobState,
        cursor: str | None = None,
        limit: int = 50,
        outcome: str | None = None,
    ) -> JobPage:
        state = JobState(state)
        after: tuple[int, int | str] | None = None
        if cursor is not None:
            try:
                first, second = json.loads(cursor)
                after = (int(first), second if state.finished else int(second))
            except (ValueError, TypeError):
                raise ConfigError(f"invalid page cursor {cursor!r}") from None
        desc = state.finished
        budget = PAGE_SCAN if outcome else limit
        jobs: list[JobSummary] = []
        scanned, last, more = 0, after, False
        with self._cond:
            ordered = sorted(
                ((self._page_key(self._jobs[i]), i) for i in self._by_state[state]),
                reverse=desc,
            )
            for key, job_id in ordered:
                if after is not None and (key <= after if not desc else key >= after):
                    continue
                if len(jobs) >= limit or scanned >= budget:
                    more = True
                    break
                scanned += 1
                last = key
                job = self._jobs[job_id]
                if outcome and (job.outcome is None or job.outcome.value != outcome):
                    continue
                jobs.append(
                    JobSummary(
                        id=job.id,
                        state=job.state.value,
                        attempts=job.attempts,
                        outcome=job.outcome.value if job.outcome else None,
                        error=job.error[:ERROR_CLIP] if job.error else None,
                        created_ms=job.created_ms,
                        finished_ms=job.finished_ms,
                    )
                )
        next_cursor = json.dumps(list(last)) if more and last is not None else None
        return JobPage(jobs, next_cursor, scanned)

    def job_detail(self, job_id: str) -> JobDetail | None:
        info = self.get(job_id)
        if info is None:
            return None
        with self._cond:
            job = self._jobs.get(job_id)
            if job is None:
                return None
            progress: Event | None = None
            # Progress is an event only here: the newest one for this job since it was
            # last put back by hand (as retry_failed clears the stored progress in Redis).
            for event in reversed(self._events):
                if event.job_id != job_id:
                    continue
                if event.kind == "progress":
                    progress = event
                    break
                if event.kind == "retried" and event.data.get("manual"):
                    break
            return JobDetail(
                info=info,
                payload=job.new.payload,
                result=job.result if job.state is COMPLETED else None,
                progress=float(progress.data["fraction"]) if progress else None,
                progress_message=progress.data.get("message") if progress else None,
            )

    def oldest_waiting_ms(self) -> int | None:
        with self._cond:
            heads: dict[int, _Job] = {}
            for job_id in self._by_state[WAITING]:
                job = self._jobs[job_id]
                head = heads.get(job.new.priority)
                if head is None or job.seq < head.seq:
                    heads[job.new.priority] = job
            first = sorted(heads.items(), reverse=True)[:PRIORITY_BANDS]
            return min((job.created_ms for _, job in first), default=None)


if TYPE_CHECKING:
    _conforms: Backend = MemoryBackend("q")
