"""``MemoryBackend``: the in-process backend's producer and worker calls (enqueue, claim,
renew, release, finish, progress) and its worker registry, composed with the rest.

    MemoryBackend ─┬─ store.Store   the jobs and their transitions, one lock (cond)
                   ├─ manage.py     recover_stalled, cancel, retry_failed, confirm_dead, purge
                   ├─ reads.py      get, counts, list_jobs and the dashboard's pages
                   └─ waits.py      wait_for_finish, events, watch_cancellations
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from sandboxq.backends import rules
from sandboxq.backends.base import Ack, Backend, Claimed, Event, NewJob, QueueSummary
from sandboxq.backends.index import (
    DEPTH_MINUTES,
    QUEUES_READ_CAP,
    WORKERS_READ_CAP,
    QueueIndex,
    WorkerRegistry,
    valid_names,
)
from sandboxq.backends.memory.batches import Batches
from sandboxq.backends.memory.manage import Management
from sandboxq.backends.memory.reads import Reads
from sandboxq.backends.memory.store import (
    COMPLETED,
    DELAYED,
    FAILED,
    WAITING,
    Job,
    Store,
)
from sandboxq.backends.memory.waits import Waits
from sandboxq.backends.rules import Retention
from sandboxq.errors import BackendError
from sandboxq.models import JobState, check_queue_name, now_ms


class MemoryBackend(Management, Reads, Waits, Batches, Backend):
    """All of one queue's jobs in this process. ``shared(queue)`` is the instance every
    ``memory://`` Queue and worker of the process uses; tests build private instances.
    Options: those of ``rules.Retention``."""

    _registry: ClassVar[dict[str, MemoryBackend]] = {}
    _registry_lock: ClassVar[threading.Lock] = threading.Lock()
    #: The queue index of this process (backends/index.py): queues that had a job
    #: enqueued or a worker registered, as the Redis scripts keep theirs.
    _index: ClassVar[set[str]] = set()

    def __init__(self, queue: str, **options: Any) -> None:
        self.queue = check_queue_name(queue)
        self._store = Store(Retention(**options), queue)
        self._workers: dict[str, tuple[dict[str, Any], int]] = {}
        self._depth: dict[int, int] = {}  # minute -> jobs waiting (summary)
        self._not_waiting: set[str] = set()  # workers whose next claim waits not (stop_waiting)

    @classmethod
    def shared(cls, queue: str, **options: Any) -> MemoryBackend:
        """The process-wide backend for ``queue``. Options apply when it is first created;
        later callers get that instance, since jobs already live in it, and the retention
        they give applies from then on (as on Redis, where the worker finishing a job
        applies its own: a worker's settings are the queue's)."""
        with cls._registry_lock:
            backend = cls._registry.get(queue)
            if backend is None:
                backend = cls._registry[queue] = cls(queue, **options)
            elif options:
                # a misspelt or invalid option is an error all the same
                retention = Retention(**options)
                with backend._store.cond:
                    backend._store.keep(retention)
            return backend

    # -- producers ---------------------------------------------------------------------------

    def enqueue(self, jobs: Sequence[NewJob]) -> list[tuple[str, bool]]:
        # Validate the whole batch first, so a bad job adds none of it.
        ids = [new.job_id or uuid.uuid4().hex for new in jobs]
        pairs = zip(jobs, ids, strict=True)
        checked = [(new, job_id, rules.job_options(job_id, new)) for new, job_id in pairs]
        added: list[tuple[str, bool]] = []
        store = self._store
        with store.cond:
            now = now_ms()
            for new, job_id, options in checked:
                if job_id in store.jobs:
                    added.append((job_id, False))
                    continue
                job = store.jobs[job_id] = Job(new, job_id, options, now)
                job.due_ms = now + rules.ms(new.delay_s)
                store.move(job, DELAYED if job.due_ms > now else WAITING, now)
                store.emit("added", job_id)
                added.append((job_id, True))
        if jobs:
            self._register()  # in the queue index, as enqueue.lua does
        return added

    # -- leases ------------------------------------------------------------------------------

    def claim(
        self, worker_id: str, count: int, lease_s: float, wait_s: float = 0.0
    ) -> list[Claimed]:
        if count <= 0:  # nothing asked for: nothing promoted, nothing waited for
            return []
        deadline = time.monotonic() + wait_s
        store = self._store
        with store.cond:
            while not (claimed := store.claim(worker_id, count, lease_s, now_ms())):
                if worker_id in self._not_waiting:  # stop_waiting: once
                    self._not_waiting.discard(worker_id)
                    break
                left = deadline - time.monotonic()
                due_ms = store.next_due_ms()
                if due_ms is not None:
                    left = min(left, (due_ms - now_ms()) / 1000)
                if left <= 0:
                    break
                # Jobs left waiting after a claim that took none: it stopped at its budget
                # of a cancelled batch's members (Store.claim); it goes on at once.
                store.cond.wait(0 if store.waiting else left)
        if store.outbox:  # a batch those members finished is done: its follow-up
            self.send_follow_ups()
        return claimed

    def stop_waiting(self, worker_id: str) -> None:
        with self._store.cond:
            self._not_waiting.add(worker_id)
            self._store.cond.notify_all()

    def renew(self, worker_id: str, leases: Sequence[tuple[str, str]], lease_s: float) -> list[str]:
        def extend(job_id: str, token: str, now: int) -> bool:
            job = self._store.owned(worker_id, job_id, token)
            if job is not None:
                job.lease_ms = now + rules.lease_ms(lease_s)
            return job is not None

        return self._store.per_lease(leases, extend)[1]

    def release(self, worker_id: str, leases: Sequence[tuple[str, str]]) -> list[str]:
        store = self._store

        def hand_back(job_id: str, token: str, now: int) -> bool:
            job = store.owned(worker_id, job_id, token)
            if job is None:
                return False
            job.attempts = max(0, job.attempts - 1)
            store.move(job, WAITING, now, keep_place=True)
            store.emit("released", job_id)
            return True

        return store.per_lease(leases, hand_back)[1]

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
        rules.check_actions(ack.action for ack in acks)
        store = self._store
        with store.cond:
            now = now_ms()
            replayed = store.replay(worker_id, replay_of) if replay_of else []
            accepted = [self._finish_one(worker_id, ack, now) for ack in acks]
            count = claim - len(replayed)
            claimed = replayed
            if not ((len(acks) == 1 and not accepted[0]) or count <= 0):
                claimed = replayed + store.claim(worker_id, count, lease_s, now, token_base)
        if store.outbox:  # a batch this finished is done: its follow-up (batches.py)
            self.send_follow_ups()
        return accepted, claimed

    def _finish_one(self, worker_id: str, ack: Ack, now: int) -> bool:
        store, job_id, action = self._store, ack.job_id, ack.action
        job = store.owned(worker_id, job_id, ack.token)
        if job is None:
            return False
        attempt, error = ack.attempt, ack.error
        if ack.infra_death is not None:  # the worker decided requeue or poison itself
            job.infra_deaths += 1
        store.record(job, attempt, error)
        outcome = attempt.outcome.value
        if action == "complete":
            job.result = ack.result
            store.move(job, COMPLETED, now)
            store.emit("completed", job_id, outcome=outcome)
        elif action == "fail":
            store.move(job, FAILED, now)
            store.emit("failed", job_id, outcome=outcome, error=error or "")
        elif action == "retry":
            job.due_ms = now + rules.ms(ack.retry_delay_s)
            store.move(job, DELAYED if job.due_ms > now else WAITING, now)
            delay_ms = str(job.due_ms - now)
            store.emit("retried", job_id, outcome=outcome, error=ack.error or "", delay_ms=delay_ms)
        else:  # requeue: interrupted by a shutdown, not by the job, so it is not charged
            job.uncharged += 1  # its number stays used: the record was written
            store.move(job, WAITING, now, keep_place=True)
            store.emit("requeued", job_id, outcome=outcome)
        return True

    def record_progress(
        self, worker_id: str, job_id: str, token: str, fraction: float, message: str | None
    ) -> bool:
        with self._store.cond:
            if self._store.owned(worker_id, job_id, token) is None:
                return False
            data = {"fraction": repr(float(fraction))}
            if message:  # an empty message is none (progress.lua)
                data["message"] = message
            self._store.emit("progress", job_id, **data)
            return True

    # -- workers -----------------------------------------------------------------------------

    def register_worker(self, worker_id: str, info: dict[str, Any], ttl_s: float) -> None:
        self._register()
        with self._store.cond:
            # the depth chart's sample for this minute, as depth.lua takes it
            minute = now_ms() // 60_000
            self._depth[minute] = len(self._store.by_state[JobState.WAITING])
            for old in [m for m in self._depth if m <= minute - DEPTH_MINUTES]:
                del self._depth[old]
            ttl_ms = rules.lease_ms(ttl_s)
            record = {**info, "worker_id": worker_id, "ttl_ms": ttl_ms}
            self._workers[worker_id] = (record, now_ms() + ttl_ms)
            # its children's pids on the jobs it still holds in those attempts (child_pids.lua)
            for job_id, number, pid, started_ms in rules.child_pids(info):
                job = self._store.jobs.get(job_id)
                running = None if job is None else (job.state, job.owner, job.attempts)
                if job is not None and running == (JobState.ACTIVE, worker_id, number):
                    job.child_pid, job.child_started_ms = pid, started_ms

    def unregister_worker(self, worker_id: str) -> None:
        with self._store.cond:
            self._workers.pop(worker_id, None)
            self._not_waiting.discard(worker_id)

    def running_child(self, job_id: str, worker_id: str | None) -> rules.RunningChild:
        """The child running ``job_id`` (its pid, when it took the job), from its worker's
        registry record (records.running_attempt); the caller holds the store's lock."""
        entry = self._workers.get(worker_id) if worker_id is not None else None
        return (
            rules.running_child(entry[0], job_id) if entry is not None else rules.RunningChild(None)
        )

    def attempt_child(self, job: Job) -> rules.RunningChild:
        """The child running active ``job``'s attempt, for the record of an attempt that
        ends without its worker (common.lua's running_attempt): from its owner's registry
        record, else the pid that record last noted on the job (a dead owner's record is
        gone by the time its lease is found lost). The caller holds the store's lock."""
        child = self.running_child(job.id, job.owner)
        if child.pid is not None:
            return child
        return rules.RunningChild(job.child_pid, job.child_started_ms)

    def workers(self) -> list[dict[str, Any]]:
        with self._store.cond:
            now = now_ms()
            for worker_id, (_, until) in list(self._workers.items()):
                if rules.lease_expired(until, now):
                    del self._workers[worker_id]
            # age_ms as on Redis: how long ago the record was written, by this clock
            return [
                {**record, "age_ms": max(0, now - (until - record["ttl_ms"]))}
                for record, until in (self._workers[w] for w in sorted(self._workers))
            ]

    def worker_registry(self) -> WorkerRegistry:
        return WorkerRegistry(self.workers(), capped=False)  # one process's: no cap to hit

    def _register(self) -> None:
        with MemoryBackend._registry_lock:
            MemoryBackend._index.add(self.queue)

    def summary(self) -> QueueSummary:
        workers = self.workers()
        with self._store.cond:
            depth = sorted((m * 60_000, n) for m, n in self._depth.items())
        return QueueSummary(
            self.counts(),
            self._oldest_waiting_ms(),
            min(len(workers), WORKERS_READ_CAP),
            len(workers) > WORKERS_READ_CAP,
            depth,
        )

    def recent_durations(self, limit: int) -> list[tuple[str, float]]:
        with self._store.cond:
            jobs = self._store.jobs
            finished = [
                jobs[job_id]
                for state in (JobState.COMPLETED, JobState.FAILED)
                for job_id in self._store.by_state[state]
            ]
            finished.sort(key=lambda job: job.finished_ms or 0, reverse=True)
            last = [job.history[-1] for job in finished[:limit] if job.history]
        return [
            (a.outcome.value, max(0, a.ended_ms - a.started_ms) / 1000)
            for a in last
            if a.started_ms is not None and a.ended_ms is not None
        ]

    def queue_index(self, limit: int = QUEUES_READ_CAP) -> QueueIndex:
        with MemoryBackend._registry_lock:
            entries = sorted(MemoryBackend._index)
            backends = dict(MemoryBackend._registry)
        # A queue whose jobs are all gone (purged, expired) and whose workers stopped is
        # no queue any more, as on Redis (unbacked), and is left out before the cap: a
        # long-lived process (a test run, a notebook) made hundreds, which hid the live
        # ones behind a page's cap. Cheap here: the registry is in this process.
        live = [n for n in entries if (b := backends.get(n)) is not None and b._holds_anything()]
        names, ignored = valid_names(live[:limit])
        unbacked = len(entries) - len(live)
        return QueueIndex(names, len(entries) - unbacked, ignored)

    def _holds_anything(self) -> bool:
        with self._store.cond:
            return bool(self._store.jobs) or bool(self._workers)

    def sibling(self, queue: str) -> MemoryBackend:
        """This process's backend of ``queue`` (this one for its own queue)."""
        return self if queue == self.queue else MemoryBackend.shared(queue)

    def new_events(
        self, after: Mapping[str, str | None], count: int
    ) -> dict[str, list[Event] | BackendError]:
        return {
            queue: list(itertools.islice(self.sibling(queue).events(last), count))
            for queue, last in after.items()
        }

    def close(self) -> None:
        """Nothing to close; the jobs stay, since a shared instance outlives any one user."""
