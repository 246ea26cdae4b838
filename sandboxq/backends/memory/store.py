"""The memory backend's jobs and their state transitions, under one lock.

    enqueue ──► waiting heap (-priority, seq)     delayed heap (due_ms, id, seq)
                   │ claim (promotes due jobs first)   ▲ retry with a delay
                   ▼                                    │
                active (owner, token, lease_ms) ── finish / recover_stalled / cancel
                   ▼
                completed | failed | cancelled   (trimmed by count and age on entry)

Everything here runs with ``Store.cond`` held. Every order a reader can see is the
Redis backend's, so code tested on one behaves the same on the other: waiting by
(-priority, seq), delayed by (due_ms, id), active by (lease_ms, id), finished by
(finished_ms, id), the job id breaking ties as a sorted set's member does.

The heaps are pruned lazily: an entry is live only while its ``seq`` is the job's current
one, so cancelling, purging or trimming a job never has to search a heap.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from sandboxq.backends import rules
from sandboxq.backends.base import Claimed, Event, NewJob
from sandboxq.backends.memory.batches import BatchRecord, FollowUp, batch_moved, sweep_batches
from sandboxq.backends.rules import Retention
from sandboxq.models import Action, AttemptRecord, JobOptions, JobState, Outcome, now_ms

WAITING, DELAYED, ACTIVE = JobState.WAITING, JobState.DELAYED, JobState.ACTIVE
COMPLETED, FAILED, CANCELLED = JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED
FINISHED = (COMPLETED, FAILED, CANCELLED)


@dataclass(slots=True)
class Job:
    new: NewJob  # payload, codec, options and priority as enqueued (frozen)
    id: str
    options: JobOptions
    created_ms: int
    state: JobState = WAITING
    seq: int = 0  # the seq of the job's live heap entry; a new one on every (re-)entry
    due_ms: int = 0
    ready_ms: int = 0  # when it last became claimable (enqueued, due, retried, recovered)
    attempts: int = 0  # started, never reset: the numbers of its history
    uncharged: int = 0  # of those, the ones the retry budget does not count (common.lua)
    claimed_ms: int | None = None  # when the attempt it is active for was claimed
    child_pid: int | None = None  # that attempt's child, as its owner's record last said
    child_started_ms: int | None = None  # when that child took it, as the record said
    stalls: int = 0
    infra_deaths: int = 0  # helper or worker deaths while it ran (poison at the limit)
    owner: str | None = None
    token: str | None = None
    lease_ms: int = 0
    # the fence a cancel leaves (base.Backend.cancel): the revoked lease and its expiry
    fence_owner: str | None = None
    fence_token: str | None = None
    fenced_until_ms: int = 0
    finished_ms: int | None = None
    expires_ms: int | None = None  # while in a finished state's index: when retention takes it
    outcome: Outcome | None = None
    error: str | None = None
    result: bytes | None = None
    history: list[AttemptRecord] = field(default_factory=list)
    batch: str | None = None  # the id of the batch it is a member of (batches.py)

    def order(self) -> tuple[int, int | str]:
        """The job's place in its state's order (unique within the state)."""
        if self.state is WAITING:
            return (-self.new.priority, self.seq)
        if self.state is DELAYED:
            return (self.due_ms, self.id)
        if self.state is ACTIVE:
            return (self.lease_ms, self.id)
        return (self.finished_ms or 0, self.id)

    def fenced(self, now: int) -> bool:
        """Cancelled while running, and its old owner has neither confirmed the child dead
        nor let the old lease run out."""
        return self.fence_token is not None and not rules.fence_lifted(self.fenced_until_ms, now)


class Store:
    """All of one queue's jobs, the heaps that order them and the events stream."""

    def __init__(self, retention: Retention, queue: str = "") -> None:
        self.queue = queue
        self.keep(retention)
        # (expires_ms, id) of every finished job, as common.lua's expiry set; pruned lazily
        # like the heaps above (an entry is live while it equals the job's expires_ms)
        self.expiry: list[tuple[int, str]] = []
        # what retention removed, the fields of common.lua's trims hash
        self.trims: dict[str, int] = {}
        self.cond = threading.Condition()
        self.jobs: dict[str, Job] = {}
        # Ids per state, and for each finished state a heap of (finished_ms, id): retention
        # trims the oldest first. Keeping the ids themselves in that order cost a no-op
        # worker about a sixth of its throughput (jobs finishing in the same millisecond
        # stepped aside for each other); readers sort instead, far less often.
        self.by_state: dict[JobState, dict[str, None]] = {state: {} for state in JobState}
        self.finished: dict[JobState, list[tuple[int, str]]] = {state: [] for state in FINISHED}
        self.waiting: list[tuple[int, int, str]] = []
        self.delayed: list[tuple[int, str, int]] = []
        self._seq = itertools.count(1)
        self.events: deque[Event] = deque(maxlen=retention.max_events)
        self.last_event = 0
        self.watchers: list[Callable[[str, str | None], None]] = []
        # batches.py: the batches by id, how long a done one is kept, and the follow-ups
        # decided under the lock, sent by the caller once it is released (another queue's
        # lock is never taken while this one is held)
        self.batches: dict[str, BatchRecord] = {}
        self.batch_ttl_ms = rules.ms(retention.batch_ttl_s)
        self.outbox: list[FollowUp] = []

    def keep(self, retention: Retention) -> None:
        """Keep finished jobs as ``retention`` says, from the next one that finishes."""
        self.retention = retention
        # Cancelled jobs count against the failed limit: both are jobs that did not succeed.
        self.retain = {
            COMPLETED: retention.retain_completed,
            FAILED: retention.retain_failed,
            CANCELLED: retention.retain_failed,
        }

    def emit(self, kind: str, job_id: str, **data: str) -> None:
        """Every state change emits an event, and emitting notifies *all* waiters: waiting
        claims, ``wait_for_finish`` and ``events`` share the condition, so waking only some
        could wake the wrong ones; each re-checks its own predicate instead."""
        self.last_event += 1
        self.events.append(Event(str(self.last_event), kind, job_id, data))
        self.cond.notify_all()

    def move(self, job: Job, state: JobState, now: int, keep_place: bool = False) -> None:
        """Put ``job`` in ``state``. Waiting takes a new place in line unless ``keep_place``
        (its old entry left the heap when it was claimed); a finished state trims."""
        was = job.state
        self.by_state[job.state].pop(job.id, None)
        if state is DELAYED:
            job.ready_ms = job.due_ms
        elif state is WAITING and not keep_place and job.state is not DELAYED:
            job.ready_ms = now
        job.state = state
        if state is not ACTIVE:
            job.owner = job.token = job.claimed_ms = job.child_pid = job.child_started_ms = None
        finished = state in FINISHED
        job.finished_ms = now if finished else None
        job.expires_ms = None
        if finished:
            self._enter_finished(job)
            self.trim(state, now, job)
        else:
            self.by_state[state][job.id] = None
        if state is WAITING:
            job.seq = job.seq if keep_place else next(self._seq)
            heapq.heappush(self.waiting, (-job.new.priority, job.seq, job.id))
        elif state is DELAYED:
            job.seq = next(self._seq)
            heapq.heappush(self.delayed, (job.due_ms, job.id, job.seq))
        if job.batch is not None:  # its batch's counters follow, as common.lua's batch_move
            batch_moved(self, job, was, state, now)

    def _enter_finished(self, job: Job) -> None:
        ids, heap = self.by_state[job.state], self.finished[job.state]
        ids[job.id] = None
        heapq.heappush(heap, (job.finished_ms or 0, job.id))
        if len(heap) > 2 * len(ids) + 64:  # entries of jobs that left (retried, purged)
            heap[:] = [(self.jobs[i].finished_ms or 0, i) for i in ids]
            heapq.heapify(heap)

    def _oldest(self, state: JobState) -> Job | None:
        """The oldest job in a finished state, by (finished_ms, id); heap entries of jobs
        that have left it since are dropped on the way."""
        heap, ids = self.finished[state], self.by_state[state]
        while heap:
            finished_ms, job_id = heap[0]
            job = self.jobs.get(job_id)
            if job is not None and job_id in ids and job.finished_ms == finished_ms:
                return job
            heapq.heappop(heap)
        return None

    def per_lease(
        self, leases: Sequence[tuple[str, str]], act: Callable[[str, str, int], bool]
    ) -> tuple[list[str], list[str]]:
        """``act(job_id, token, now)`` for each lease, under the lock: the ids it acted on,
        and the others (renew, release, confirm_dead)."""
        done: list[str] = []
        others: list[str] = []
        with self.cond:
            now = now_ms()
            for job_id, token in leases:
                (done if act(job_id, token, now) else others).append(job_id)
        return done, others

    def live(self, seq: int, job_id: str, state: JobState) -> Job | None:
        job = self.jobs.get(job_id)
        return job if job is not None and job.state is state and job.seq == seq else None

    def owned(self, worker_id: str, job_id: str, token: str) -> Job | None:
        job = self.jobs.get(job_id)
        if job is None or job.state is not ACTIVE or (job.owner, job.token) != (worker_id, token):
            return None
        return job

    def ordered(self, state: JobState) -> list[Job]:
        """The jobs in ``state``, in its order (see the module docstring)."""
        return sorted((self.jobs[i] for i in self.by_state[state]), key=Job.order)

    def next_due_ms(self) -> int | None:
        while self.delayed:
            due_ms, job_id, seq = self.delayed[0]
            if self.live(seq, job_id, DELAYED) is not None:
                return due_ms
            heapq.heappop(self.delayed)
        return None

    def promote(self, now: int) -> None:
        """Due delayed jobs to waiting, ``PROMOTE_LIMIT`` at most, as claim.lua does."""
        for _ in range(rules.PROMOTE_LIMIT):
            due_ms = self.next_due_ms()
            if due_ms is None or due_ms > now:
                return
            job = self.jobs[heapq.heappop(self.delayed)[1]]
            job.fence_owner = job.fence_token = None  # a fenced retry falls due: fence over
            self.move(job, WAITING, now)

    def claim(
        self, worker_id: str, count: int, lease_s: float, now: int, token_base: str | None = None
    ) -> list[Claimed]:
        claimed_at = time.monotonic()
        base = token_base or rules.token_base()
        self.promote(now)
        claimed: list[Claimed] = []
        cancelled = 0  # members of a batch being cancelled: TRIM_BUDGET a claim at most
        while len(claimed) < count and self.waiting and cancelled < rules.TRIM_BUDGET:
            _, seq, job_id = heapq.heappop(self.waiting)
            job = self.live(seq, job_id, WAITING)
            if job is None:
                continue
            if job.batch is not None and self.cancelled_by_claim(job, now):
                cancelled += 1
                continue
            job.attempts += 1
            ready_ms = job.ready_ms or job.created_ms
            late = rules.budget_passed(job.options, job.created_ms, ready_ms, now, job.attempts)
            if late is not None:  # past its deadline_s or max_queue_s: fails, never runs
                self.fail_unstarted(job, worker_id, *late, now)
                continue
            job.claimed_ms = now
            job.owner, job.token = worker_id, f"{base}.{len(claimed) + 1}"
            job.lease_ms = now + rules.lease_ms(lease_s)
            self.move(job, ACTIVE, now)
            self.emit("active", job.id, worker=worker_id, attempt=str(job.attempts))
            claimed.append(self.claimed(job, claimed_at, now))
        return claimed

    def cancelled_by_claim(self, job: Job, now: int) -> bool:
        """Whether ``job``, just popped by a claim, is a member of a batch whose cancel is
        under way: then it is cancelled instead of started, and the cancel counts it."""
        batch = self.batches.get(job.batch or "")
        if batch is None or batch.cancelling is None:
            return False
        self.cancel(job, now)
        batch.cancelling += 1
        return True

    def cancel(self, job: Job, now: int, child: rules.RunningChild | None = None) -> str | None:
        """Cancel ``job`` (not finished; ``child``: the one running it, if it runs); the
        lease token it revoked (cancel.lua)."""
        child = child or rules.RunningChild(None)
        was, token = job.state.value, job.token
        cause = rules.CANCELLED_TEXT % was
        if job.state is ACTIVE:
            # The fence: the revoked lease may still be running until its owner
            # confirms it dead or the lease runs out (retry_failed honours it).
            job.fence_owner, job.fence_token = job.owner, job.token
            job.fenced_until_ms = job.lease_ms
            record = AttemptRecord(
                attempt=job.attempts,
                outcome=Outcome.CANCELLED,
                worker_id=job.owner,
                pid=child.pid,
                started_ms=rules.attempt_start(job.claimed_ms, child),
                ended_ms=now,
                error=cause,
            )
            self.record(job, record, cause)
        job.outcome, job.error = Outcome.CANCELLED, cause
        self.move(job, CANCELLED, now)  # clears owner and token: the lease is revoked
        self.emit("cancelled", job.id, **{"from": was})
        return token

    def fail_unstarted(
        self, job: Job, worker_id: str, outcome: Outcome, error: str, now: int
    ) -> None:
        """``job``, popped by a claim, must not start (``rules.budget_passed``): it fails
        as attempt ``job.attempts``, which never ran (common.lua's ``fail_unstarted``)."""
        record = AttemptRecord(
            attempt=job.attempts,
            outcome=outcome,
            action=Action.FAIL,
            worker_id=worker_id,
            ended_ms=now,
            error=error,
        )
        self.record(job, record, error)
        self.move(job, FAILED, now)
        self.emit("failed", job.id, outcome=outcome.value, error=error)

    @staticmethod
    def claimed(job: Job, claimed_at: float, now: int | None = None) -> Claimed:
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
            job.options,
            max(1, job.attempts - job.uncharged),
            claimed_at,
            waited_s,
            job.infra_deaths,
            job.attempts,
            max(0, (now if now is not None else now_ms()) - job.created_ms) / 1000,
        )

    def replay(self, worker_id: str, token_base: str) -> list[Claimed]:
        """The jobs an earlier call with ``token_base`` claimed that the caller still owns."""
        prefix, claimed_at = token_base + ".", time.monotonic()
        return [
            self.claimed(job, claimed_at)
            for job in self.ordered(ACTIVE)
            if job.owner == worker_id and (job.token or "").startswith(prefix)
        ]

    def record(self, job: Job, attempt: AttemptRecord, error: str | None) -> None:
        job.history.append(attempt)
        del job.history[: -rules.HISTORY_CAP]
        job.outcome, job.error = attempt.outcome, error or None

    def delete(self, job_id: str) -> None:
        job = self.jobs.pop(job_id)
        del self.by_state[job.state][job_id]

    def trim(self, state: JobState, now: int, entered: Job | None = None) -> None:
        """Retention of one finished state, as common.lua's ``trim_finished``: ``entered``
        (the job that just finished) is kept until its time to live runs out; then the
        oldest over the count cap go, then those past their time, ``TRIM_BUDGET`` at most."""
        if entered is not None:
            entered.expires_ms = now + self.retention.ttl_ms(state, entered.options)
            heapq.heappush(self.expiry, (entered.expires_ms, entered.id))
            if len(self.expiry) > 2 * sum(len(self.by_state[s]) for s in FINISHED) + 64:
                self.expiry[:] = [(e, i) for e, i in self.expiry if self._expiring(e, i)]
                heapq.heapify(self.expiry)
        excess = max(0, min(rules.TRIM_BUDGET, len(self.by_state[state]) - self.retain[state]))
        budget = rules.TRIM_BUDGET - excess
        oldest: list[Job] = []
        for _ in range(excess):
            job = self._oldest(state)
            assert job is not None  # the index holds more than the cap
            oldest.append(job)
            heapq.heappop(self.finished[state])
        capped: list[Job] = []  # those removed: a member its batch keeps is not counted
        for job in oldest:  # one still fenced stays (common.lua's trim_finished)
            if job.fenced(now):
                heapq.heappush(self.finished[state], (job.finished_ms or 0, job.id))
            elif self._unindex(job):
                capped.append(job)
        if capped:
            self._count_trims(f"{state}_capped", len(capped))
            self.trims[f"{state}_capped_newest_ms"] = capped[-1].finished_ms or 0
            self.trims[f"{state}_cap"] = self.retain[state]
        self.expire_due(now, budget)
        sweep_batches(self, now)

    def expire_due(self, now: int, budget: int = rules.TRIM_BUDGET) -> None:
        """Jobs past their time go, ``budget`` at most, the earliest first (ties by id), as
        common.lua's ``expire_due`` (``recover_stalled`` calls it too); one still fenced
        stays until its fence would lift."""
        expired = 0
        while budget and self.expiry:
            expires_ms, job_id = self.expiry[0]
            if not self._expiring(expires_ms, job_id):
                heapq.heappop(self.expiry)
            elif rules.retention_over(expires_ms, now):
                heapq.heappop(self.expiry)
                budget -= 1
                job = self.jobs[job_id]
                if job.fenced(now):  # kept while fenced (common.lua's expire_due says why)
                    job.expires_ms = job.fenced_until_ms + 1
                    heapq.heappush(self.expiry, (job.expires_ms, job_id))
                    continue
                expired += self._unindex(job)
            else:
                break
        if expired:
            self._count_trims("expired", expired)
            self.trims["expired_upto_ms"] = now

    def _expiring(self, expires_ms: int, job_id: str) -> bool:
        """The expiry entry is live: its job is still in a finished state's index, with it."""
        job = self.jobs.get(job_id)
        return job is not None and job.expires_ms == expires_ms

    def _unindex(self, job: Job) -> bool:
        """Retention takes ``job``: gone (True), or, a member of a batch, only out of its
        state's index (its batch keeps it: batches.py; False, not counted as removed)."""
        job.expires_ms = None
        if job.batch is None:
            self.delete(job.id)
            return True
        del self.by_state[job.state][job.id]
        return False

    def _count_trims(self, name: str, n: int) -> None:
        self.trims[name] = self.trims.get(name, 0) + n
