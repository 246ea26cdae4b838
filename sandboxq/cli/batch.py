"""``sandboxq run PROCESSOR INPUT.jsonl``: a local batch through the sandboxed pool, no Redis.

    INPUT.jsonl ─► read_input: one Item per non-blank line (malformed ones keep their error)
        │ good lines, as jobs "line-<n>"
        ▼
    memory:// queue (a fresh one) ◄── SandboxWorker.run(burst=True), on a thread of its own
        │ events: completed / failed / retried
        ▼
    main thread: follow() ─► Output: one JSON line per input line ─► --output or stdout
                     └────► BatchView: progress bar, then the summary (stderr)

The worker is the production one (leases, exit policy, retries, timeouts, kills), on the
in-memory backend. The main thread keeps the signals: the first Ctrl-C (or SIGTERM)
drains, letting running jobs finish; a second one kills them. Lines that did not finish
are written as ``not_run`` and listed, so nothing is silently lost; the exit status is
then a shell's for the first signal (130 for Ctrl-C, 143 for SIGTERM).

Malformed lines are reported (with their line numbers) before anything runs and then
written as ``malformed``, and the rest of the batch runs: one bad line among thousands
should not cost the others, and the user learns of it at once instead of at the end.
``--strict`` stops before anything runs instead.

With ``--url``/``--queue``/``--resume`` the same command runs the file as a batch over
every worker serving that queue (run_fleet.py), with this module's input, Output and view.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import os
import signal
import stat
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import IO, Any

from sandboxq import codec
from sandboxq.backends.base import Backend, NewJob
from sandboxq.cli.batch_view import MALFORMED, NOT_RUN, BatchView, Tally
from sandboxq.cli.options import (
    EXIT_ERROR,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    Exit,
    add_setting_flags,
    import_from_cwd,
    json_type,
    setting_flags,
)
from sandboxq.cli.worker import FLAG_FORMS, POOL_FLAGS, settings
from sandboxq.errors import ConfigError, SerializationError
from sandboxq.models import JobInfo, JobState
from sandboxq.settings import WorkerSettings

log = logging.getLogger("sandboxq.cli")

#: How long a fleet run's follower waits for finished members before it looks again.
FOLLOW_TICK_S = 0.2
#: How often a local run reads the events of the lines that finished meanwhile.
FOLLOW_LOOK_S = 0.05
FINISHED_EVENTS = ("completed", "failed", "cancelled")
_KEYS = ("args", "kwargs")
_EXAMPLE = '{"args": [1, 2], "kwargs": {"size": 256}}'


def add_parser(verbs: Any) -> None:
    r = verbs.add_parser(
        "run",
        help="run a JSONL file of jobs through the sandboxed pool, locally (no Redis)",
        description="Run every line of INPUT (a JSON object per line, "
        f"e.g. {_EXAMPLE}; both keys optional) through PROCESSOR in sandboxed children, "
        "with a progress bar. Each output line is a JSON object: the input line number, "
        "the outcome (ok, error, hard_timeout, ..., malformed, not_run), the attempts, "
        "and the result or the error. Ctrl-C lets running jobs finish; a second one "
        "stops at once. Worker settings also come from SANDBOXQ_<SETTING> variables.",
    )
    r.add_argument("processor", nargs="?", help="the handler, as package.module:function")
    r.add_argument("input", nargs="?", metavar="INPUT.jsonl")
    r.add_argument("--output", metavar="OUT.jsonl", help="write results here (default: stdout)")
    add_setting_flags(r, WorkerSettings, POOL_FLAGS, FLAG_FORMS)
    r.add_argument("--strict", action="store_true", help="run nothing if any line is malformed")
    fleet = r.add_argument_group(
        "over a fleet (Redis)",
        "send the file as one batch to QUEUE: every worker serving it takes part; "
        "--concurrency N also runs N children here (default: none)",
    )
    fleet.add_argument("--url", help="Redis URL (default: $SANDBOXQ_URL)")
    fleet.add_argument("--queue", metavar="NAME", help="the queue the batch is sent to")
    fleet.add_argument(
        "--resume",
        metavar="BATCH_ID",
        help="re-attach to a batch an earlier run sent, and write to --output the lines "
        "it does not hold yet",
    )
    r.set_defaults(run=run, log_level=logging.WARNING)


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
        return bad(f"expected a JSON object like {_EXAMPLE}, got a JSON {json_type(type(value))}")
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
    one by one: what finished is on disk even if the batch is killed.
    """

    def __init__(self, file: IO[str] | None, tally: Tally) -> None:
        self._file = file  # None: stdout, looked up per write (a live display may proxy it)
        self.tally = tally
        self.written: set[int] = set()

    def write(self, line: int, outcome: str, **fields: Any) -> None:
        if line in self.written:
            return
        self.written.add(line)
        self.tally.add(outcome, line)
        out = self._file or sys.stdout
        out.write(json.dumps({"line": line, "outcome": outcome, **fields}) + "\n")
        out.flush()

    def job(self, backend: Backend, item: Item) -> bool:
        """Write ``item``'s result if its job has finished; False if it has not."""
        info = backend.get(item.job_id)
        if info is None or not info.state.finished:
            return False
        data = backend.get_result(item.job_id) if info.state is JobState.COMPLETED else None
        self.finished(item.line, info, data)
        return True

    def finished(self, line: int, info: JobInfo, data: bytes | None) -> None:
        """Write input line ``line`` from its finished job's record and stored result."""
        outcome = info.outcome.value if info.outcome else info.state.value
        if info.state is JobState.COMPLETED:
            result = (
                None
                if data is None
                else codec.decode_stored(data, info.codec, allowed={"json"}, job_id=info.id)
            )
            self.write(line, outcome, attempts=info.attempts, result=result)
        else:
            self.write(line, outcome, attempts=info.attempts, error=info.error, **_where(info))

    def not_run(self, backend: Backend, item: Item) -> None:
        self.stopped(item.line, backend.get(item.job_id))

    def stopped(self, line: int, info: JobInfo | None) -> None:
        """Write input line ``line`` as not run: the batch stopped before it finished."""
        attempts = info.attempts if info is not None else 0
        why = "the batch stopped before this line ran"
        if info is not None and info.error:
            why = f"the batch stopped before this line finished (last attempt: {info.error})"
        self.write(line, NOT_RUN, attempts=attempts, error=why)


