"""Finish notifications for any number of waiters: one listener per process and queue.

    Job.result ── wait_for_finish ─┐                         ┌─ thread (finish_listener.py)
    batch.as_completed ── batch_   ├─ Board: waiters by job ─┤   or task per event loop
                          finished ┘   id and by batch id    └─ (aio_finishes.py)
                                          ▲                        │ XREAD BLOCK on the
                                          └── wake(job or batch) ◄─┘ queue's events stream,
                                                                     one connection

A waiter registers on its queue's ``Board`` *before* it reads the job's state, and waits
for a wake after that read: a finish that lands between the two is either seen by the read
or carried by an event the listener reads after the registration, so no wake-up is lost.
A wake says "look again", with the final state the event named when it was a finish:
the waiter then returns that state without reading it (one round trip less per woken
waiter), and ``result()`` reads the job's record in any case and waits on if it is not
final after all (an event read late may be older than the wait: the job ran again since).
A wake for anything else makes the waiter read the state itself.

The listener reads the stream from where it last was. When it cannot know that it saw
every entry since — the stream was trimmed past its cursor (``trimmed``), or its
connection broke (Redis restarted) — it wakes every waiter to look again. When its board
is empty after a read it stops and closes its connection; the next waiter starts another.

How many connections: one per (process, queue) for the sync API, one per (process, queue,
event loop) for ``sandboxq.aio``, whatever the number of waiters (``CLIENT_NAME`` names
them in ``CLIENT LIST``). This module holds what both listeners share and decides, without
I/O: the board, what an entry means, and the gap check.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Generic, Protocol, TypeVar

from sandboxq.backends.redis import records
from sandboxq.models import JobState

log = logging.getLogger(__name__)

#: The name each listener's connection gives itself (``CLIENT SETNAME``).
CLIENT_NAME = "sandboxq-finishes"
#: How long one listener read blocks: a listener with no waiters left stops within this.
LISTEN_BLOCK_S = 1.0
#: Stream entries one read takes at most.
LISTEN_COUNT = 1000
#: How long a listener whose connection broke waits before it tries again.
RETRY_S = 0.2
#: Events that cannot change whether a job (or a batch member) is final: no wake.
QUIET_KINDS = frozenset({b"added", b"active", b"progress"})

#: A test hook, called with the job id after a waiter's first read of the state and before
#: it waits: a test finishes the job there, forcing the race the registration order covers.
after_first_read: Callable[[str], None] | None = None
#: A test hook, called by the sync listener's thread before each read of the stream: a
#: test holds the listener there to make it read late (a trimmed gap, a stale finish).
before_listen_read: Callable[[], None] | None = None


#: Events that make a job final, and the state each says it is in.
FINAL_KINDS = {
    b"completed": JobState.COMPLETED,
    b"failed": JobState.FAILED,
    b"cancelled": JobState.CANCELLED,
}


class Wakeable(Protocol):
    def wake(self, state: JobState | None) -> None:
        """Look again; ``state``: the final state an event said the job reached (None:
        read it)."""


W = TypeVar("W", bound=Wakeable)


class Waiter:
    """One waiter: woken by its listener, it looks again. The sync and asyncio waiters
    (finish_listener.py, aio_finishes.py) add how a wake reaches them (``_signal``) and
    how they wait for one."""

    __slots__ = ("_told",)

    def __init__(self) -> None:
        self._told: JobState | None = None

    def wake(self, state: JobState | None) -> None:
        self._told = state or self._told
        self._signal()

    def _signal(self) -> None:
        raise NotImplementedError

    def told(self) -> JobState | None:
        """The final state the last wakes named (taken), if any did."""
        state, self._told = self._told, None
        return state


_boards: weakref.WeakSet[Any] = weakref.WeakSet()
_boards_lock = threading.Lock()


class Board(Generic[W]):
    """The waiters of one queue, by job id and by batch id. Thread-safe: the sync waiters
    register from their own threads while the listener thread wakes them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[str, list[W]] = {}
        self._batches: dict[str, list[W]] = {}
        with _boards_lock:
            _boards.add(self)

    def __len__(self) -> int:
        with self._lock:
            return sum(map(len, self._jobs.values())) + sum(map(len, self._batches.values()))

    def add_job(self, job_id: str, waiter: W) -> None:
        with self._lock:
            self._jobs.setdefault(job_id, []).append(waiter)

    def add_batch(self, batch_id: str, waiter: W) -> None:
        with self._lock:
            self._batches.setdefault(batch_id, []).append(waiter)

    def remove_job(self, job_id: str, waiter: W) -> None:
        with self._lock:
            _discard(self._jobs, job_id, waiter)

    def remove_batch(self, batch_id: str, waiter: W) -> None:
        with self._lock:
            _discard(self._batches, batch_id, waiter)

    def empty(self) -> bool:
        with self._lock:
            return not self._jobs and not self._batches

    def named_by(
        self, entries: Iterable[tuple[bytes, dict[bytes, bytes]]]
    ) -> list[tuple[W, JobState | None]]:
        """The waiters of every job (and its batch) a non-quiet entry names, each with the
        final state its entry says the job reached (None: read it)."""
        woken: list[tuple[W, JobState | None]] = []
        with self._lock:
            for _, fields in entries:
                kind = fields.get(b"kind", b"")
                if kind in QUIET_KINDS:
                    continue
                job_id = records.text(fields.get(b"job", b""))
                state = FINAL_KINDS.get(kind)
                woken += ((w, state) for w in self._jobs.get(job_id, ()))
                batch_id, dot, index = job_id.rpartition(".")
                if dot and index.isdigit():
                    woken += ((w, None) for w in self._batches.get(batch_id, ()))
        return woken

    def everyone(self) -> list[tuple[W, JobState | None]]:
        """Every waiter, to look again (the listener may have missed entries)."""
        with self._lock:
            return [(w, None) for ws in (*self._jobs.values(), *self._batches.values()) for w in ws]


