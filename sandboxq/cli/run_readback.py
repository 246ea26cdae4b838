"""An output of ``sandboxq run`` read back: by a fleet run's ``--resume``, and by a local
run's ``--skip-done``.

    OUT ─► written_lines ─► WrittenRow (line, outcome, error, row, batch) per whole row;
                            a last line a crash cut short is left out
        ├─ --resume BATCH_ID (run_fleet.py): every row counts as written; foreign_row
        │  refuses rows that cannot be the batch's; end_on_a_whole_row; the rest is
        │  appended
        └─ --skip-done (batch.py): finished_rows keeps the rows of lines that finished;
           foreign_row refuses rows that cannot be this input's; keep_only puts a file
           of those rows alone in OUT's place; the other lines run and are appended

A file refused is left as it was: nothing is cut or rewritten before every row is known
to be the batch's (or the input's).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, NamedTuple

from sandboxq import text
from sandboxq.cli.batch_view import MALFORMED, NOT_RUN, STOPPED_RUNNING
from sandboxq.errors import ConfigError

#: The rows ``--skip-done`` writes anew: lines that did not run, were stopped while they
#: ran, or could not be read (the input may have been fixed since).
RUN_AGAIN = frozenset((MALFORMED, NOT_RUN, *STOPPED_RUNNING))


class WrittenRow(NamedTuple):
    """A row an earlier run wrote: what a resume counts (its error: the summary's kind),
    and the row as it is in the file (kept byte for byte by ``keep_only``)."""

    line: int
    outcome: str
    error: str | None
    row: bytes
    batch: str | None = None  # the batch it was written for, over a fleet


def written_lines(path: str) -> Iterator[WrittenRow]:
    """Every row of ``path``. A last line without its newline is a row when it is whole (a
    crash between a row and its newline), else one a crash cut short: left out, and left
    in the file (``end_on_a_whole_row`` mends it once the rows are found to be the
    batch's: a file refused is left as it was)."""
    whole = _whole_lines(path)
    rows = whole.splitlines()
    for n, raw in enumerate(rows, 1):
        if (row := _parsed(raw)) is None:
            raise ConfigError(f"{path} line {n} is not a line sandboxq run wrote")
        yield row
    tail = _after_last_newline(path, len(whole))
    if tail and (row := _parsed(tail)) is not None:
        yield row
    elif not _cut_short_row(tail):
        # a file of another program (its one line without a newline, as json.dump writes
        # it) would otherwise pass for a crash's remains and be emptied
        raise ConfigError(f"{path} line {len(rows) + 1} is not a line sandboxq run wrote")


def _parsed(raw: bytes) -> WrittenRow | None:
    """``raw`` as a row ``Output`` writes (a JSON object with an integer ``line`` and a
    text ``outcome``), or None: a ``line`` of 3.9, "3" or true passed for line 3, and
    Infinity raised."""
    try:
        record = json.loads(raw)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    if not isinstance(record, dict):
        return None
    line, outcome, error = record.get("line"), record.get("outcome"), record.get("error")
    batch = record.get("batch")
    if type(line) is not int or not isinstance(outcome, str):
        return None
    if not isinstance(batch, str | None):
        return None
    return WrittenRow(line, outcome, error if isinstance(error, str) else None, raw, batch)


def finished_rows(path: str) -> list[WrittenRow]:
    """The rows of ``path`` whose lines finished (any outcome but ``RUN_AGAIN``'s), the
    first of each line: what ``--skip-done`` keeps and does not run again."""
    kept: dict[int, WrittenRow] = {}
    for row in written_lines(path):
        if row.outcome not in RUN_AGAIN:
            kept.setdefault(row.line, row)
    return list(kept.values())


def keep_only(held: IO[str], path: str, rows: list[WrittenRow]) -> IO[str]:
    """Put a file holding ``rows`` alone (each as it was written, on a line of its own) in
    the place of ``path``, which ``held`` holds locked, and return it open to append,
    locked.

    The new file is written whole, then renamed over the old one: a crash or a full disk
    leaves the old file or the new, never a part of either. Its lock is taken before the
    rename, so a run that opens ``path`` at any moment finds it locked. It is written
    under one name per output (``.OUT.sandboxq-rewrite``, beside it): what a run killed
    while it wrote left there is replaced by the next (the output's lock says no live run
    writes it), not left in the directory for good."""
    real = os.path.realpath(path)
    folder, name = os.path.split(real)
    scratch = os.path.join(folder, f".{name}.sandboxq-rewrite")
    before = os.fstat(held.fileno())
    try:
        fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise ConfigError(
            f"cannot rewrite {path}: cannot create {scratch} beside it: {exc.strerror or exc}"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _write_all(fd, b"".join(row.row + b"\n" for row in rows))
        os.fsync(fd)
        with contextlib.suppress(PermissionError):  # the owner is kept where we may
            os.fchown(fd, before.st_uid, before.st_gid)
        os.fchmod(fd, stat.S_IMODE(before.st_mode))  # after: a chown clears setuid bits
        os.replace(scratch, real)
    except BaseException as exc:  # a full disk, and a Ctrl-C: the scratch file goes
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(scratch)
        if isinstance(exc, OSError):
            raise ConfigError(f"cannot rewrite {path}: {exc.strerror or exc}") from None
        raise
    return open(fd, "a", encoding="utf-8")


def _write_all(fd: int, data: bytes) -> None:
    """Write all of ``data``: one write may write less (Linux writes at most 2 GiB at a
    time); a full disk raises."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


#: How every row Output writes begins: a line a crash cut short begins so too, or is a
#: start of it.
_ROW_START = b'{"line": '


def _cut_short_row(tail: bytes) -> bool:
    """Whether ``tail`` (what follows an output's last newline) can be a row cut short."""
    return tail.startswith(_ROW_START) or _ROW_START.startswith(tail)


def _after_last_newline(path: str, whole: int) -> bytes:
    """What follows the first ``whole`` bytes of ``path`` (its last newline)."""
    try:
        with open(path, "rb") as f:
            f.seek(whole)
            return f.read()
    except FileNotFoundError:
        return b""
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None


def end_on_a_whole_row(path: str) -> None:
    """End ``path`` on a whole row, so appending starts on a line of its own: a last line a
    crash cut short is cut off, a whole row missing its newline gets it."""
    whole = len(_whole_lines(path))
    if whole == Path(path).stat().st_size:
        return
    if _parsed(_after_last_newline(path, whole)) is not None:
        with open(path, "ab") as f:
            f.write(b"\n")
        return
    with open(path, "r+b") as f:
        f.truncate(whole)


def _whole_lines(path: str) -> bytes:
    """``path`` up to its last newline (nothing when it does not exist)."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        return b""
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    return raw[: raw.rfind(b"\n") + 1]


def foreign_row(
    done: list[WrittenRow],
    lines: list[int],
    malformed: Iterable[int],
    source: str,
    batch_id: str | None = None,
) -> str:
    """What the first of ``done`` (an output's rows) that cannot be of ``source`` (a batch
    ``batch_id`` of ``lines`` sent, ``malformed`` not; a local run's input, with no batch)
    holds, in words; "" when each can be. A row of another batch, a row for a line the
    input does not have, a good line written as malformed, or a malformed one written as
    run. A row with no batch (a local run's, or one written before rows named their
    batch) is told apart only where its lines differ from this input's."""
    sent, bad = set(lines), set(malformed)
    for row in done:
        line, outcome = row.line, row.outcome
        if batch_id is not None and row.batch not in (None, batch_id):
            return f"holds line {line} of batch {text.clip(row.batch, 40)}"
        if line in sent and outcome == MALFORMED:
            return f"holds line {line} as malformed, which {source} has as a good line"
        if line in bad and outcome != MALFORMED:
            shown = text.clip(outcome, 40)  # read from the file: any text
            return f"holds line {line} as {shown}, which {source} has as malformed"
        if line not in sent and line not in bad:
            return f"holds line {line}, which {source} has not (past its end, or blank)"
    return ""
