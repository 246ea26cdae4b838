"""Text for people: how the command line and the dashboard show times, durations and
stored strings. Plain functions of plain values (no rich, no HTML), so both front ends
and the worker's log share them.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

#: Characters of a job's arguments or result shown before "show all" (the dashboard,
#: ``sandboxq job``).
PREVIEW_CHARS = 2000


def when(ms: int | None, *, date: bool = True) -> str:
    """A stored timestamp as local time (``date=False``: the time of day only)."""
    if ms is None:
        return ""
    try:
        moment = datetime.fromtimestamp(ms / 1000)
    except (OverflowError, ValueError, OSError):  # a stored number no clock reaches
        return f"{ms} ms"
    return moment.strftime("%m-%d %H:%M:%S" if date else "%H:%M:%S")


def duration(seconds: float | None) -> str:
    if seconds is None:
        return ""
    if seconds < 60:
        return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


def ago(ms: int | None, now: int) -> str:
    return "" if ms is None else f"{duration(max(0, now - ms) / 1000)} ago"


def clip(text: str | None, width: int = 80) -> str:
    """One line of at most ``width`` characters (an error can be a whole traceback)."""
    if not text:
        return ""
    line = " ".join(text.split())
    return line if len(line) <= width else line[: width - 1] + "…"


def number_ranges(numbers: Iterable[int]) -> str:
    """``[1, 2, 3, 5, 8, 9]`` -> ``"1-3, 5, 8-9"``."""
    spans: list[list[int]] = []
    for n in sorted(numbers):
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
