"""The Backend protocol: where jobs live, and the contract every backend keeps.

One backend instance serves one queue. Every method is synchronous and thread-safe: the
worker calls ``renew`` from its heartbeat thread while its fetcher thread calls ``claim``
and its main thread ``finish``. The contract suite in ``tests.support.contract`` runs
against every backend.

Job lifecycle (states are ``JobState`` values):

    enqueue ──► waiting ◄──────────────┐ retry (no delay) / requeue / stalled recovery
       │  delay   ▲ promote (due)      │
       └──► delayed                    │
               waiting ── claim ──► active ── finish(complete) ──► completed
                                       │  ── finish(fail) / too many stalls ──► failed
                                       │  ── finish(retry, delay) ──► delayed
                                       └─ cancel ──► cancelled  (also from waiting/delayed)

Ownership (design invariant 1): ``claim`` gives each job a fresh lease token and an owner (the
worker id); ``renew`` and ``finish`` change a job only when the caller passes the owner
and token of its *current* lease. Anything else is rejected and changes nothing, so a
worker that lost its lease can neither resurrect the job nor extend another owner's lease.
Lease expiry is computed with the backend's own clock (Redis ``TIME``), never the caller's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Protocol

from sandboxq.backends.index import QUEUES_READ_CAP, QueueIndex, WorkerRegistry
from sandboxq.errors import BackendError
from sandboxq.finished import Trims
from sandboxq.models import (
    DEFAULT_MAX_INFRA_DEATHS,
    AttemptRecord,
    BatchProgress,
    JobInfo,
    JobOptions,
    JobState,
    Outcome,
)

FinishAction = Literal["complete", "retry", "fail", "requeue"]


class JobStanding(NamedTuple):
    """Where a job stands (``Backend.outcomes``): its state, the outcome of its last
    attempt (None: none yet), the attempts it was charged, and for an outcome of
    ``error`` the kind of error its record names (``rules.error_kind``: the type the
    handler raised, ``ValueError``, or ``other``; None for any other outcome)."""

    state: JobState
    outcome: Outcome | None
    attempts: int
    error_kind: str | None = None


BatchAction = Literal["cancel", "cancel_unstarted", "retry"]


# NewJob, Claimed and Ack are made once per job on the hot path: plain slotted dataclasses,
# read-only by convention, because a frozen one sets every field through
# object.__setattr__ and costs several times more to build (see pool/attempt.py).


@dataclass(slots=True)
class NewJob:
    payload: bytes  # encoded [args, kwargs]
    codec: str = "json"
    options_json: str = "{}"  # JobOptions.model_dump_json(exclude_defaults=True)
    job_id: str | None = None  # None: the backend assigns a unique id
    priority: int = 0  # higher first; FIFO within one priority
    delay_s: float = 0.0


@dataclass(slots=True)
class Claimed:
    """A job leased to the caller. ``attempt`` counts attempts charged so far, this one included
    (what the retry budget counts); ``number`` is its place in the job's history.

    ``claimed_at`` is ``time.monotonic()`` just before the request that claimed it was sent:
    the lease cannot have started earlier, so the caller's own deadline for it (the fence,
    design invariant 2) counts from there and always falls before the backend's.
    """

    id: str
    token: str
    payload: bytes
    codec: str
    #: Parsed once, where the claim's reply is read; a job whose stored options do not
    #: validate is failed there with the cause (``fail_malformed``) and never gets here.
    options: JobOptions
    attempt: int
    claimed_at: float
    #: How long it waited to be claimed since it was ready (enqueued, due, retried).
    wait_s: float | None = None
    #: Deaths of the pool's helpers or of a worker while it ran so far (design invariant
    #: 11): a job with any runs alone, and fails as ``poison`` at ``max_infra_deaths``.
    infra_deaths: int = 0
    #: The attempt's number in the job's history (``AttemptRecord.attempt``): counts every
    #: attempt started, across requeues and manual retries, where ``attempt`` counts only
    #: those the retry budget charges. 0: not known (the same as ``attempt``).
    number: int = 0
    #: How long ago it was enqueued, by the backend's clock at the claim: what is left of
    #: its ``deadline_s`` counts from ``claimed_at`` minus this.
    age_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Event:
    id: str  # position in the stream, usable as ``since``
    kind: str  # added, active, progress, completed, failed, retried, requeued, released,
    # stalled, cancelled, unfenced, purged
    job_id: str
    data: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class Ack:
    """One attempt's end, for ``finish_many`` (the arguments of ``finish``, as data)."""

    job_id: str
    token: str
    action: FinishAction
    attempt: AttemptRecord
    result: bytes | None = None
    error: str | None = None
    retry_delay_s: float = 0.0
    #: A helper of the pool died under the attempt: what died, in words. The job's count
    #: of such deaths goes up by one (design invariant 11; the worker, which read the
    #: count with its claim, decides requeue or ``poison``).
    infra_death: str | None = None


