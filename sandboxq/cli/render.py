"""Output: JSON for scripts, rich tables for people, and the small formatters both use.

Every read verb builds one plain ``dict`` (what ``--json`` prints) and renders its human
form from that same dict, so the two can never disagree. rich is imported here (and in
the batch view) only: a producer importing ``sandboxq`` never loads it.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text


def print_json(data: Any) -> None:
    # JSON escapes C0 controls itself; DEL and the C1 controls (\x9b starts a terminal
    # command as \x1b[ does) are escaped here, so a stored value cannot drive a terminal.
    text = json.dumps(data, indent=2, ensure_ascii=False)
    sys.stdout.write(_C1.sub(lambda m: f"\\u{ord(m.group()):04x}", text) + "\n")


_C1 = re.compile("[\x7f-\x9f]")
#: Control characters but newline and tab: what must never reach a terminal raw.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def plain(value: object) -> Text:
    """``value`` as text to show as it is: never read as rich markup (``[/]`` in a stored
    error broke the table), control characters made visible (``\\x1b``), so nothing read
    from a shared Redis can drive the operator's terminal."""
    text = "" if value is None else str(value)
    return Text(_CONTROL.sub(lambda m: repr(m.group())[1:-1], text))


def stdout() -> Console:
    # Made per call: sys.stdout may have been replaced (a test's capture, a redirect).
    # A pipe or a file has no width to respect: lines stay whole there.
    width = None if sys.stdout.isatty() else WIDE
    return Console(file=sys.stdout, highlight=False, width=width)


#: Line width when the output is not a terminal.
WIDE = 200


def table(
    title: str | None,
    columns: Sequence[str],
    rows: Iterable[Sequence[Any]],
    *,
    keep: Sequence[str] = (),
    wrap: str | None = None,
    header: bool = True,
) -> Table:
    """A compact table that never crops: when the width runs short, cells fold onto more
    lines, the ``wrap`` column (errors) first, except in the ``keep`` columns (ids, which
    must stay whole to be copied)."""
    cells = [[plain(cell) for cell in row] for row in rows]
    out = Table(
        title=None if title is None else plain(title),
        title_justify="left",
        title_style="bold",
        box=box.SIMPLE_HEAD,
        show_header=header,
        pad_edge=False,
    )
    for i, column in enumerate(columns):
        if column in keep:
            width = max([len(column), *(row[i].cell_len for row in cells)])
            out.add_column(column, no_wrap=True, min_width=width)
        else:
            out.add_column(column, overflow="fold", ratio=1 if column == wrap else None)
    for row in cells:
        out.add_row(*row)
    return out


def now_ms() -> int:
    return time.time_ns() // 1_000_000


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
