"""The memory backend's batches, as the Redis backend keeps them (common.lua's batch block,
batch_*.lua), step by step.

    enqueue_batch ──► BatchRecord (counters; sealed once every member is in)
    Store.move of a member ── batch_moved ──► counters; a final state appends (index,
                     state) to ``finished``, and the last one decides the follow-up
                     (``then_sent``) under the store's lock, into ``Store.outbox``
    the calling method, lock released ── send_follow_ups ──► the ``then`` queue's enqueue
    Store.trim ── sweep_batches ──► a batch ``batch_ttl_s`` past done goes, members too
    every read of a batch ── kept ──► BatchNotFound once it is past its ``batch_ttl_s``
                     (``expired_at``), swept yet or not (a member's fence holds the sweep)

Everything but ``send_follow_ups`` runs with ``Store.cond`` held.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sandboxq.backends import rules
from sandboxq.backends.base import BatchAction, NewJob
from sandboxq.errors import BatchIncomplete, ConfigError
from sandboxq.models import BatchProgress, JobState, now_ms

if TYPE_CHECKING:
    from sandboxq.backends.memory.store import Job, Store

FINAL = (JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED)


@dataclass(slots=True)
class BatchRecord:
    total: int
    then: str | None
    ttl_ms: int
    created_ms: int
    enqueued: int = 0
    sealed: bool = False
    counts: dict[JobState, int] = field(default_factory=lambda: dict.fromkeys(JobState, 0))
    finished: list[tuple[int, JobState]] = field(default_factory=list)
    done_ms: int | None = None
    then_sent: bool = False
    label: str | None = None
    #: While a cancel of the batch is under way: how many members claims cancelled for it
    #: (``Store.claim``; batch_each.lua's 'cancelling' mark)
    cancelling: int | None = None


@dataclass(frozen=True, slots=True)
class FollowUp:
    queue: str  # the then queue
    job: NewJob


def batch_moved(store: Store, job: Job, was: JobState, state: JobState, now: int) -> None:
    batch = store.batches.get(job.batch or "")
    if batch is None or was is state:
        return
    batch.counts[was] -= 1
    batch.counts[state] += 1
    if state in FINAL and was not in FINAL:
        batch.finished.append((int(job.id.rsplit(".", 1)[1]), state))
        check_done(store, job.batch or "", batch, now)
    elif was in FINAL and state not in FINAL:
        # a final member runs again: not done until it ends again, and readers are told
        batch.finished.append((int(job.id.rsplit(".", 1)[1]), JobState.WAITING))
        batch.done_ms = None


def check_done(store: Store, batch_id: str, batch: BatchRecord, now: int) -> None:
    finals = sum(batch.counts[s] for s in FINAL)
    if not batch.sealed or batch.done_ms is not None or finals != batch.total:
        return
    batch.done_ms = now
    if batch.then and not batch.then_sent:
        batch.then_sent = True
        summary = progress(store, batch_id, batch).summary()
        payload = json.dumps([[summary], {}]).encode()
        job_id = batch_id + rules.FOLLOW_UP_SUFFIX
        store.outbox.append(FollowUp(batch.then, NewJob(payload, "json", "{}", job_id)))
    store.cond.notify_all()


def progress(store: Store, batch_id: str, batch: BatchRecord) -> BatchProgress:
    c = batch.counts
    return BatchProgress(
        batch_id=batch_id,
        queue=store.queue,
        total=batch.total,
        enqueued=batch.enqueued,
        waiting=c[JobState.WAITING],
        active=c[JobState.ACTIVE],
        delayed=c[JobState.DELAYED],
        completed=c[JobState.COMPLETED],
        failed=c[JobState.FAILED],
        cancelled=c[JobState.CANCELLED],
        done=batch.done_ms is not None,
        then=batch.then,
        then_sent=None if batch.then is None else batch.then_sent,
        created_ms=batch.created_ms,
        done_ms=batch.done_ms,
        label=batch.label,
    )


def expired_at(batch: BatchRecord, now: int) -> int | None:
    """When ``batch`` expired (ms), or None while it is kept: the one test of expiry, for
    the sweep and every reader (common.lua's batch_expired)."""
    if batch.done_ms is None or batch.done_ms + batch.ttl_ms > now:
        return None
    return batch.done_ms + batch.ttl_ms


def kept(store: Store, batch_id: str, now: int) -> BatchRecord | None:
    """Batch ``batch_id`` (None: no such batch); ``BatchNotFound`` saying when it expired
    once it is past its ttl, whether the sweep has dropped it yet or not (a member's fence
    holds it), as batch_read.lua refuses it on Redis."""
    batch = store.batches.get(batch_id)
    if batch is not None and (at := expired_at(batch, now)) is not None:
        raise rules.batch_expired(store.queue, batch_id, at, batch.ttl_ms)
    return batch


def sweep_batches(store: Store, now: int) -> None:
    """Drop the batches past their ttl with their members (common.lua's sweep_batches),
    but not while a member's fence stands (``fenced_until``)."""
    gone = [bid for bid, b in store.batches.items() if expired_at(b, now) is not None]
    for bid in gone:
        if fenced_until(store, bid, now) is None:
            drop_batch(store, bid)


def fenced_until(store: Store, batch_id: str, now: int) -> int | None:
    """The latest fence of a member of ``batch_id`` cancelled while it ran whose fence
    still stands (ms), else None: until then its child may live, and its id must stay
    taken (design invariant 12)."""
    batch = store.batches[batch_id]
    fences = [
        job.fenced_until_ms
        for i in range(max(batch.total, batch.enqueued))
        if (job := store.jobs.get(f"{batch_id}.{i}")) is not None
        and job.batch == batch_id
        and job.fenced(now)
    ]
    return max(fences, default=None)


def drop_batch(store: Store, batch_id: str) -> None:
    batch = store.batches.pop(batch_id)
    for i in range(max(batch.total, batch.enqueued)):
        job = store.jobs.get(f"{batch_id}.{i}")
        if job is not None and job.batch == batch_id:  # never another job of that id
            del store.jobs[job.id]
            store.by_state[job.state].pop(job.id, None)
    store.cond.notify_all()


class Batches:
    """``Backend``'s batch calls in memory (mixed into ``MemoryBackend``)."""

    queue: str
    _store: Store

    if TYPE_CHECKING:  # MemoryBackend's and Management's

        def enqueue(self, jobs: Sequence[NewJob]) -> list[tuple[str, bool]]: ...

        def cancel_jobs(self, job_ids: Sequence[str], *, running: bool = True) -> int: ...

        def retry_failed(self, job_id: str) -> bool: ...

        def _register(self) -> None: ...

    def enqueue_batch(
        self,
        batch_id: str,
        jobs: Sequence[NewJob],
        *,
        then: str | None = None,
        first: int = 0,
        label: str | None = None,
    ) -> int:
        from sandboxq.backends.memory.store import DELAYED, WAITING, Job

        checked = [(new, rules.job_options(new.job_id or "", new)) for new in jobs]
        store = self._store
        with store.cond:
            now = now_ms()
            batch = store.batches.get(batch_id)
            if first == 0 and batch is not None:
                raise ConfigError(f"batch {batch_id!r} was not enqueued: it already exists")
            if first > 0 and batch is None:
                raise BatchIncomplete(
                    f"batch {batch_id!r} does not exist (its first part failed)",
                    batch_id=batch_id,
                    enqueued=0,
                    total=first + len(jobs),
                )
            taken = [new.job_id for new, _ in checked if new.job_id in store.jobs]
            if taken:
                raise ConfigError(
                    f"batch {batch_id!r} was not enqueued: job id {taken[0]!r} is taken"
                )
            if batch is None:
                batch = BatchRecord(first + len(jobs), then, store.batch_ttl_ms, now, label=label)
                store.batches[batch_id] = batch
            for new, options in checked:
                job_id = new.job_id or ""
                job = store.jobs[job_id] = Job(new, job_id, options, now, batch=None)
                job.due_ms = now + rules.ms(new.delay_s)
                state = DELAYED if job.due_ms > now else WAITING
                store.move(job, state, now)
                job.batch = batch_id
                batch.counts[state] += 1
                store.emit("added", job_id)
            batch.enqueued += len(checked)
            if batch.enqueued >= batch.total:
                batch.sealed = True
                check_done(store, batch_id, batch, now)
            self._register()  # in the queue index, as batch_enqueue.lua does
            return batch.enqueued

    def batch_progress(self, batch_id: str) -> BatchProgress | None:
        store = self._store
        with store.cond:
            batch = kept(store, batch_id, now_ms())
            return None if batch is None else progress(store, batch_id, batch)

    def batch_finished(
        self, batch_id: str, after: str, block_s: float | None = None
    ) -> tuple[str, list[tuple[int, JobState]]]:
        store = self._store
        start = int(after) if after.isdigit() else 0
        deadline = time.monotonic() + (block_s or 0.0)
        with store.cond:
            while True:
                batch = kept(store, batch_id, now_ms())
                rows = [] if batch is None else batch.finished[start : start + 1000]
                left = deadline - time.monotonic()
                if rows or block_s is None or left <= 0:
                    return str(start + len(rows)), rows
                store.cond.wait(left)

    def batch_each(self, batch_id: str, action: BatchAction) -> int | None:
        """As batch_each.lua: a cancel goes ``BATCH_CHUNK`` members a hold of the lock, and
        from its first hold on, a claim that pops a member it has not reached yet cancels
        that member instead of starting it (``Store.claim``), counted here."""
        store = self._store
        with store.cond:
            batch = kept(store, batch_id, now_ms())  # an expired one: no retry reopens it
            if batch is None:
                return None
            last = max(batch.total, batch.enqueued)
            ids = [f"{batch_id}.{i}" for i in range(last)]
            # only members: an id an enqueue stopped before may be another job's
            ids = [i for i in ids if (job := store.jobs.get(i)) and job.batch == batch_id]
            if action != "retry":
                batch.cancelling = 0
        if action == "retry":
            acted = sum(1 for job_id in ids if self.retry_failed(job_id))
            self.send_follow_ups()
            return acted
        acted = 0
        try:
            for start in range(0, len(ids), rules.BATCH_CHUNK):
                chunk = ids[start : start + rules.BATCH_CHUNK]
                acted += self.cancel_jobs(chunk, running=action == "cancel")
        finally:
            with store.cond:
                acted += batch.cancelling or 0
                batch.cancelling = None
        return acted

    def list_batches(self, limit: int = 50) -> list[BatchProgress]:
        store = self._store
        with store.cond:
            now = now_ms()
            live = [(bid, b) for bid, b in store.batches.items() if expired_at(b, now) is None]
            newest = list(reversed(live))[: max(0, limit)]
            return [progress(store, bid, batch) for bid, batch in newest]

    def forget_batch(self, batch_id: str) -> bool:
        """As on Redis: refused while a member may be started; waits while a member
        cancelled as it ran is still fenced (its worker confirms the child dead, or its
        old lease runs out)."""
        store = self._store
        with store.cond:
            while True:
                batch = store.batches.get(batch_id)
                if batch is None:
                    return False
                c = batch.counts
                if c[JobState.WAITING] + c[JobState.DELAYED] + c[JobState.ACTIVE] > 0:
                    raise ConfigError(
                        f"batch {batch_id!r} still has members waiting, delayed or active: "
                        "cancel it first"
                    )
                now = now_ms()
                until = fenced_until(store, batch_id, now)
                if until is None:
                    drop_batch(store, batch_id)
                    return True
                store.cond.wait((until - now + 1) / 1000)

    def send_follow_ups(self) -> None:
        """Enqueue the follow-ups decided under the lock, with it released: the ``then``
        queue's own lock is taken here, never inside this one's."""
        from sandboxq.backends.memory.backend import MemoryBackend

        store = self._store
        with store.cond:
            sends, store.outbox = store.outbox, []
        for send in sends:
            target = self if send.queue == self.queue else MemoryBackend.shared(send.queue)
            target.enqueue([send.job])