@dataclass(frozen=True, slots=True)
class FinishResult:
    accepted: bool  # False: the caller no longer owned the job; nothing was changed
    claimed: list[Claimed]  # the next jobs, when ``claim`` > 0 was asked for


class Backend(Protocol):
    """What a backend is. The backends here subclass it (last among their bases, so their
    own methods come first): a method one lacks is then an error where it is built, not
    where it is first called, and they share ``finish``."""

    queue: str

    def enqueue(self, jobs: Sequence[NewJob]) -> list[tuple[str, bool]]:
        """Add ``jobs`` in one round trip; returns ``(job_id, created)`` per job, in order.

        A ``job_id`` that already exists (in any state still retained) is not added again:
        its id comes back with ``created=False``. New jobs are ``waiting``, or ``delayed``
        until now + ``delay_s``. Emits ``added``; wakes one waiting ``claim`` per job.
        """
        ...

    def claim(
        self, worker_id: str, count: int, lease_s: float, wait_s: float = 0.0
    ) -> list[Claimed]:
        """Lease up to ``count`` jobs to ``worker_id`` for ``lease_s`` seconds.

        With ``count`` <= 0, returns nothing at once. Otherwise first promotes due delayed
        jobs to waiting (``rules.PROMOTE_LIMIT`` at most, due time first, then id). Takes
        the highest priority first, FIFO within a priority. Each claimed job becomes
        ``active`` with a fresh token, owner ``worker_id``, lease expiry = backend now +
        ``lease_s``, attempts + 1. Emits ``active``. A record too broken to claim is failed
        on the spot with a stated cause and skipped.

        With ``wait_s`` > 0 and nothing to claim, blocks until a job may be claimable (an
        enqueue, retry, requeue or recovery, or a delayed job falling due) or ``wait_s``
        passes, then claims once more: an idle worker gets a new job within milliseconds
        and costs the backend nothing while it waits (a blocking command, not a polling
        loop). It may return empty early (a spurious wake-up); it never misses a wake-up.
        """
        ...

    def stop_waiting(self, worker_id: str) -> None:
        """End the ``claim`` of ``worker_id`` that is waiting for a job (or, if none is, its
        next one) at once: it returns what it may claim without waiting, and nothing after
        a wait it did not finish. A stopping worker's fetcher then ends now rather than at
        its wait's end. Safe from any thread."""
        ...

    def renew(self, worker_id: str, leases: Sequence[tuple[str, str]], lease_s: float) -> list[str]:
        """Extend each ``(job_id, token)`` lease still owned by ``worker_id`` to backend now +
        ``lease_s``; returns the ids it could *not* renew (lease lost, expired and
        recovered, cancelled, finished). Uses a connection of its own where the backend has
        connections, so a busy claim loop cannot delay it."""
        ...

    def release(self, worker_id: str, leases: Sequence[tuple[str, str]]) -> list[str]:
        """Hand back ``(job_id, token)`` jobs ``worker_id`` claimed but never started: each
        goes back to ``waiting`` at its old place in line, its attempt uncharged, with no
        attempt record (nothing ran). Emits ``released``. Returns the ids it could not
        release (no longer owned by the caller; nothing changed for those)."""
        ...

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
        """End the current attempt of a job the caller owns, then claim up to ``claim`` more,
        all in one round trip.

        ``complete``: completed, ``result`` stored. ``fail``: failed with ``error``.
        ``retry``: delayed until now + ``retry_delay_s`` (waiting when 0). ``requeue``: back
        to waiting *without* charging the attempt (attempts - 1; graceful shutdown); an ack
        with ``infra_death`` also adds one to the job's ``infra_deaths``. Every
        action appends ``attempt`` to the job's history and records its outcome and error.
        A job entering a finished state is kept for its time to live (its own option, else
        the backend's: ``rules.Retention.ttl_ms``); then that state is trimmed to its count
        cap (the oldest first, ties by id) and jobs past their time go
        (``rules.retention_over``), a job whose fence stands excepted. Rejected
        (``accepted=False``, nothing changed) unless ``(worker_id, token)`` is the job's
        current lease, and then nothing is claimed either.

        Every backend's: ``finish_many`` of one ack (a backend subclassing ``Backend``
        inherits it).
        """
        ack = Ack(job_id, token, action, attempt, result, error, retry_delay_s)
        accepted, claimed = self.finish_many(worker_id, [ack], claim=claim, lease_s=lease_s)
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
        """``finish`` for several jobs, then claim up to ``claim``, all in one round trip.

        Each ack is checked and applied on its own, exactly as ``finish`` would; returns
        whether each was accepted, in order, and the jobs claimed.

        A lost reply: the tokens of the jobs claimed start with ``token_base`` (random when
        None) and a dot. A caller whose call failed without an answer calls again with the
        failed call's base as ``replay_of``: the jobs that call claimed, if it ran and the
        caller still owns them, come back first among the claimed (counted in ``claim``),
        instead of waiting a whole lease for recovery. Acks that call applied are then
        rejected: they can no longer be told apart from lost leases.
        """
        ...

    def record_progress(
        self, worker_id: str, job_id: str, token: str, fraction: float, message: str | None
    ) -> bool:
        """Store the job's latest progress and emit ``progress`` (an empty ``message`` is
        none); owner-checked like ``renew`` (False, nothing changed, when the caller no
        longer owns the job)."""
        ...

    def recover_stalled(
        self, max_infra_deaths: int = DEFAULT_MAX_INFRA_DEATHS
    ) -> list[tuple[str, str]]:
        """Jobs whose lease expired (backend clock, ``rules.lease_expired``), the earliest
        expiry first (then by id), ``rules.RECOVER_LIMIT`` at most: clear owner and token
        (late acks and renewals are then rejected), stalls + 1 and infra_deaths + 1 (the
        worker holding it died, or stopped renewing), the attempt recorded (outcome
        ``lease_lost``, with the child pid its worker last published and, with a pid, its
        start: ``rules.attempt_start``); over
        the job's ``max_stalls`` → ``failed`` with a stated cause (``rules.STALL_FAIL_TEXT``),
        else at ``max_infra_deaths`` → ``failed`` as ``poison`` (``rules.POISON_TEXT``,
        naming ``rules.WORKER_DEATH_TEXT``), else back to ``waiting`` at its old place in
        line, ready from now. Returns
        ``(job_id, new_state)``. Emits ``stalled``. Then finished jobs past their time to
        live go (``rules.TRIM_BUDGET`` at most), so an idle queue still lets them go."""
        ...

    def cancel(self, job_id: str) -> bool:
        """Cancel a job that has not finished: it becomes ``cancelled`` at once, its lease (if
        any) is revoked so the owner's renewals and acks are rejected, and the owner's
        ``watch_cancellations`` callback gets the id within milliseconds. False if the job
        is unknown or already finished.

        A job cancelled while active keeps a *fence*: its old owner and token, and the old
        lease's expiry. The cancelled attempt is appended to the history (outcome
        ``cancelled``; its pid and start as ``recover_stalled`` records them)."""
        ...

    def confirm_dead(self, worker_id: str, leases: Sequence[tuple[str, str]]) -> list[str]:
        """The old owner says the attempts of these ``(job_id, token)`` leases have ended
        (their children are dead): lifts each job's fence if it is that lease's. A job
        retried while fenced becomes ``waiting`` now. Returns the ids whose fence it lifted
        (others: no fence, or another lease's; nothing changed)."""
        ...

    def get(self, job_id: str) -> JobInfo | None:
        """The job's record and attempt history, or None if unknown (or trimmed). A record
        that cannot be parsed raises ``BackendError`` naming the job."""
        ...

    def get_result(self, job_id: str) -> bytes | None:
        """The encoded result of a completed job."""
        ...

    def get_many(self, job_ids: Sequence[str]) -> list[tuple[JobInfo | None, bytes | None]]:
        """``get`` and ``get_result`` of each job, in order, in one round trip."""
        ...

    def completed_results(self, job_ids: Sequence[str]) -> list[tuple[str, bytes | None] | None]:
        """The codec and encoded result (None: it stored none) of each job that is
        completed, None for one that is not (or no such job); in order, in one round trip,
        one light read a job: a batch's results read every member. ``SerializationError``
        for a result over the cap, as ``get_result``."""
        ...

    def outcomes(self, job_ids: Sequence[str]) -> list[JobStanding | None]:
        """Each job's state, outcome, attempts and kind of error (``JobStanding``), in
        order, in one round trip (None: no such job, or a record that does not say): one
        light read a job, for when the whole record is not needed (a batch's failures
        grouped by outcome and kind look at every failed member; a stopped run, at every
        line it did not write). The kind is taken where the error is stored, from its
        first ``rules.ERROR_KIND_HEAD`` bytes (none of an error over
        ``rules.ERROR_KIND_READ_CAP``): the error itself is never sent."""
        ...

    def get_arguments(self, job_id: str) -> bytes | None:
        """The job's encoded ``[args, kwargs]`` as stored (None: no such job);
        ``SerializationError`` when it is over the payload cap (it is not read)."""
        ...

    def counts(self) -> dict[JobState, int]:
        """Number of jobs in each state (every state present, zero included)."""
        ...

    def retry_failed(self, job_id: str) -> bool:
        """Put a failed or cancelled job back to waiting with its attempts reset (False:
        unknown, or neither failed nor cancelled).

        Fenced hand-over (design invariant 12): a job cancelled while active whose fence is still up
        (see ``cancel``) goes to ``delayed`` instead, due the first millisecond after the old
        lease's expiry, unless its old owner's ``confirm_dead`` lifts the fence sooner."""
        ...

    def purge(self, state: JobState) -> int:
        """Delete every job in ``state`` (not ``active``); returns how many. A job cancelled
        while running is kept while its fence stands (its old owner has neither confirmed
        the child dead, ``confirm_dead``, nor let the old lease run out): deleting it would
        let its id be enqueued afresh and run beside that child. A later purge takes it."""
        ...

    def list_jobs(self, state: JobState, limit: int = 100) -> list[str]:
        """Ids of jobs in ``state``, in the backend's order: waiting in claim order, delayed by
        due time, active by lease expiry, finished states newest first; ties in time by id
        (descending where newest first)."""
        ...

    def wait_for_finish(self, job_id: str, timeout_s: float) -> JobState | None:
        """Block until the job is finished (returns its state) or the timeout passes (None).
        Raises ``JobNotFound`` when the job does not exist, or stops existing while waited
        for (trimmed by retention, purged). The Redis backend answers from the finish
        event that woke it, which, read late, may be older than the call (the job ran
        again since): a caller that must be sure reads the job, as ``Job.result`` does."""
        ...

    def events(self, since: str | None = None, block_s: float | None = None) -> Iterator[Event]:
        """Events after ``since`` (None: from the oldest retained); with ``block_s``, waits up
        to that long for new ones before the iterator ends."""
        ...

    def new_events(
        self, after: Mapping[str, str | None], count: int
    ) -> dict[str, list[Event] | BackendError]:
        """The events of several queues of this server after each one's id (queue name to
        the last id read; None: from the oldest retained), at most ``count`` of each,
        without blocking: one read for all where the server allows (the dashboard
        follows hundreds of queues). A queue that cannot be read (a key changed by hand)
        gets its error in place of its events; raises ``BackendError`` when the server
        cannot be read."""
        ...

    def watch_cancellations(
        self, callback: Callable[[str, str | None], None]
    ) -> Callable[[], None]:
        """Call ``callback(job_id, lease_token)`` (on a backend thread) whenever a cancel
        revokes a job's lease; ``lease_token`` names that lease, so its owner kills that
        attempt and never a later one of the same job. A job cancelled while it held no
        lease has no attempt to stop and is not told (``None`` is no lease: ignore it).
        Returns a function that stops watching."""
        ...

    def register_worker(self, worker_id: str, info: dict[str, Any], ttl_s: float) -> None:
        """Publish (or refresh) a live worker's description; it vanishes after ``ttl_s``.
        The child pids it lists are noted on the jobs it still holds in those attempts
        (``rules.child_pids``), so a lease found lost after it vanished keeps its pid."""
        ...

    def unregister_worker(self, worker_id: str) -> None: ...

    def workers(self) -> list[dict[str, Any]]:
        """Descriptions of the live workers (each includes its ``worker_id``): those of
        ``worker_registry()``."""
        ...

    def worker_registry(self) -> WorkerRegistry:
        """The live workers as ``workers()``, and whether a read cap left entries of the
        registry unread (``WorkerRegistry.note`` says so). Bounded work however many names
        the registry holds; entries with no live worker behind them never hide one
        within ``WORKERS_SCAN_CAP``."""
        ...

    def recent_durations(self, limit: int) -> list[tuple[str, float]]:
        """(outcome, run seconds) of the last attempt of up to ``limit`` of the most
        recently finished jobs (completed, then failed), from their attempt records."""
        ...

    def queue_index(self, limit: int = QUEUES_READ_CAP) -> QueueIndex:
        """Every queue of this backend's server (or process) that had a job enqueued or a
        worker registered: the index (backends/index.py), at most ``limit`` entries read,
        entries that are not queue names ignored. Never a scan of keys."""
        ...

    def sibling(self, queue: str) -> Backend:
        """The backend of another ``queue`` on the same server, with this one's options,
        sharing its connections (one dashboard shows hundreds of queues): close it
        before this one."""
        ...

    def close(self) -> None: ...

    # -- batches (design invariant 14) ----------------------------------------------------

    def enqueue_batch(
        self,
        batch_id: str,
        jobs: Sequence[NewJob],
        *,
        then: str | None = None,
        first: int = 0,
        label: str | None = None,
    ) -> int:
        """Add ``jobs`` as members ``first``, ``first + 1``... of batch ``batch_id`` of
        ``len(jobs)`` members (``first`` > 0: a later part of one made by an earlier call;
        the caller set each job's id to ``models.member_id``). Returns how many members the
        batch has now. The call that brings it to its total seals it: only a sealed batch is
        ever done. Counters per state are kept by every call that moves a member, so
        ``batch_progress`` is one O(1) read.

        When the last member reaches a final state the batch is done; if ``then`` names a
        queue, one job (id ``<batch_id>.then``, its single argument the summary) is enqueued
        there in the same atomic step, exactly once: a member retried after that makes the
        batch not done, and done again it sends nothing. Members are never trimmed by
        retention, nor purged, while the batch is kept: until ``batch_ttl_s`` after it is
        done, or ``forget_batch``.

        ``label``: text kept with the batch (``BatchProgress.label``), set by the call that
        makes it (``rules.MAX_LABEL_BYTES`` at most: checked by the caller).

        Raises ``ConfigError`` (nothing added) when the batch exists already or a member id
        is taken, and ``BatchIncomplete`` when only some members were added.
        """
        ...

    def batch_progress(self, batch_id: str) -> BatchProgress | None:
        """The batch's counts in one O(1) read; None if there is no such batch.
        ``BatchNotFound`` (with ``expired_ms``) once it is past its ``batch_ttl_s``, swept
        or not: retention deletes it a few members at a time, and no reader may see a
        batch it has begun on (the same for ``batch_finished`` and ``batch_each``, in the
        same atomic read; ``list_batches`` leaves it out)."""
        ...

    def batch_finished(
        self, batch_id: str, after: str, block_s: float | None = None
    ) -> tuple[str, list[tuple[int, JobState]]]:
        """Members that reached a final state, in the order they did, after cursor ``after``
        ("0": from the start; any handle in any process reads the same sequence): the new
        cursor and ``(index, state)`` pairs. A member that leaves its final state (retried)
        appears with state WAITING, and again when it ends again. With ``block_s``, waits
        up to that long for one when there is none."""
        ...

    def batch_each(self, batch_id: str, action: BatchAction) -> int | None:
        """``cancel`` (waiting and delayed members never start; running ones are cancelled
        with the fenced hand-over of ``cancel``), ``cancel_unstarted`` (the same for the
        waiting and delayed members only: the running ones go on) or ``retry`` (failed and
        cancelled members, as ``retry_failed``) every member; returns how many it acted
        on, None if there is no such batch. Bounded work per backend call
        (``rules.BATCH_CHUNK`` members)."""
        ...

    def list_batches(self, limit: int = 50) -> list[BatchProgress]:
        """The newest ``limit`` batches kept, newest first, each as ``batch_progress``
        reads it: ``limit`` + 1 reads at most, whatever the number of batches."""
        ...

    def forget_batch(self, batch_id: str) -> bool:
        """Delete the batch and its members now (False: no such batch). Raises
        ``ConfigError`` while a member is waiting, delayed or active: cancel it first."""
        ...

    # -- reads for the dashboard (sandboxq.web): bounded work, whatever the queue's size --

    def job_page(
        self,
        state: JobState,
        cursor: str | None = None,
        limit: int = 50,
        outcome: str | None = None,
    ) -> JobPage:
        """Up to ``limit`` jobs in ``state`` with their summaries, in one round trip.

        Order: waiting in claim order, delayed by due time, active by lease expiry,
        finished states newest first. ``cursor`` is a previous page's ``next_cursor``:
        the next page starts right after that page's last job, so jobs that come and go
        meanwhile never shift a page (no job is skipped or shown twice because others
        left). With ``outcome``, only jobs whose last outcome is that one, looking at no
        more than ``PAGE_SCAN`` jobs per call: a page may then come back short with a
        ``next_cursor`` that goes on looking. ``next_cursor`` is None at the end.
        At most ``MAX_PAGE`` jobs a page; a job's error is clipped to ``ERROR_CLIP`` bytes.
        """
        ...

    def job_detail(self, job_id: str) -> JobDetail | None:
        """``get`` plus the job's encoded arguments, result (completed jobs only) and
        latest progress, in one round trip; None if the job is unknown (or trimmed)."""
        ...

    def summary(self) -> QueueSummary:
        """The queue's line of the dashboard's overview, in one round trip."""
        ...

    def retention_trims(self) -> Trims:
        """What retention has removed from the queue so far (by count cap, by age): the
        worker logs and counts new cap trims from it, ``JobNotFound`` quotes it."""
        ...


