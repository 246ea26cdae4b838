"""The index of queues: which queues exist, without looking at a single job key.

    enqueue / batch enqueue / worker registration ──► the index (Redis: a SET the
        scripts maintain, keys.py; memory://: a set in this process)
    dashboard, exporter, ``sandboxq queues`` ──► read_index(limit) ──► QueueIndex

The index is written by anyone who may enqueue, so a reader trusts none of it: an entry
that is not a well-formed queue name is ignored (and counted), and at most ``limit``
entries are read per look, however many were added (the cap is reported, never silent).

A queue's worker registry is read the same way (``WorkerRegistry``): at most
``WORKERS_READ_CAP`` live workers and ``WORKERS_SCAN_CAP`` registry entries per look, and
a look that stopped short says so.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sandboxq.errors import ConfigError
from sandboxq.models import check_queue_name

#: Index entries one look reads at most (a dashboard refresh, a scrape, ``sandboxq queues``).
QUEUES_READ_CAP = 2000
#: Registered workers of one queue read at most per look.
WORKERS_READ_CAP = 1000
#: Registry entries one look examines at most, live or not: names added by hand with no
#: worker behind them must not hide a live one (100,000 hid it), nor cost a look without
#: bound. A reader that may write forgets the dead ones it reads, so the next look is cheap.
WORKERS_SCAN_CAP = 200 * WORKERS_READ_CAP
#: Minutes of waiting-depth samples a queue keeps (QueueSummary.depth, depth.lua).
DEPTH_MINUTES = 60


@dataclass(frozen=True, slots=True)
class QueueIndex:
    """What one look at the index found."""

    names: list[str]  # the well-formed queue names read, sorted
    total: int  # entries the index holds
    ignored: int  # entries read that are not queue names
    unbacked: int = 0  # well-formed names with no key behind them (added by hand)
    #: The look removed the entries it read that are no queue's (``ignored``, ``unbacked``).
    pruned: bool = False
    #: Why those entries were left in the index: this client may not write it (an ACL
    #: user who may only read, a replica). "" when they were removed, or were not to be.
    left: str = ""

    @property
    def read(self) -> int:
        return len(self.names) + self.ignored + self.unbacked

    @property
    def capped(self) -> bool:
        """Entries were left unread: the index holds more than one look reads."""
        return self.total > self.read

    def note(self) -> str:
        """One line on what was left out ("" when nothing was)."""
        parts = []
        if self.capped:
            parts.append(
                f"the queue index holds {self.total} entries; only {self.read} were read "
                "(the cap of one look)"
            )
        # Removed: said by the look that removed them, and then never again. Left in the
        # index: said at every look, so it says what would remove them.
        done = "removed from the index" if self.pruned and not self.left else "ignored"
        if self.ignored:
            parts.append(f"{self.ignored} entries that are not queue names were {done}")
        if self.unbacked:
            parts.append(f"{self.unbacked} names with no queue behind them were {done}")
        if self.left and (self.ignored or self.unbacked):
            parts.append(
                f"they stay in the index, as this user may not remove them ({self.left}): a "
                "look by a user who may (sandboxq queues, the dashboard) removes them"
            )
        return "; ".join(parts)


@dataclass(frozen=True, slots=True)
class WorkerRegistry:
    """What one look at a queue's worker registry found."""

    live: list[dict[str, Any]]  # the live workers' records, by worker id
    capped: bool  # entries were left unread: the look stopped at a cap

    def note(self) -> str:
        """One line on what was left out ("" when nothing was)."""
        if not self.capped:
            return ""
        if len(self.live) >= WORKERS_READ_CAP:
            return f"the first {WORKERS_READ_CAP} registered workers were read; there may be more"
        return (
            f"the worker registry holds more than the {WORKERS_SCAN_CAP} entries one look "
            f"reads; {len(self.live)} live workers were found among them, there may be more"
        )


def valid_names(entries: Iterable[bytes | str]) -> tuple[list[str], int]:
    """The well-formed queue names among ``entries`` (sorted, unique) and how many were not."""
    names: set[str] = set()
    ignored = 0
    for entry in entries:
        try:
            text = entry.decode("utf-8") if isinstance(entry, bytes) else entry
            names.add(check_queue_name(text))
        except (ConfigError, ValueError):  # UnicodeDecodeError is a ValueError
            ignored += 1
    return sorted(names), ignored