def _where(info: JobInfo) -> dict[str, str]:
    """A failed line's ``traceback`` and ``output``: its last attempt's, when it has them."""
    last = info.history[-1] if info.history else None
    if last is None:
        return {}
    return {k: v for k, v in (("traceback", last.traceback), ("output", last.output)) if v}


# -- running ------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    if args.output and args.input and _same_file(args.output, args.input):
        raise ConfigError(
            f"--output {args.output} is the input file: writing it would lose the input's "
            "lines; write the results to another file"
        )
    with ExitStack() as stack:
        if not args.output:
            stack.enter_context(stdout_for_results())
        if args.queue or args.url or args.resume:
            from sandboxq.cli import run_fleet

            return run_fleet.run(args)
        return _run_here(args)


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet): not the same
        return False


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


def _run_here(args: argparse.Namespace) -> int:
    if not args.processor or not args.input:
        raise ConfigError("run takes PROCESSOR and INPUT.jsonl (or --resume with --url --queue)")
    from sandboxq.worker import SandboxWorker

    items = read_input(args.input)
    good = [item for item in items if item.payload is not None]
    bad = [item for item in items if item.payload is None]
    for item in bad:
        print(f"sandboxq: {args.input} line {item.line}: {item.error}", file=sys.stderr)
    if bad and args.strict:
        raise Exit(f"{len(bad)} malformed line(s) in {args.input}; nothing was run", EXIT_ERROR)
    # before the output is opened: a run refused here leaves it as it was
    chosen = checked_worker_settings(args, f"run-{uuid.uuid4().hex[:12]}", "memory://")
    # Every result stays in the backend until it is written; events are only the fast path.
    keep = {"retain_completed": len(good), "retain_failed": len(good)}
    worker = SandboxWorker(**chosen.model_dump(), backend_options=keep)
    backend = worker.backend
    tally = Tally()
    with ExitStack() as files:
        file = files.enter_context(open_output(args.output)) if args.output else None
        output = Output(file, tally)
        for item in bad:
            output.write(item.line, MALFORMED, attempts=0, error=item.error)
        backend.enqueue([NewJob(item.payload or b"", job_id=item.job_id) for item in good])
        stop = StopRequests(lambda now: worker.stop(now=now))
        redirect = file is None and sys.stdout.isatty()
        with BatchView(len(good), tally, redirect_stdout=redirect) as view:
            if good:  # else there is nothing to start a pool for
                _run_worker(
                    worker,
                    stop,
                    lambda wait_done: follow(backend, good, output, view, stop, wait_done),
                )
        for item in good:  # what the events did not deliver, and what never ran
            if item.line not in output.written and not output.job(backend, item):
                output.not_run(backend, item)
    view.summary(args.input, interrupted=stop.requests > 0)
    if stop.requests:
        return stop.exit_status()
    return EXIT_OK if tally.all_ok else EXIT_FAILED


