"""What ``sandboxq run`` shows a person, on stderr: a live progress bar, then a summary.

    Tally (outcome -> input line numbers) ◄── one call per finished line
      ├─► progress bar: ran/total, ok, failed, timed out, rate, ETA (redrawn by rich)
      └─► summary table: lines per outcome, with their line numbers

On a terminal the bar redraws in place and log lines print above it; elsewhere (a pipe,
a CI log) rich prints it once, as it was at the end.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from sandboxq import text
from sandboxq.backends.rules import error_kind
from sandboxq.cli import render
from sandboxq.models import Outcome

TIMEOUTS = {Outcome.SOFT_TIMEOUT.value, Outcome.HARD_TIMEOUT.value}
#: Outcomes a line can end with beyond the attempts' own (models.Outcome).
MALFORMED = "malformed"
NOT_RUN = "not_run"
#: The outcomes of a line whose attempt the batch's stop killed while it ran: interrupted
#: (the local run's worker stopped), cancelled (a fleet run's members, or anyone's cancel).
STOPPED_RUNNING = frozenset((Outcome.INTERRUPTED.value, Outcome.CANCELLED.value))
_OK = Outcome.OK.value
_ERROR = Outcome.ERROR.value
_DID_NOT_RUN = frozenset((MALFORMED, NOT_RUN))


class Tally:
    """Input line numbers by final outcome.

    The counts the progress bar shows are kept as lines are added: the bar reads them
    after every line, and summing the lists each time cost more than the line's JSON.
    """

    def __init__(self) -> None:
        self.lines: dict[str, list[int]] = defaultdict(list)
        #: The lines that ended ``error``, by the kind of error raised (rules.error_kind):
        #: "why did these fail" at a glance, as ``sandboxq batch`` groups a batch's.
        self.error_kinds: dict[str, list[int]] = defaultdict(list)
        self.ok = 0
        self.timed_out = 0
        self._ran = 0  # lines that ran: neither malformed nor not run

    def add(self, outcome: str, line: int, error: str | None = None) -> None:
        self.lines[outcome].append(line)
        if outcome == _ERROR:
            self.error_kinds[error_kind(error)].append(line)
        if outcome == _OK:
            self.ok += 1
        elif outcome in TIMEOUTS:
            self.timed_out += 1
        if outcome not in _DID_NOT_RUN:
            self._ran += 1

    @property
    def ran(self) -> int:
        """Lines that ran: neither malformed nor not run."""
        return self._ran

    def count(self, *outcomes: str) -> int:
        return sum(len(self.lines.get(o, ())) for o in outcomes)

    @property
    def failed(self) -> int:
        """Lines that ran and did not end ok or by a timeout."""
        return self._ran - self.ok - self.timed_out

    @property
    def all_ok(self) -> bool:
        return all(k == Outcome.OK.value for k, v in self.lines.items() if v)


#: The bar shows a rate once this much of the run has passed: over a few milliseconds a
#: burst of lines read 12,532.9 jobs/s for a two-line file.
RATE_AFTER_S = 1.0


class _Rate(ProgressColumn):
    """Lines this run ran over the time it has run, as the summary counts them
    (rich's own speed, over its last few updates, followed each burst of lines)."""

    def render(self, task: Task) -> Text:
        elapsed = task.elapsed or 0.0
        done = task.completed - task.fields.get("before", 0)
        if elapsed < RATE_AFTER_S or done <= 0:
            return Text("")
        return Text(f"{done / elapsed:.1f} jobs/s")


class BatchView:
    def __init__(self, total: int, tally: Tally, *, redirect_stdout: bool) -> None:
        self.console = Console(
            stderr=True, highlight=False, width=None if sys.stderr.isatty() else render.WIDE
        )
        self.tally = tally
        self.started = time.monotonic()
        #: Lines an earlier run wrote (``--resume``): on the bar, and out of the rate.
        self._ran_before = tally.ran
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn(
                "[green]{task.fields[ok]} ok[/] [red]{task.fields[failed]} failed[/] "
                "[yellow]{task.fields[timed_out]} timed out[/]"
            ),
            _Rate(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=self.console,
            redirect_stdout=redirect_stdout,
            redirect_stderr=True,
        )
        self._task = self._progress.add_task(
            "running",
            total=total + self._ran_before,
            completed=self._ran_before,
            before=self._ran_before,
            ok=tally.ok,
            failed=tally.failed,
            timed_out=tally.timed_out,
        )

    def __enter__(self) -> BatchView:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def finished(self) -> None:
        """Redraw after lines finished (the tally has them already). Done is the lines that
        ran, as the summary counts them: the lines a stop wrote ``not_run`` as they came
        (a fleet run's cancelled members) read 299/300 at 85.7 jobs/s for 19 that ran."""
        t = self.tally
        self._progress.update(
            self._task, completed=t.ran, ok=t.ok, failed=t.failed, timed_out=t.timed_out
        )

    def stopping(self, now: bool, text: str | None = None) -> None:
        if text is None and now:
            text = "stopping now: running jobs are killed"
        elif text is None:
            text = "stopping: running jobs may finish; Ctrl-C again to stop now"
        self._progress.update(self._task, description=text.partition(":")[0])
        self.console.print(f"[yellow]{text}[/]")

    def summary(self, source: str, interrupted: bool) -> None:
        elapsed = time.monotonic() - self.started
        total = sum(len(v) for v in self.tally.lines.values())
        if not total:
            self.console.print(f"nothing to run: {source} has no job lines")
            return
        now = total - self.tally.count(MALFORMED, NOT_RUN) - self._ran_before
        rate = f", {now / elapsed:.1f} jobs/s" if elapsed > 0 and now else ""
        title = f"{total} line(s) of {source} in {text.duration(elapsed)}{rate}"
        if self._ran_before:
            took = f"{now} in {text.duration(elapsed)}{rate}"
            title = f"{total} line(s) of {source}: {self._ran_before} written before, {took}"
        if interrupted:
            title += " (stopped early)"
        rows = [
            (outcome, kind, len(lines), text.clip(text.number_ranges(lines), 60))
            for outcome, lines in sorted(self.tally.lines.items(), key=_order)
            if lines
            for kind, lines in self._kinds(outcome, lines)
        ]
        self.console.print(f"[bold]{title}[/]")
        columns = ["outcome", "kind", "lines", "line numbers"]
        self.console.print(render.table(None, columns, rows))
        not_run = self.tally.lines.get(NOT_RUN)
        if not_run:
            self.console.print(
                f"[yellow]{len(not_run)} line(s) did not run: "
                f"{text.clip(text.number_ranges(not_run), 200)}[/]"
            )
        # Apart from those: they ran, and their lines say for how long and where they were.
        killed = [
            n for outcome in sorted(STOPPED_RUNNING) for n in self.tally.lines.get(outcome, ())
        ]
        if killed:
            self.console.print(
                f"[yellow]{len(killed)} line(s) were stopped while they ran: "
                f"{text.clip(text.number_ranges(killed), 200)}[/]"
            )

    def _kinds(self, outcome: str, lines: list[int]) -> list[tuple[str, list[int]]]:
        """The rows of ``outcome``: one per kind of error for ``error``, the most first."""
        if outcome != _ERROR:
            return [("", lines)]
        kinds = self.tally.error_kinds
        return sorted(kinds.items(), key=lambda kind: (-len(kind[1]), kind[0]))


def _order(item: tuple[str, list[int]]) -> tuple[int, str]:
    """ok first, then the failures by name, then malformed and not run."""
    rank = {Outcome.OK.value: 0, MALFORMED: 2, NOT_RUN: 3}
    return rank.get(item[0], 1), item[0]