def _discard(table: dict[str, list[W]], key: str, waiter: W) -> None:
    waiters = table.get(key)
    if waiters is None:
        return
    try:
        waiters.remove(waiter)
    except ValueError:
        return
    if not waiters:
        del table[key]


class _Parked:
    """Around a waiter's wait for a wake (its first read done): counted by ``parked_count``.
    One object for every wait: a generator-based context manager made two per waiter,
    and each object a waiter holds is walked by every full garbage collection."""

    def __init__(self) -> None:
        self.count = 0

    def __enter__(self) -> None:
        with _boards_lock:
            self.count += 1

    def __exit__(self, *_exc: object) -> None:
        with _boards_lock:
            self.count -= 1


_PARKED = _Parked()


def parked() -> _Parked:
    """The context a waiter waits for a wake in (``with parked(): ...``)."""
    return _PARKED


def parked_count() -> int:
    """Waiters in this process that have read their job once and now wait for a wake."""
    return _PARKED.count


def waiting_count() -> int:
    """Waiters registered in this process, on every queue (for tests and benchmarks)."""
    with _boards_lock:
        boards = list(_boards)
    return sum(len(board) for board in boards)


def stream_id(entry_id: str | bytes) -> tuple[int, int]:
    ms, _, seq = records.text(entry_id).partition("-")
    return int(ms), int(seq or 0)


def trimmed(cursor: str, oldest: Any) -> bool:
    """Whether entries after ``cursor`` may have been trimmed before being read: the
    stream's oldest entry (``XRANGE - + COUNT 1``) is past the cursor, or the stream is
    gone (purged; a restart without its data). A cursor of "0-0" was taken from an empty
    stream, or set when it was found gone: everything since is still there to read."""
    if cursor == "0-0":
        return False
    return not oldest or stream_id(oldest[0][0]) > stream_id(cursor)


def next_cursor(cursor: str, entries: Any, oldest: Any) -> str:
    """Where the next read starts: after the last entry read; from the start of the
    stream when it is gone (so the gap is reported once, and it is read when it comes
    back); else where it was."""
    if entries:
        return records.text(entries[-1][0])
    return cursor if oldest else "0-0"


def took_read(
    board: Board[W], cursor: str, reply: Any, oldest: Any, broken: bool, where: str
) -> tuple[str, list[tuple[W, JobState | None]]]:
    """What a listener does with one read (the sync thread's and the asyncio task's
    alike): after an outage or a trimmed gap every waiter looks again, then the entries
    read wake theirs. Returns where the next read starts, and whom to wake (``wake``)."""
    woken: list[tuple[W, JobState | None]] = []
    if broken or trimmed(cursor, oldest):
        if broken:
            log.warning("finish listener on %s: reconnected", where)
        woken = board.everyone()
    entries = list(reply[0][1]) if reply else []
    return next_cursor(cursor, entries, oldest), woken + board.named_by(entries)


def wake(woken: Iterable[tuple[Waiter, JobState | None]]) -> None:
    for waiter, state in woken:
        waiter.wake(state)


def start_cursor(newest: Any) -> str:
    """Where a new listener starts: after the newest entry (``XREVRANGE + - COUNT 1``)."""
    return records.text(newest[0][0]) if newest else "0-0"


_FINISHED = {s.value.encode(): s for s in JobState if s.finished}


def finished_state(raw: bytes | None) -> JobState | None:
    """The final state a read of the state (lua/read_state.lua) shows; None if not final."""
    return _FINISHED.get(raw or b"")


def hook_after_first_read(job_id: str) -> None:
    if after_first_read is not None:
        after_first_read(job_id)


def hook_before_listen_read() -> None:
    if before_listen_read is not None:
        before_listen_read()
