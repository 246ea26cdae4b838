"""Following the events stream, as decisions without I/O: what to read next and what it
means. The blocking client (listen.py) and the asyncio one (aio.py) share them, and
differ only in how a read is carried out (a blocking call, or an awaited one).

    EventCursor    events(): the next Read (catch up, then block), and the events a
                   reply holds
    entries_of     a raw XREAD reply read on a lane (RESP2 or RESP3) in redis-py's shape

Waiting for a job's finish is the finish listener's (finishes.py), not a read per waiter.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from sandboxq.backends.base import Event
from sandboxq.backends.redis import records

Entries: TypeAlias = "list[tuple[bytes, dict[bytes, bytes]]]"


@dataclass(frozen=True, slots=True)
class Read:
    """Read the events after ``after``; with ``block_s``, wait up to that long for one.
    ``doing`` names the read in an error."""

    after: str
    block_s: float | None
    doing: str = "read events"


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


def entries_of(raw: Any) -> Any:
    """A raw XREAD reply, as a lane reads it (a list of [stream, entries] pairs, or a map
    of them), in the shape redis-py's ``xread`` gives: each entry's fields as a dict."""
    if not raw:
        return raw
    pairs = raw.items() if isinstance(raw, dict) else raw
    return [
        [
            key,
            [
                (entry_id, dict(zip(flat[::2], flat[1::2], strict=True)))
                for entry_id, flat in entries
            ],
        ]
        for key, entries in pairs
    ]