#: Jobs ``job_page`` looks at per call when it filters by outcome.
PAGE_SCAN = 1000
#: Bytes of a job's error (UTF-8) a page summary carries.
ERROR_CLIP = 300
#: Most jobs one ``job_page`` returns, whatever ``limit`` asks for.
MAX_PAGE = 500
#: Priorities ``summary`` looks at for the oldest job first in line, highest first.
PRIORITY_BANDS = 32


@dataclass(frozen=True, slots=True)
class QueueSummary:
    """One queue's line of the dashboard's overview (``Backend.summary``)."""

    counts: dict[JobState, int]
    #: ``created_ms`` of the job first in line at each priority, the oldest of those (at
    #: most PRIORITY_BANDS priorities looked at); None when nothing waits.
    oldest_waiting_ms: int | None
    #: Live workers among the first WORKERS_READ_CAP registered, and whether more are.
    workers: int
    workers_capped: bool
    #: (minute start ms, jobs waiting) for the last DEPTH_MINUTES minutes a worker
    #: sampled, oldest first: each samples at its registry refresh (``register_worker``),
    #: so minutes without a live worker have none. None when the history cannot be read
    #: (its key changed by hand).
    depth: list[tuple[int, int]] | None


@dataclass(frozen=True, slots=True)
class JobSummary:
    """One row of a ``job_page``: what a list of jobs shows."""

    id: str
    state: str  # a JobState value, or what an edited record holds instead
    attempts: int | None
    outcome: str | None
    error: str | None  # clipped to ERROR_CLIP bytes (rules.clip_error)
    created_ms: int | None
    finished_ms: int | None


@dataclass(frozen=True, slots=True)
class JobPage:
    jobs: list[JobSummary]
    next_cursor: str | None  # None: nothing after this page
    scanned: int  # jobs looked at to fill it (more than len(jobs) with an outcome filter)


@dataclass(frozen=True, slots=True)
class JobDetail:
    """A job in full, for its page: the record, its payloads as stored, its progress."""

    info: JobInfo
    payload: bytes | None  # encoded [args, kwargs], in info.codec
    result: bytes | None  # encoded result of a completed job
    progress: float | None
    progress_message: str | None
