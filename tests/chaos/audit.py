"""The audit every chaos test (and the soak) ends with, and the event tally it reads.

Tally ── follows the events stream, across Redis restarts ──► events per kind per job
audit(): every job completed exactly once (one accepted ack: one `completed` event and
         one `complete` in its history) or failed with a stated cause; none missing;
         no two executions of one job overlapping in the ledger; at most one accepted
         ack per lease (acks in the history <= `active` events); every execution in the
         ledger present in the history (executions <= attempt records)
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sandboxq import Queue
from sandboxq.errors import BackendError
from sandboxq.models import Action, JobInfo, JobState
from tests.support.ledger import Execution, describe, overlaps, read_ledger

FINISHED_KINDS = ("completed", "failed", "cancelled")


class Tally(threading.Thread):
    """Follows the queue's events stream, across Redis restarts, counting events per job."""

    def __init__(self, queue_name: str, url: str) -> None:
        super().__init__(name="chaos-tally", daemon=True)
        self._queue = Queue(queue_name, url=url)
        self.counts: dict[str, Counter[str]] = {}
        self.finished: set[str] = set()
        self.causes: dict[str, str] = {}  # job id -> error of its `failed` event
        self.errors = 0
        self._after: str | None = None
        self._lock = threading.Lock()
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                for event in self._queue.events(since=self._after, block_s=0.5):
                    self._after = event.id
                    with self._lock:
                        self.counts.setdefault(event.kind, Counter())[event.job_id] += 1
                        if event.kind in FINISHED_KINDS:
                            self.finished.add(event.job_id)
                        if event.kind == "failed":
                            self.causes[event.job_id] = event.data.get("error", "")
                    if self._halt.is_set():
                        break
            except BackendError:
                self.errors += 1
                self._halt.wait(0.2)

    def count(self, kind: str, job_id: str) -> int:
        with self._lock:
            return self.counts.get(kind, Counter())[job_id]

    def total(self, kind: str) -> int:
        with self._lock:
            return sum(self.counts.get(kind, Counter()).values())

    def all_finished(self, ids: Sequence[str]) -> bool:
        with self._lock:
            return self.finished.issuperset(ids)

    def stop(self) -> None:
        self._halt.set()
        self.join(10)
        self._queue.close()


@dataclass
class Audit:
    completed: int = 0
    failed: dict[str, str] = field(default_factory=dict)  # job id -> stated cause
    outcomes: Counter[str] = field(default_factory=Counter)  # over every attempt record
    stalls: int = 0
    executions: int = 0
    overlaps: int = 0
    trimmed: int = 0  # judged by their events alone: retention had deleted their record

    def line(self) -> str:
        return (
            f"{self.completed} completed, {len(self.failed)} failed, {self.executions} "
            f"executions, {self.stalls} stalls, attempt outcomes {dict(self.outcomes)}"
        )


def audit(
    queue: Queue, ids: Sequence[str], tally: Tally, ledger: Path, *, trimmed: bool = False
) -> Audit:
    """Check every invariant the chaos tests promise; returns what it counted.

    With ``trimmed``, a job whose record retention has deleted is judged by the events
    the tally saw (a long soak outlives the retained history); otherwise it is lost.
    """
    result = Audit()
    problems: list[str] = []
    runs = read_ledger(ledger)
    result.executions = sum(len(r) for r in runs.values())
    crossing = overlaps(runs)
    result.overlaps = len(crossing)
    if crossing:
        problems.append("double execution:\n" + describe(crossing))
    for job_id in ids:
        info = queue.backend.get(job_id)
        if info is not None:
            problem = _check_record(info, tally, runs.get(job_id, []), result)
        elif trimmed:
            problem = _check_events(job_id, tally, result)
        else:
            problem = f"job {job_id} is lost"
        if problem:
            problems.append(problem)
    assert not problems, "\n".join(problems[:20]) + f"\n({len(problems)} problems)"
    return result


def _check_record(info: JobInfo, tally: Tally, runs: list[Execution], result: Audit) -> str:
    job_id = info.id
    # Only an attempt that held a lease records a child's pid (its ack, its cancel, its
    # lost lease): never more of them than leases.
    acked = sum(1 for h in info.history if h.pid is not None)
    leases = tally.count("active", job_id)
    if acked > leases:
        return f"job {job_id}: {acked} acks accepted for {leases} leases"
    if len(runs) > len(info.history):
        return (
            f"job {job_id}: {len(runs)} executions in the ledger but "
            f"{len(info.history)} attempts in its history"
        )
    result.stalls += info.stalls
    result.outcomes.update(h.outcome.value for h in info.history)
    completes = [h for h in info.history if h.action is Action.COMPLETE]
    if info.state is JobState.COMPLETED:
        result.completed += 1
        events = tally.count("completed", job_id)
        if len(completes) != 1 or events != 1:
            return (
                f"job {job_id} completed {len(completes)} times by its history, "
                f"{events} by the events stream"
            )
        if completes[0].pid not in {e.pid for e in runs if e.finished}:
            return f"job {job_id} completed by pid {completes[0].pid}, which never finished it"
    elif info.state is JobState.FAILED:
        result.failed[job_id] = info.error or ""
        if not info.error:
            return f"job {job_id} failed without a cause"
        if completes or tally.count("completed", job_id):
            return f"job {job_id} failed after being completed"
    else:
        return f"job {job_id} ended {info.state.value}"
    return ""


def _check_events(job_id: str, tally: Tally, result: Audit) -> str:
    result.trimmed += 1
    result.stalls += tally.count("stalled", job_id)
    completed, failed = tally.count("completed", job_id), tally.count("failed", job_id)
    if (completed, failed) == (1, 0):
        result.completed += 1
    elif (completed, failed) == (0, 1):
        result.failed[job_id] = tally.causes.get(job_id, "")
        if not result.failed[job_id]:
            return f"job {job_id} failed without a cause"
    else:
        return f"job {job_id}: {completed} completed and {failed} failed events, no record"
    return ""
