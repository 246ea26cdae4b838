"""An execution ledger: evidence that no two children ever worked on one job at once.

    handler (in a child) ── one line per step, one write() each ──► ledger file (O_APPEND)
        start <pid> <key> <t>    tick <pid> <key> <t> (every step_s)    end <pid> <key> <t>
    test ── read_ledger(path) ──► executions per key ──► overlaps(): spans that cross

Use ``tests.support.ledger:ledger_job`` as the processor and give each job its own
``key``. An execution's span runs from its ``start`` line to its last line. A child that
is killed or frozen writes nothing more, so its span ends at its last sign of life (at
most ``step_s`` before it died or stopped); a frozen child that resumes and carries on
writes new ticks, which stretch its span over whatever ran meanwhile. An overlap thus
means two processes both made progress on one job at the same time, which is what a
lease must prevent; a killed, or frozen and then fenced, execution alone never is one.

Lines are appended with one ``write`` each on an ``O_APPEND`` descriptor, so lines from
many processes never interleave. Times are ``time.time()``: every writer runs on the
machine that reads the ledger.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

#: ``sum(range(n))`` iterations per second of this process, measured on first use.
_spin_rate: float | None = None


def _spin(seconds: float) -> None:
    """Hold the GIL inside one C call for about ``seconds`` (less CPU when the core is shared)."""
    global _spin_rate
    if _spin_rate is None:
        t0 = time.perf_counter()
        sum(range(1_000_000))
        _spin_rate = 1_000_000 / max(time.perf_counter() - t0, 1e-6)
    sum(range(max(1, int(_spin_rate * seconds))))


def ledger_job(
    ledger: str, key: str, seconds: float, step_s: float = 0.02, busy: bool = False
) -> str:
    """ok after about ``seconds``: logs ``start``, a ``tick`` every ``step_s`` and ``end``
    to ``ledger``, and returns ``key``. ``busy`` spends each step holding the GIL in one
    C call (a saturated core) instead of sleeping."""
    if " " in key or "\n" in key:
        raise ValueError(f"ledger keys cannot hold spaces or newlines: {key!r}")
    fd = os.open(ledger, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    pid = os.getpid()

    def write(kind: str) -> None:
        os.write(fd, f"{kind} {pid} {key} {time.time():.6f}\n".encode())

    try:
        write("start")
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            if busy:
                _spin(min(step_s, left))
            else:
                time.sleep(min(step_s, left))
            write("tick")
        write("end")
    finally:
        os.close(fd)
    return key


@dataclass
class Execution:
    """One run of one job in one process, as the ledger saw it."""

    key: str
    pid: int
    started: float
    last: float  # the time of its last line: its last sign of life
    finished: bool  # it wrote ``end``


def read_ledger(path: str | Path) -> dict[str, list[Execution]]:
    """Executions per job key, each list in start order. A missing file is an empty ledger."""
    path = Path(path)
    runs: dict[tuple[int, str], Execution] = {}  # the open execution of (pid, key)
    by_key: dict[str, list[Execution]] = {}
    text = path.read_text() if path.exists() else ""
    for n, line in enumerate(text.splitlines(), 1):
        try:
            kind, pid_text, key, at_text = line.split(" ")
            pid, at = int(pid_text), float(at_text)
        except ValueError:
            raise ValueError(f"{path}:{n}: not a ledger line: {line!r}") from None
        if kind == "start":
            runs[pid, key] = execution = Execution(key, pid, at, at, False)
            by_key.setdefault(key, []).append(execution)
            continue
        execution_or_none = runs.get((pid, key))
        if execution_or_none is None or kind not in ("tick", "end"):
            raise ValueError(f"{path}:{n}: {kind!r} without a start: {line!r}")
        execution_or_none.last = at
        execution_or_none.finished = kind == "end"
    for executions in by_key.values():
        executions.sort(key=lambda e: e.started)
    return by_key


def overlaps(ledger: dict[str, list[Execution]]) -> list[tuple[Execution, Execution]]:
    """Pairs of executions of one job whose spans cross (each pair: earlier, later)."""
    found: list[tuple[Execution, Execution]] = []
    for executions in ledger.values():
        for i, later in enumerate(executions):
            found.extend(
                (earlier, later) for earlier in executions[:i] if earlier.last > later.started
            )
    return found


def describe(pairs: Iterable[tuple[Execution, Execution]]) -> str:
    """One line per overlapping pair, for an assertion message."""
    return "\n".join(
        f"job {a.key}: pid {a.pid} ran {a.started:.3f}..{a.last:.3f}, "
        f"pid {b.pid} started {b.started:.3f} ({a.last - b.started:.3f} s of overlap)"
        for a, b in pairs
    )