def checked_worker_settings(args: argparse.Namespace, queue: str, url: str) -> WorkerSettings:
    """The settings of the worker a run starts here (the local mode's; over a fleet,
    ``--concurrency N``'s), checked as far as they can be without starting it: every
    setting, the processor imported (the worker's own import finds it done), its ``user``
    and ``group`` looked up. What only its pool's start can tell (a containment this
    machine refuses) still fails the run later."""
    from sandboxq.pool.privileges import resolve_user
    from sandboxq.processor import resolve_within

    chosen = settings(args, queue=queue, url=url, **setting_flags(args, POOL_FLAGS))
    import_from_cwd()
    resolve_within(chosen.processor, chosen.import_timeout_s)
    resolve_user(chosen.user, chosen.group)
    return chosen


def open_output(path: str, *, append: bool = False) -> IO[str]:
    """``path`` opened for a run's lines (appended to, or emptied first), under an
    exclusive lock for as long as it is open: a second ``sandboxq run`` on the same file
    (another terminal, a ``--resume`` while the first still runs) is refused and leaves
    the file as it was, rather than emptying it or writing among the first one's lines."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else 0), 0o666)
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
    if not append:
        empty_output(fd)  # once it is ours: emptied before the lock, it was the other's
    return open(fd, "a" if append else "w", encoding="utf-8")


def empty_output(fd: int) -> None:
    """Empty an output ``open_output`` gave, when it is a regular file (not /dev/stdout, a
    pipe...). A run that must hold the file before it can still be refused opens it to
    append, and empties it only once nothing refuses it any more."""
    if stat.S_ISREG(os.fstat(fd).st_mode):
        os.ftruncate(fd, 0)


class StopRequests:
    """A run's SIGINT / SIGTERM handler: the first request drains, the next stops now.

    Only a count, the first signal and a wake-up happen here: the main thread may be
    mid-write when a signal lands, so it shows the message itself. ``on_request(now)``
    is the wake-up (the local run's worker; a fleet run's main thread acts on the count)."""

    def __init__(self, on_request: Callable[[bool], None] | None = None) -> None:
        self._on_request = on_request
        self.requests = 0
        self.first_signal: int | None = None

    def __call__(self, signum: int, frame: object) -> None:
        self.requests += 1
        if self.first_signal is None:
            self.first_signal = signum
        if self._on_request is not None:
            self._on_request(self.requests > 1)

    def exit_status(self) -> int:
        """128 + the first signal, as a shell reports a process that signal ended (130
        for Ctrl-C, 143 for SIGTERM)."""
        return EXIT_INTERRUPTED if self.first_signal is None else 128 + self.first_signal


def _run_worker(
    worker: Any, stop: StopRequests, follow_until: Callable[[Callable[[float], bool]], None]
) -> None:
    """Run the worker on a thread of its own while this (main) thread follows it and
    keeps the signals (the worker installs none off the main thread)."""
    failure: list[BaseException] = []

    def work() -> None:
        try:
            worker.run(burst=True)
        except BaseException as exc:  # re-raised on the main thread, below
            failure.append(exc)

    thread = threading.Thread(target=work, name="sandboxq-batch-worker", daemon=True)
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}

    def wait_done(timeout_s: float) -> bool:
        thread.join(timeout_s)
        return not thread.is_alive()

    try:
        thread.start()
        follow_until(wait_done)
    except BaseException:
        worker.stop(now=True)  # following failed (stdout closed...): stop the pool too
        raise
    finally:
        thread.join()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if failure:
        raise failure[0]


def follow(
    backend: Backend,
    items: list[Item],
    output: Output,
    view: BatchView,
    stop: StopRequests,
    wait_done: Callable[[float], bool],
) -> None:
    """Write each line as its job finishes, until the worker is done and every event read.

    The events are read every ``FOLLOW_LOOK_S`` (and once the worker is done), not as each
    comes: a wake-up per job cost this thread more than the line it writes, on cores the
    children need. ``wait_done(s)`` waits up to ``s`` for the worker to be done."""
    by_id = {item.job_id: item for item in items}
    since: str | None = None
    shown = 0  # stop requests already shown
    finished = False
    while True:
        for event in backend.events(since):  # all there is now
            since = event.id
            item = by_id.get(event.job_id)
            if item is not None and event.kind in FINISHED_EVENTS and output.job(backend, item):
                del by_id[event.job_id]  # written: each line once
                view.finished()
        if stop.requests != shown:
            shown = stop.requests
            view.stopping(now=shown > 1)
        if finished:
            return
        # Done is read before the next read of the events, so none is left behind.
        finished = wait_done(FOLLOW_LOOK_S)
