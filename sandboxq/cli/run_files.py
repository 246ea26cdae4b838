"""The files of ``sandboxq run``: its JSONL input and the output it writes (an output
read back is run_readback.py's).

    INPUT.jsonl ─► read_input ─► Item per non-blank line: its encoded call, or why not
    finished job ─► Output.write ─► one JSON line per input line, flushed as it finishes
                                    (``open_output``: the file under an exclusive lock;
                                    one that holds lines is refused unless --overwrite)

The local mode (batch.py) and the fleet mode (run_fleet.py) share all of it, so a file
gives the same lines either way (a fleet's rows also name their batch).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any

from sandboxq import codec
from sandboxq.backends.base import Backend, JobStanding
from sandboxq.cli.batch_view import NOT_RUN, STOPPED_RUNNING, Tally
from sandboxq.cli.options import json_type
from sandboxq.cli.run_readback import WrittenRow
from sandboxq.errors import ConfigError, SerializationError
from sandboxq.finished import result_value
from sandboxq.models import Action, AttemptRecord, JobInfo, JobState

#: What an input line may hold, and an example of one for the errors that say so.
_KEYS = ("args", "kwargs")
EXAMPLE = '{"args": [1, 2], "kwargs": {"size": 256}}'
#: The codecs a run decodes results with: it sends JSON, and takes nothing else back.
RUN_CODECS = frozenset({"json"})


# -- input --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Item:
    """One non-blank input line: its encoded call, or why it cannot run."""

    line: int
    payload: bytes | None
    error: str | None = None

    @property
    def job_id(self) -> str:
        return f"line-{self.line}"


def read_input(path: str) -> list[Item]:
    try:
        with open(path, "rb") as f:
            return [parse_line(n, raw) for n, raw in enumerate(f, 1) if raw.strip()]
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None


def parse_line(number: int, raw: bytes) -> Item:
    def bad(why: str) -> Item:
        return Item(number, None, why)

    try:
        # without its line end: where JSON says it stopped is then a column of this line
        value = json.loads(raw.rstrip(b"\r\n").decode("utf-8"))
    except UnicodeDecodeError as exc:
        return bad(f"not UTF-8 text ({exc.reason} at byte {exc.start})")
    except json.JSONDecodeError as exc:
        return bad(f"not JSON: {exc.msg} at column {exc.colno}")
    except ValueError as exc:
        return bad(f"not JSON: {exc}")
    except RecursionError:
        return bad("nested too deeply to be read as JSON")
    if not isinstance(value, dict):
        return bad(f"expected a JSON object like {EXAMPLE}, got a JSON {json_type(type(value))}")
    if unknown := sorted(set(value) - set(_KEYS)):
        return bad(f"unknown key(s) {unknown}: a line may have 'args' and 'kwargs' only")
    args, kwargs = value.get("args", []), value.get("kwargs", {})
    if not isinstance(args, list):
        return bad(f"'args' must be a JSON array, got a JSON {json_type(type(args))}")
    if not isinstance(kwargs, dict):
        return bad(f"'kwargs' must be a JSON object, got a JSON {json_type(type(kwargs))}")
    try:
        return Item(number, codec.encode_call("json", tuple(args), kwargs))
    except SerializationError as exc:  # NaN, or over the size limit
        return bad(str(exc))


# -- output -------------------------------------------------------------------------------


class Output:
    """Writes one JSON line per input line, as each finishes, and tallies the outcomes.

    Lines are written in the order they finish (each names its input line), and flushed
    one by one: what finished is on disk even if the batch is killed. Over a fleet each
    row also names its batch (``batch_id``), so that a resume can tell another batch's
    output from its own where the lines alone cannot.
    """

    def __init__(self, file: IO[str] | None, tally: Tally, batch_id: str | None = None) -> None:
        self._file = file  # None: stdout, looked up per write (a live display may proxy it)
        self.tally = tally
        self.written: set[int] = set()
        self._batch = {} if batch_id is None else {"batch": batch_id}

    def write(self, line: int, outcome: str, **fields: Any) -> None:
        if line in self.written:
            return
        self.written.add(line)
        self.tally.add(outcome, line, fields.get("error"))
        out = self._file or sys.stdout
        try:
            out.write(
                json.dumps({"line": line, "outcome": outcome, **fields, **self._batch}) + "\n"
            )
            out.flush()
        except BrokenPipeError:
            if out is sys.stdout:
                # Its reader is gone: whatever flushes stdout from now on writes nowhere,
                # and the run stops (cli/batch.py). Every flush raised again until then,
                # a child's start among them (multiprocess flushes stdout before one).
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, out.fileno())
                os.close(null)
            raise

    def written_before(self, rows: Iterable[WrittenRow]) -> None:
        """Count ``rows``, which an earlier run wrote: in the summary, and not written again."""
        for row in rows:
            self.written.add(row.line)
            self.tally.add(row.outcome, row.line, row.error)

    def job(self, backend: Backend, item: Item) -> bool:
        """Write ``item``'s result if its job has finished; False if it has not."""
        info = backend.get(item.job_id)
        if info is None or not info.state.finished:
            return False
        data = backend.get_result(item.job_id) if info.state is JobState.COMPLETED else None
        self.finished(item.line, info, data)
        return True

    def jobs(self, backend: Backend, items: list[Item]) -> list[Item]:
        """``job`` for each of ``items``, read in two calls for them all: where each stands,
        then the results of those completed. A job that is not completed (failed, or changed
        since) is read whole, as ``job`` reads it. Returns the items written."""
        standings = backend.outcomes([item.job_id for item in items]) if items else []
        done = [
            item
            for item, at in zip(items, standings, strict=True)
            if at is not None and at.state is JobState.COMPLETED
        ]
        found = backend.completed_results([item.job_id for item in done]) if done else []
        results = dict(zip([item.job_id for item in done], found, strict=True))
        written = []
        for item, at in zip(items, standings, strict=True):
            got = results.get(item.job_id)
            if at is None or got is None:  # not completed (or not since): read whole
                if self.job(backend, item):
                    written.append(item)
                continue
            self._completed(item.line, item.job_id, at, *got)
            written.append(item)
        return written

    def _completed(
        self, line: int, job_id: str, at: JobStanding, codec_name: str, data: bytes | None
    ) -> None:
        """Write input line ``line`` of completed job ``job_id``, as ``finished`` does."""
        outcome = at.outcome.value if at.outcome else at.state.value
        result = result_value(job_id, codec_name, data, RUN_CODECS)
        self.write(line, outcome, attempts=at.attempts, result=result)

    def finished(self, line: int, info: JobInfo, data: bytes | None) -> None:
        """Write input line ``line`` from its finished job's record and stored result."""
        outcome = info.outcome.value if info.outcome else info.state.value
        if info.state is JobState.COMPLETED:
            result = result_value(info.id, info.codec, data, RUN_CODECS)
            self.write(line, outcome, attempts=info.attempts, result=result)
        else:
            self.write(line, outcome, attempts=info.attempts, error=info.error, **_where(info))

    def not_run(self, backend: Backend, item: Item) -> None:
        self.stopped(item.line, backend.get(item.job_id))

    def stopped(self, line: int, job: JobInfo | JobStanding | None) -> None:
        """Write input line ``line``, which the batch's stop (or a cancel) left unfinished:
        as that attempt ended when the stop killed it while it ran, else as not run (its
        record gone: then whether it ran is not known, and the line says so). ``job``: its
        record, or where it stands (``Backend.outcomes``, a lighter read: it cannot tell a
        start, so a caller reads whole the jobs that had an attempt)."""
        if isinstance(job, JobInfo) and (killed := stopped_while_running(job)) is not None:
            self._stopped_running(line, job, killed)
            return
        if job is None:
            why = "its job's record is gone (deleted by hand?): whether it ran is not known"
            self.write(line, NOT_RUN, attempts=0, error=why)
            return
        ahead = claimed_ahead(job)
        # A line a worker claimed ahead, which a cancel ended before a child took it, was
        # charged an attempt that never ran (a local stop hands it back uncharged).
        charged = ahead is not None and ahead.action is not Action.RETRY_UNCHARGED
        ran = job.attempts - charged
        if ran:
            history = job.history if isinstance(job, JobInfo) else []
            before = history[-2] if ahead is not None and len(history) > 1 else None
            last = (
                before.error or before.outcome.value
                if before is not None
                else getattr(job, "error", None) or (job.outcome.value if job.outcome else None)
            )
            why = "the batch stopped before this line finished"
            why += f" (last attempt: {last})" if last else ""
        else:
            why = "the batch stopped before this line ran"
            if charged:
                why += " (claimed ahead by a worker, never started)"
            elif job.state is JobState.CANCELLED:
                why += " (cancelled while waiting)"
        self.write(line, NOT_RUN, attempts=ran, error=why)

    def _stopped_running(self, line: int, job: JobInfo, last: AttemptRecord) -> None:
        """Write ``line`` as its attempt ``last`` ended, killed running by a stop or a
        cancel: with how long it ran and, where the pool dumped one, its stack. Written as
        "never ran" it hid that it ran, and where it was stuck."""
        # A stop's interrupt is handed back uncharged (it is not the job's fault), yet
        # the attempt ran: it is counted here, as the line's other attempts are.
        uncharged = last.action is Action.RETRY_UNCHARGED
        why = "the batch was stopped while this line ran"
        why += f" ({last.error})" if last.error else ""
        ran = {} if last.ended_ms is None else {"ran_s": ran_s(last)}
        self.write(
            line,
            last.outcome.value,
            attempts=job.attempts + uncharged,
            error=why,
            **ran,
            **_where(job),
        )


