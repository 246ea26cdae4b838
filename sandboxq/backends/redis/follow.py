"""Following the events stream, as decisions without I/O: what to read next and what it
means. The blocking client (listen.py) and the asyncio one (aio.py) share them, and
differ only in how a read is carried out (a blocking call, or an awaited one).

    finish_steps   wait_for_finish as a generator: it yields what to read (Newest, State,
                   Read), is sent each reply, and returns the finished state or None;
                   drive / adrive run it with a function that does the reads
    EventCursor    events(): the next Read (catch up, then block), and the events a
                   reply holds
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeVar

from sandboxq.backends import rules
from sandboxq.backends.base import Event
from sandboxq.backends.redis import records
from sandboxq.models import JobState

#: wait_for_finish re-reads the state this often, in case the job's event was trimmed.
FINISH_POLL_S = 0.5

_FINISHED = {s.value.encode(): s for s in JobState if s.finished}

Entries: TypeAlias = "list[tuple[bytes, dict[bytes, bytes]]]"
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Newest:
    """Read the id of the newest event (XREVRANGE ... COUNT 1)."""


@dataclass(frozen=True, slots=True)
class State:
    """Read the job's state (bounded: lua/read_state.lua); None when it does not exist."""


@dataclass(frozen=True, slots=True)
class Read:
    """Read the events after ``after``; with ``block_s``, wait up to that long for one.
    ``doing`` names the read in an error."""

    after: str
    block_s: float | None
    doing: str = "read events"


Step: TypeAlias = "Newest | State | Read"
Steps: TypeAlias = "Generator[Step, Any, T]"


def finish_steps(queue: str, job_id: str, timeout_s: float) -> Steps[JobState | None]:
    """Follow the stream from "now" and re-read the job's state whenever an event names it
    (or every FINISH_POLL_S); raise ``JobNotFound`` when the job does not exist."""
    deadline = time.monotonic() + timeout_s
    wanted = job_id.encode()
    # the stream position is taken before the state is read: no event can slip between
    newest = yield Newest()
    after = records.text(newest[0][0]) if newest else "0-0"
    check, checked_at = True, 0.0
    while True:
        if check or time.monotonic() - checked_at >= FINISH_POLL_S:
            raw = yield State()
            if raw is None:  # never enqueued, trimmed or purged: waiting would be for nothing
                raise rules.job_not_found(queue, job_id)
            checked_at = time.monotonic()
            if (state := _FINISHED.get(raw or b"")) is not None:
                return state
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        entries = yield Read(after, min(remaining, FINISH_POLL_S), "wait for events")
        if entries:
            after = records.text(entries[-1][0])
        check = any(fields.get(b"job") == wanted for _, fields in entries)


def drive(steps: Steps[T], do: Callable[[Step], Any]) -> T:
    """Run ``steps`` to its end, each step carried out by ``do``."""
    step = next(steps)
    while True:
        try:
            step = steps.send(do(step))
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]


async def adrive(steps: Steps[T], do: Callable[[Step], Awaitable[Any]]) -> T:
    """``drive`` with ``do`` awaited."""
    step = next(steps)
    while True:
        reply = await do(step)
        try:
            step = steps.send(reply)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]


class EventCursor:
    """Where ``events(since, block_s)`` stands: first the retained events after ``since``
    (reads that do not block); then, with ``block_s``, new ones as they come, ending once
    ``block_s`` passes without any."""

    def __init__(self, since: str | None, block_s: float | None) -> None:
        self.after = since or "0-0"
        self._block_s = block_s if block_s is not None and block_s > 0 else None
        self._caught_up = False
        self._deadline: float | None = None

    def next_read(self) -> Read | None:
        """The read to make next; None when the iteration is over."""
        if not self._caught_up:
            return Read(self.after, None)
        if self._block_s is None:
            return None
        if self._deadline is None:  # a new wait: block_s from now
            self._deadline = time.monotonic() + self._block_s
        remaining = self._deadline - time.monotonic()
        return Read(self.after, remaining, "wait for events") if remaining > 0 else None

    def took(self, entries: Sequence[tuple[bytes, dict[bytes, bytes]]]) -> list[Event]:
        """The events of a read's reply; the cursor moves past them."""
        if not entries:
            self._caught_up = True
            return []
        if self._caught_up:
            self._deadline = None  # something came: the next wait starts afresh
        self.after = records.text(entries[-1][0])
        return [records.event(entry_id, fields) for entry_id, fields in entries]
