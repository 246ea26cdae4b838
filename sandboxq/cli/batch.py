"""``sandboxq run PROCESSOR INPUT.jsonl``: a local batch through the sandboxed pool, no Redis.

    INPUT.jsonl ─► read_input (run_files.py): one Item per non-blank line (malformed ones
        │          keep their error)
        │ good lines, as jobs "line-<n>"
        ▼
    memory:// queue (a fresh one) ◄── SandboxWorker.run(burst=True), on a thread of its own
        │ events: completed / failed / retried
        ▼
    main thread: follow() ─► Output: one JSON line per input line ─► --output or stdout
                     └────► BatchView: progress bar, then the summary (stderr)

The worker is the production one (leases, exit policy, retries, timeouts, kills), on the
in-memory backend. The main thread keeps the signals: the first Ctrl-C (or SIGTERM, or
the terminal's hangup) drains, letting running jobs finish; a second one kills them. A
line killed while it ran is written as that attempt ended (``interrupted``, with how long
it ran and any stack the pool took), and lines that never started as ``not_run``; both
are listed, so nothing is silently lost; the exit status is then a shell's for the first
signal (130 for Ctrl-C, 143 for SIGTERM, 129 for a hangup).

An ``--output`` that holds lines already is refused unless ``--overwrite``; with
``--skip-done`` its finished rows are kept and only the other lines run (run_readback.py).

Malformed lines are reported (with their line numbers) before anything runs and then
written as ``malformed``, and the rest of the batch runs: one bad line among thousands
should not cost the others, and the user learns of it at once instead of at the end.
``--strict`` stops before anything runs instead.

With ``--url``/``--queue``/``--resume`` the same command runs the file as a batch over
every worker serving that queue (run_fleet.py), with the same files (run_files.py) and view.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import stat
import sys
import threading
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from typing import IO, Any

from sandboxq.backends.base import Backend, NewJob
from sandboxq.cli import render
from sandboxq.cli.batch_view import MALFORMED, BatchView, Tally
from sandboxq.cli.options import (
    EXIT_ERROR,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_RESULTS_UNREAD,
    Exit,
    add_setting_flags,
    import_from_cwd,
    setting_flags,
)
from sandboxq.cli.run_files import (
    EXAMPLE,
    Item,
    Output,
    empty_output,
    open_output,
    read_input,
    refuse_earlier_lines,
    stdout_for_results,
)
from sandboxq.cli.run_readback import WrittenRow, finished_rows, foreign_row, keep_only
from sandboxq.cli.worker import FLAG_FORMS, POOL_FLAGS, settings
from sandboxq.errors import ConfigError
from sandboxq.settings import WorkerSettings

log = logging.getLogger("sandboxq.cli")

#: How long a fleet run's follower waits for finished members before it looks again.
FOLLOW_TICK_S = 0.2
#: How often a local run reads the events of the lines that finished meanwhile.
FOLLOW_LOOK_S = 0.05
FINISHED_EVENTS = ("completed", "failed", "cancelled")


def add_parser(verbs: Any) -> None:
    r = verbs.add_parser(
        "run",
        help="run a JSONL file of jobs through the sandboxed pool: here (no Redis), or "
        "as one batch on a queue's workers (--queue)",
        description="Run every line of INPUT (a JSON object per line, "
        f"e.g. {EXAMPLE}; both keys optional) through PROCESSOR in sandboxed children, "
        "here (no Redis) or, with --queue, on the workers of that queue (see below), "
        "with a progress bar. Each output line is a JSON object: the input line number, "
        "the outcome (ok, error, hard_timeout, ..., interrupted, malformed, not_run), the "
        "attempts, and the result or the error. Ctrl-C lets running jobs finish; a second one "
        "stops at once. Worker settings also come from SANDBOXQ_<SETTING> variables.",
    )
    r.add_argument("processor", nargs="?", help="the handler, as package.module:function")
    r.add_argument("input", nargs="?", metavar="INPUT.jsonl")
    r.add_argument("--output", metavar="OUT.jsonl", help="write results here (default: stdout)")
    r.add_argument(
        "--skip-done",
        action="store_true",
        help="run only the lines --output does not hold as finished (an earlier run's file, "
        "stopped or crashed): its lines that did not run, were stopped or were malformed run "
        "again, and the file ends with one row per line",
    )
    r.add_argument(
        "--overwrite",
        action="store_true",
        help="replace what --output holds (without it, a file that holds lines is refused)",
    )
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


# -- running ------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    if args.output and args.input and _same_file(args.output, args.input):
        raise ConfigError(
            f"--output {args.output} is the input file: writing it would lose the input's "
            "lines; write the results to another file"
        )
    fleet = bool(args.queue or args.url or args.resume)
    _check_output_flags(args, fleet)
    with ExitStack() as stack:
        if not args.output:
            stack.enter_context(stdout_for_results())
        try:
            if fleet:
                from sandboxq.cli import run_fleet

                return run_fleet.run(args)
            return _run_here(args)
        except BrokenPipeError:
            return _results_unread(args)


def _check_output_flags(args: argparse.Namespace, fleet: bool) -> None:
    """--skip-done and --overwrite: what each needs, and what each cannot go with."""
    if args.skip_done and args.overwrite:
        raise ConfigError(
            "--skip-done keeps what --output holds and --overwrite replaces it: give one"
        )
    if args.skip_done and not args.output:
        raise ConfigError("--skip-done needs --output OUT.jsonl: the file an earlier run wrote")
    if args.skip_done and fleet:
        raise ConfigError(
            "--skip-done is for a run here; over a fleet, --resume BATCH_ID --output OUT "
            "writes what the batch an earlier run sent did not write yet"
        )
    if args.overwrite and args.resume:
        raise ConfigError("--resume appends to the file its batch's run wrote: no --overwrite")


def _results_unread(args: argparse.Namespace) -> int:
    """The reader of the results closed stdout (``sandboxq run ... | head``): the run
    stopped, as the tools of a pipeline do, with one line on stderr and 128 + SIGPIPE
    (it printed a traceback and 'the pool is broken'; ``Output.write``)."""
    where = (
        ""
        if not (args.queue or args.url or args.resume)
        else ("; the batch goes on: re-attach with sandboxq run --resume BATCH_ID --output FILE")
    )
    print(f"sandboxq run: the results' reader closed stdout: stopped{where}", file=sys.stderr)
    return EXIT_RESULTS_UNREAD


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet): not the same
        return False


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
        file, done = _open_output(args, files, good, bad)
        output = Output(file, tally)
        output.written_before(done)
        good = [item for item in good if item.line not in output.written]
        for item in bad:
            output.write(item.line, MALFORMED, attempts=0, error=item.error)
        backend.enqueue([NewJob(item.payload or b"", job_id=item.job_id) for item in good])
        stop = StopRequests(lambda now: worker.stop(now=now))
        redirect = file is None and sys.stdout.isatty()
        try:
            with BatchView(len(good), tally, redirect_stdout=redirect) as view:
                if good:  # else there is nothing to start a pool for
                    _run_worker(
                        worker,
                        stop,
                        lambda wait_done: follow(backend, good, output, view, stop, wait_done),
                    )
        except BaseException as exc:
            # A pool that could not start (or broke) wrote nothing for the lines it had:
            # each is still written, as it ended or as not run. Not to a reader who left.
            if not isinstance(exc, BrokenPipeError):
                _write_the_rest(backend, good, output)
            raise
        _write_the_rest(backend, good, output)
    view.summary(args.input, interrupted=stop.requests > 0)
    if stop.requests:
        return stop.exit_status()
    return EXIT_OK if tally.all_ok else EXIT_FAILED


def _write_the_rest(backend: Backend, good: list[Item], output: Output) -> None:
    """Write what the events did not deliver, and the lines that never ran."""
    for item in good:
        if item.line not in output.written and not output.job(backend, item):
            output.not_run(backend, item)


def _open_output(
    args: argparse.Namespace, files: ExitStack, good: list[Item], bad: list[Item]
) -> tuple[IO[str] | None, list[WrittenRow]]:
    """The output a run here writes (None: stdout), and the rows it keeps: with
    --skip-done, those of the lines an earlier run finished, checked to be this input's
    before the file is cut down to them; else none, the file emptied (refused when it
    holds lines, unless --overwrite)."""
    if not args.output:
        return None, []
    file = files.enter_context(open_output(args.output))
    if not args.skip_done:
        refuse_earlier_lines(file.fileno(), args.output, overwrite=args.overwrite, skip_done=True)
        empty_output(file.fileno())
        return file, []
    if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):  # a terminal, a pipe: no rows
        raise ConfigError(f"--skip-done reads --output back: {args.output} is not a file")
    done = finished_rows(args.output)
    good_lines, bad_lines = [i.line for i in good], [i.line for i in bad]
    if why := foreign_row(done, good_lines, bad_lines, args.input):
        raise ConfigError(
            f"{args.output} {why}: it was written for another input; --skip-done needs the "
            "output of a run of this file"
        )
    return files.enter_context(keep_only(file, args.output, done)), done


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


class StopRequests:
    """A run's SIGINT / SIGTERM (and, here, SIGHUP) handler: the first request drains, the
    next stops now.

    Only a count, the first signal and a wake-up happen here: the main thread may be
    mid-write when a signal lands, so it shows the message itself. ``on_request(now)``
    is the wake-up (the local run's worker; a fleet run's main thread acts on the count)."""

    def __init__(self, on_request: Callable[[bool], None] | None = None) -> None:
        self._on_request = on_request
        self.requests = 0
        self.first_signal: int | None = None

    def __call__(self, signum: int, frame: object) -> None:
        if signum == signal.SIGHUP:
            render.leave_a_closed_terminal()  # before anything shows the stop on it
        self.requests += 1
        if self.first_signal is None:
            self.first_signal = signum
        if self._on_request is not None:
            self._on_request(self.requests > 1)

    def exit_status(self) -> int:
        """128 + the first signal, as a shell reports a process that signal ended (130
        for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP)."""
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
    # A hangup (the terminal closed) too: it killed the run, leaving the lines that had
    # not finished unwritten. Over a fleet it still ends the run alone: the batch goes on.
    stops = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, stop) for sig in stops}

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
    children need. The lines that ended since the last look are read back together
    (``Output.jobs``: two calls for them all, not two a line and a whole record each) and
    the bar moves once for them. ``wait_done(s)`` waits up to ``s`` for the worker to be
    done."""
    by_id = {item.job_id: item for item in items}
    since: str | None = None
    shown = 0  # stop requests already shown
    finished = False
    while True:
        ended: dict[str, Item] = {}  # the lines to write now, read back in one go
        for event in backend.events(since):  # all there is now
            since = event.id
            item = by_id.get(event.job_id)
            if item is not None and event.kind in FINISHED_EVENTS:
                ended[event.job_id] = item
        written = output.jobs(backend, list(ended.values()))
        for item in written:
            del by_id[item.job_id]  # written: each line once
        if written:
            view.finished()
        if stop.requests != shown:
            shown = stop.requests
            view.stopping(now=shown > 1)
        if finished:
            return
        # Done is read before the next read of the events, so none is left behind.
        finished = wait_done(FOLLOW_LOOK_S)