def stopped_while_running(job: JobInfo) -> AttemptRecord | None:
    """``job``'s last attempt when a stop or a cancel killed it while it ran (it has a
    start: one claimed ahead and ended before a child took it never started); else None."""
    last = job.history[-1] if job.history else None
    if last is None or last.started_ms is None or last.outcome.value not in STOPPED_RUNNING:
        return None
    return last


def claimed_ahead(job: JobInfo | JobStanding) -> AttemptRecord | None:
    """``job``'s last attempt when a stop or a cancel ended it claimed ahead by a worker,
    before a child took it (it has no start); else None."""
    last = job.history[-1] if isinstance(job, JobInfo) and job.history else None
    if last is None or last.started_ms is not None or last.outcome.value not in STOPPED_RUNNING:
        return None
    return last


def ran_s(attempt: AttemptRecord) -> float:
    """How long ``attempt`` ran, in seconds (to the millisecond its record keeps)."""
    return max(0, (attempt.ended_ms or 0) - (attempt.started_ms or 0)) / 1000


def _where(info: JobInfo) -> dict[str, str]:
    """A failed line's ``traceback`` and ``output``: its last attempt's, when it has them."""
    last = info.history[-1] if info.history else None
    if last is None:
        return {}
    return {k: v for k, v in (("traceback", last.traceback), ("output", last.output)) if v}


