"""Text for people: how the command line and the dashboard show times, durations and
stored strings. Plain functions of plain values (no rich, no HTML), so both front ends
and the worker's log share them.
"""

from __future__ import annotations

import logging
import re
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


#: An ended attempt's start where its record has none: no child is known to have run it
#: (it waited in its worker, claimed ahead, until it was handed back, cancelled or its
#: lease was lost; it was refused, or out of its budgets; or its worker was killed before
#: it published the child's pid: README, "A cancelled or lease-lost attempt").
START_UNKNOWN = "not known"


def started(ms: int | None, *, date: bool = True) -> str:
    """An ended attempt's start as local time (``when``), or ``START_UNKNOWN`` without
    one (no child is known to have run it)."""
    return START_UNKNOWN if ms is None else when(ms, date=date)


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


def attempts(charged: int, numbered: Iterable[int], stalls: int) -> str:
    """A job's attempts: what its retry budget charged and, when a manual retry started
    that count again or a requeue went uncharged, how many ran in all (the highest attempt
    number of its history, ``numbered``)."""
    in_all = max(numbered, default=0)
    if in_all > charged:
        return f"{charged} charged, {in_all} in all (stalls: {stalls})"
    return f"{charged} (stalls: {stalls})"


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


#: The most a traceback or a captured stack keeps, in UTF-8 bytes.
MAX_TRACEBACK_BYTES = 16 * 1024
#: Room kept for the line that says what was cut (its numbers at their longest).
_NOTE_ROOM = len("... 9,999,999,999 lines (9,999,999,999,999 characters) cut ...\n")


def bounded_traceback(text: str, max_bytes: int = MAX_TRACEBACK_BYTES) -> str:
    """``text`` (a Python traceback, or a ``faulthandler`` dump of a stack) cut to at most
    ``max_bytes`` UTF-8 bytes, keeping the innermost frames and saying how much was cut.

    A traceback lists the innermost frame last, just above the exception line: its first
    line and its end are kept. A ``faulthandler`` dump says "most recent call first": its
    beginning is kept (the signalled thread comes first). One line says what went, e.g.
    ``... 412 lines (38,112 characters) cut ...``, where it was.
    """
    if len(text) * 4 <= max_bytes or _size(text) <= max_bytes:
        return text
    lines = text.splitlines(keepends=True)
    innermost_first = "(most recent call first)" in text
    head = [] if innermost_first else lines[:1]
    if head and _size(head[0]) > max_bytes // 2:  # one huge line (a message alone)
        head = [_cut_line(head[0], max_bytes // 2)]
    rest = lines if innermost_first else lines[1:]
    budget = max_bytes - _size("".join(head)) - _NOTE_ROOM
    kept: list[str] = []
    whole = 0  # lines kept whole
    for line in rest if innermost_first else reversed(rest):
        size = _size(line)
        if size > budget:
            if kept:
                break
            # The innermost line alone is longer than all the room (a huge exception
            # message): its start, in half the room, and the frames above it in the rest.
            cut = _cut_line(line, budget // 2)
            kept.append(cut)
            budget -= _size(cut)
            continue
        kept.append(line)
        whole += 1
        budget -= size
    if not innermost_first:
        kept.reverse()
    chars = len(text) - sum(map(len, head)) - sum(map(len, kept))
    note = f"... {len(rest) - whole:,} lines ({chars:,} characters) cut ...\n"
    return "".join([*kept, note] if innermost_first else [*head, note, *kept])


def storable(text: str) -> str:
    """``text`` with each lone surrogate written as its escape (``\\udcff``): UTF-8, which
    Redis, JSON and an attempt's record need, cannot carry one, and ``os.fsdecode`` makes
    one of every byte of a file name that is not UTF-8. One encode when there is none."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def _size(text: str) -> int:
    return len(text.encode("utf-8", "replace"))


def _cut_line(line: str, max_bytes: int) -> str:
    """The start of ``line`` within ``max_bytes`` UTF-8 bytes, ending in a newline."""
    data = line.encode("utf-8", "replace")[: max(0, max_bytes - 4)]
    return data.decode("utf-8", "ignore") + "…\n"


#: The bidirectional overrides, embeddings and isolates: "\u202e" makes a terminal or a
#: browser show what follows it reversed, so a stored id can pass for another ("Trojan
#: Source"). Shown as escapes wherever stored text is shown, as control characters are.
BIDI_CONTROLS = "\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"
#: Control characters but newline and tab; and with those two, what one line must not hold.
_CONTROLS = re.compile(f"[\x00-\x08\x0b-\x1f\x7f-\x9f{BIDI_CONTROLS}]")
_CONTROLS_AND_BREAKS = re.compile(f"[\x00-\x1f\x7f-\x9f{BIDI_CONTROLS}]")


def visible(value: object, *, one_line: bool = True) -> str:
    """``value`` as text safe to print or log: control characters and bidirectional
    overrides shown as escapes (``\\x1b``, ``\\u202e``), so a stored string or a
    handler's error cannot drive a terminal or reverse what it shows; with
    ``one_line``, newlines and tabs too, so a job id cannot forge a log line of its own."""
    found = _CONTROLS_AND_BREAKS if one_line else _CONTROLS
    return found.sub(lambda m: repr(m.group())[1:-1], "" if value is None else str(value))


class _VisibleArgs(logging.Filter):
    """Every string argument of a record shown on one line (``visible``): what a worker
    logs names jobs and errors read from a shared Redis or raised by a handler."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and record.args:
            record.args = tuple(visible(a) if isinstance(a, str) else a for a in record.args)
        return True


_VISIBLE_ARGS = _VisibleArgs()


def guarded_logger(name: str) -> logging.Logger:
    """The logger ``name``, its records' string arguments shown on one line, escaped."""
    logger = logging.getLogger(name)
    if _VISIBLE_ARGS not in logger.filters:
        logger.addFilter(_VISIBLE_ARGS)
    return logger
