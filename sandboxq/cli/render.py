"""Output: JSON for scripts, rich tables for people, and the small formatters both use.

Every read verb builds one plain ``dict`` (what ``--json`` prints) and renders its human
form from that same dict, so the two can never disagree. rich is imported here (and in
the batch view) only: a producer importing ``sandboxq`` never loads it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import sys
import termios
from collections.abc import Iterable, Sequence
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from sandboxq.text import BIDI_CONTROLS, visible


def print_json(data: Any) -> None:
    # JSON escapes C0 controls itself; DEL and the C1 controls (\x9b starts a terminal
    # command as \x1b[ does) and the bidi overrides are escaped here, so a stored value
    # cannot drive a terminal or reverse what it shows.
    text = json.dumps(data, indent=2, ensure_ascii=False)
    sys.stdout.write(_C1.sub(lambda m: f"\\u{ord(m.group()):04x}", text) + "\n")


_C1 = re.compile(f"[\x7f-\x9f{BIDI_CONTROLS}]")


def plain(value: object) -> Text:
    """``value`` as text to show as it is: never read as rich markup (``[/]`` in a stored
    error broke the table), control characters made visible (``\\x1b``), so nothing read
    from a shared Redis can drive the operator's terminal."""
    return Text(visible(value, one_line=False))


def stdout() -> Console:
    # Made per call: sys.stdout may have been replaced (a test's capture, a redirect).
    # A pipe or a file has no width to respect: lines stay whole there.
    width = None if sys.stdout.isatty() else WIDE
    return Console(file=sys.stdout, highlight=False, width=width)


#: Line width when the output is not a terminal.
WIDE = 200


def leave_a_closed_terminal() -> None:
    """Point this process's outputs that are a terminal which has hung up (closed: its
    window, its SSH session) at /dev/null. Every write to it failed with EIO: the first
    progress redraw after a hangup ended ``sandboxq run`` with its lines unwritten."""
    fds = {1, 2}
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, OSError, ValueError):
            fds.add(stream.fileno())
    for fd in sorted(fds):
        try:
            termios.tcgetattr(fd)
        except termios.error as exc:  # ENOTTY: not a terminal; EIO: hung up
            if exc.args[0] != errno.EIO:
                continue
        except OSError:  # closed
            continue
        else:
            continue  # a terminal still there
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)


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
    must stay whole to be copied, and on one line: a newline in an id is escaped, so its
    row stays one row)."""
    ids = {i for i, column in enumerate(columns) if column in keep}
    cells = [
        [Text(visible(cell)) if i in ids else plain(cell) for i, cell in enumerate(row)]
        for row in rows
    ]
    out = Table(
        title=None if title is None else plain(title),
        title_justify="left",
        title_style="bold",
        box=box.SIMPLE_HEAD,
        show_header=header,
        pad_edge=False,
    )
    for i, column in enumerate(columns):
        if i in ids:
            width = max([len(column), *(row[i].cell_len for row in cells)])
            out.add_column(column, no_wrap=True, min_width=width)
        else:
            out.add_column(column, overflow="fold", ratio=1 if column == wrap else None)
    for row in cells:
        out.add_row(*row)
    return out