@contextmanager
def stdout_for_results() -> Iterator[None]:
    """While results go to stdout, stdout is theirs alone: everything else written to this
    process's descriptor 1 goes to stderr instead. That is the handlers' own prints: the
    fork server starts inside, so children inherit descriptor 1 as stderr, and the pool
    writes what they print (``capture_output``) to descriptor 1 too. ``sys.stdout`` is
    the real stdout, on a descriptor of its own, so ``sandboxq run ... | jq`` never
    reads a handler's line.

    When ``sys.stdout`` is not descriptor 1 (a caller replaced it: a test's capture, an
    embedding program), results go where the caller put it, and descriptor 1, which the
    caller does not read, still takes the handlers' prints."""
    try:
        on_descriptor_1 = sys.stdout.fileno() == 1
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        on_descriptor_1 = False
    if not on_descriptor_1:
        yield
        return
    sys.stdout.flush()
    results_fd = os.dup(1)
    os.set_inheritable(results_fd, False)
    os.dup2(2, 1)
    previous = sys.stdout
    # Not a `with`: closing may fail as flushing did (the reader left), after the body's
    # own error, which must be the one that propagates.
    results = sys.stdout = open(results_fd, "w", encoding="utf-8", errors="replace")  # noqa: SIM115
    try:
        yield
    finally:
        sys.stdout = previous
        with contextlib.suppress(OSError):  # the reader left (BrokenPipeError)
            results.flush()
        os.dup2(results_fd, 1)
        with contextlib.suppress(OSError):
            results.close()


def open_output(path: str) -> IO[str]:
    """``path`` opened to append a run's lines, under an exclusive lock for as long as it
    is open: a second ``sandboxq run`` on the same file (another terminal, a ``--resume``
    while the first still runs) is refused and leaves the file as it was, rather than
    emptying it or writing among the first one's lines. A new run then empties it
    (``refuse_earlier_lines``, ``empty_output``) once nothing refuses it any more."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(
            f"{path} is being written by another sandboxq run: let it end, or write to another file"
        ) from None
    except OSError:  # a file system without locks: written unguarded
        pass
    return open(fd, "a", encoding="utf-8")


def refuse_earlier_lines(fd: int, path: str, *, overwrite: bool, skip_done: bool = False) -> None:
    """Refuse to empty an output that holds lines (an earlier run's results, most often),
    unless ``overwrite``: running a command again replaced a night's results without a
    word. The error says what keeps them: ``--skip-done`` where the run offers it."""
    if overwrite:
        return
    held = os.fstat(fd)
    if not stat.S_ISREG(held.st_mode) or held.st_size == 0:
        return
    try:
        held_lines = f"{_count_lines(path)} line(s)"
    except OSError:  # opened to write, yet not readable: its size says enough
        held_lines = f"{held.st_size} bytes"
    keep = "--skip-done runs only the lines it does not hold as finished, " if skip_done else ""
    raise ConfigError(
        f"{path} already holds {held_lines} (an earlier run's results?): "
        f"{keep}--overwrite replaces them; or write to another file"
    )


def empty_output(fd: int) -> None:
    """Empty an output ``open_output`` gave, when it is a regular file (not /dev/stdout, a
    pipe...)."""
    if stat.S_ISREG(os.fstat(fd).st_mode):
        os.ftruncate(fd, 0)


def _count_lines(path: str) -> int:
    """How many lines ``path`` holds (a last one without its newline counts)."""
    count = ends_open = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            count += chunk.count(b"\n")
            ends_open = not chunk.endswith(b"\n")
    return count + ends_open
