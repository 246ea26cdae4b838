"""``sandboxq run PROCESSOR INPUT.jsonl --url URL --queue NAME``: the local run, over a fleet.

    INPUT.jsonl ─► read_input (run_files.py): good lines become members 0..n-1 of one batch
        │          (its label, run_label.py: the input's name, the good and the malformed
        │          line numbers)
        ▼
    QUEUE on Redis ◄── every worker serving it, on any machine; and with --concurrency N,
        │              a SandboxWorker of N children on a thread here, stopped once the
        │              batch is done
        ▼ the batch's stream of finished members (Batch.as_completed's StreamReader)
    main thread ─► get_many (one round trip per read) ─► Output: the local mode's JSON lines
                                                     └─► BatchView: progress bar, summary

The output (run_files.py), progress bar, summary and exit statuses are the local mode's
(batch.py), so a file gives the same lines either way (in the order the lines finish).

What can refuse the run does so before its first line is sent, in this order: the flags;
with --concurrency N, the settings of the worker run here (its processor imported, its
user and group looked up: only what its pool's start finds, a containment the machine
refuses, comes later); the input (--strict, each call encoded, the label); then
``--output`` opened under its lock, then emptied only once the batch is sent. A refusal
(exit 2) leaves nothing in the queue and the output as it was: once lines are sent, a run
that stops leaves them waiting for no one.

Ctrl-C, as in the local mode, cancels what has not started (``Batch.cancel(running=False)``:
those members never run) and lets the running ones finish (Redis knows a member claimed,
not started: one a worker prefetched counts as running), writes what was cancelled as
``not_run`` once the cancellations are final, and exits 130; a second Ctrl-C cancels the
running ones too (the fenced hand-over), written as ``cancelled`` with how long they ran
(a member whose worker had not yet published its child's pid, 0.2 to 0.5 s after the
start (``RegistryRefresh``), cannot be told from one claimed ahead: ``not_run``), and
stops at once. A Ctrl-C while the lines are
being sent is acted on the same way once they are all in the queue (a send cut short would
leave its part waiting for any worker, with no one to write it).

``--resume BATCH_ID --output OUT`` re-attaches from any process: the line number of each
member comes from the batch's label, and what is written already from OUT itself: every
whole row of OUT is a line written (its ``line`` and ``outcome`` count in the summary),
a last line cut short by a crash is dropped, and the rest is appended as it finishes. An
OUT whose rows cannot be the batch's (a line it never had, a line it sent written as
malformed, a malformed one written as run: written for another input) is refused and
left as it was.
"""

from __future__ import annotations

import argparse
import math
import shlex
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from sandboxq import text, tracing
from sandboxq.backends.base import JobStanding, NewJob
from sandboxq.batch import RESULTS_CHUNK, Batch, StreamReader, check_batch_calls, new_batch_id
from sandboxq.cli.batch import FOLLOW_TICK_S, StopRequests, checked_worker_settings
from sandboxq.cli.batch_view import MALFORMED, NOT_RUN, BatchView, Tally
from sandboxq.cli.options import (
    EXIT_FAILED,
    EXIT_OK,
    Exit,
    setting_flags,
    shared_url,
)
from sandboxq.cli.run_files import (
    Item,
    Output,
    empty_output,
    open_output,
    read_input,
    refuse_earlier_lines,
)
from sandboxq.cli.run_label import make_label, read_label
from sandboxq.cli.run_readback import end_on_a_whole_row, foreign_row, written_lines
from sandboxq.cli.worker import FLAG_FORMS, POOL_FLAGS
from sandboxq.client import Job, JobMaker, Queue
from sandboxq.errors import BatchNotFound, ConfigError
from sandboxq.models import JobOptions, JobState, member_id
from sandboxq.redaction import redact_url
from sandboxq.settings import WorkerSettings, build

#: After a Ctrl-C, how often the lines not started are cancelled again while the local
#: worker stops: what it had claimed ahead and hands back is waiting again, and only then
#: can it be cancelled. A pass reads every member, so not at every tick.
RECANCEL_S = 1.0

#: The flags that become each member's job options (the workers' own settings otherwise).
JOB_FLAGS = (
    "soft_timeout_s",
    "hard_timeout_s",
    "retries",
    "max_memory_mb",
    "max_queue_s",
    "deadline_s",
    "progress_timeout_s",
)


def run(args: argparse.Namespace) -> int:
    if not args.queue:
        raise ConfigError("run --url (or --resume) needs --queue NAME: the queue to send to")
    url = shared_url(args.url)
    concurrency = args.concurrency or 0
    if args.resume and args.input:
        raise ConfigError("run --resume takes no INPUT.jsonl: the batch has its lines")
    if args.resume and not args.output:
        raise ConfigError("run --resume needs --output OUT.jsonl: the file the first run wrote")
    if not args.resume and not (args.processor and args.input):
        raise ConfigError("run takes PROCESSOR and INPUT.jsonl (or --resume BATCH_ID)")
    if concurrency and not args.processor:
        raise ConfigError("run --concurrency N needs PROCESSOR for the children it runs here")
    if not concurrency and (ignored := _pool_only_flags(args)):
        raise ConfigError(
            f"{ignored[0]} applies to the children --concurrency N runs here, and this run "
            f"starts none: add --concurrency N, or give it to the workers serving queue "
            f"{args.queue}"
        )
    options = {k: v for k, v in setting_flags(args, JOB_FLAGS).items() if v is not None}
    maker = JobMaker("json", build(JobOptions, **options))
    # Before anything is sent: a worker here that fails to start once the lines are in the
    # queue leaves them waiting there, with the run gone (exit 2) and nothing to write them.
    here = checked_worker_settings(args, args.queue, url) if concurrency else None
    stop = StopRequests()
    with Queue(args.queue, url) as queue, ExitStack() as stack:
        if args.resume:
            batch, lines, malformed = _reattach(queue, args.resume)
            # ours before its lines are read: no other run writes it meanwhile
            appended = stack.enter_context(open_output(args.output))
            source = f"batch {batch.id}"
            stack.enter_context(_signals_to(stop))
            return _follow(queue, batch, lines, malformed, source, here, appended, args, stop)
        outgoing = _prepare(maker, args)
        if here is None:
            print(
                f"sandboxq: {text.clip(args.processor, 200)} is not run here (no --concurrency): "
                f"each line runs with the processor of the worker serving queue "
                f"{text.clip(queue.name, 200)} that takes it",
                file=sys.stderr,
            )
        # Ours before anything is sent: a run refused here (another run writes the file,
        # or it holds an earlier run's lines) leaves no lines in the queue behind it,
        # waiting for a run that is gone. Emptied once the batch went: a send refused
        # (Redis unreachable) leaves it as it was.
        file = stack.enter_context(open_output(args.output)) if args.output else None
        if file is not None:
            refuse_earlier_lines(file.fileno(), args.output, overwrite=args.overwrite)
        # From the first line sent, a Ctrl-C is the follower's (it cancels what has not
        # run): one that ended the send part-way left its lines waiting for any worker.
        stack.enter_context(_signals_to(stop))
        batch = _send(queue, outgoing, args)
        if file is not None:
            empty_output(file.fileno())
        lines, malformed = outgoing.lines, outgoing.malformed
        return _follow(queue, batch, lines, malformed, args.input, here, file, args, stop)


@contextmanager
def _signals_to(stop: StopRequests) -> Iterator[None]:
    """SIGINT and SIGTERM counted by ``stop`` while the block runs (a request the send
    gets is acted on by the follower, once the lines are all in the queue)."""
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _pool_only_flags(args: argparse.Namespace) -> list[str]:
    """The flags given that only a worker run here would use (its pool's, not the jobs')."""
    names = [n for n in POOL_FLAGS if n != "concurrency" and n not in JOB_FLAGS]
    return [_flag(n) for n in names if getattr(args, n) is not None]


def _flag(name: str) -> str:
    form = FLAG_FORMS.get(name)
    return form[0] if form else "--" + name.replace("_", "-")


# -- sending and re-attaching -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Outgoing:
    """An input file read, checked and encoded as a batch, not sent yet."""

    id: str  # "" when no line is good: nothing to send
    jobs: list[NewJob]
    label: str
    lines: list[int]  # the input line number of each member, in member order
    malformed: dict[int, str]  # line number -> why it cannot run


def _prepare(maker: JobMaker, args: argparse.Namespace) -> _Outgoing:
    """Everything about the batch that can be refused without Redis: its lines read
    (``--strict``), each call encoded and checked, its label built."""
    items = read_input(args.input)
    good = [item for item in items if item.payload is not None]
    bad = {item.line: item.error or "" for item in items if item.payload is None}
    for line, error in bad.items():
        print(f"sandboxq: {args.input} line {line}: {error}", file=sys.stderr)
    if bad and args.strict:
        raise Exit(f"{len(bad)} malformed line(s) in {args.input}; nothing was run", 2)
    lines = [item.line for item in good]
    if not good:
        return _Outgoing("", [], "", lines, bad)
    batch_id = new_batch_id()
    label = make_label(str(Path(args.input).name), lines, bad)
    jobs = [_member(maker, batch_id, n, item) for n, item in enumerate(good)]
    check_batch_calls(jobs, None, None)
    return _Outgoing(batch_id, jobs, label, lines, bad)


def _reattach_command(args: argparse.Namespace, batch_id: str, output: str | None) -> str:
    """The command that re-attaches to batch ``batch_id``, writing to ``output``: with the
    processor and the children this run had here, if any. Without them a run whose batch
    no worker serves re-attached to lines no one would ever run."""
    here = ""
    if args.concurrency:
        here = f"{shlex.quote(args.processor)} --concurrency {args.concurrency} "
    where = shlex.quote(redact_url(shared_url(args.url)))
    return (
        f"sandboxq run {here}--resume {batch_id} --url {where} --queue "
        f"{shlex.quote(args.queue)} --output {shlex.quote(output) if output else 'OUT.jsonl'}"
    )


def _send(queue: Queue, outgoing: _Outgoing, args: argparse.Namespace) -> Batch[Job]:
    batch_id, jobs = outgoing.id, outgoing.jobs
    if not jobs:
        return Batch(queue, "", 0)
    # Its id first: a run killed while it sends leaves part of a batch, which only its id
    # lets anyone cancel (a big file goes in many round trips).
    print(
        f"sandboxq: batch {batch_id}: sending {len(jobs)} line(s) to queue {queue.name}",
        file=sys.stderr,
        flush=True,
    )
    with tracing.enqueue_span(queue.name, jobs, batch_id):  # a no-op without a provider
        queue.backend.enqueue_batch(batch_id, jobs, label=outgoing.label)
    print(
        f"sandboxq: batch {batch_id}: {len(jobs)} line(s) sent to queue {queue.name}; "
        f"re-attach with: {_reattach_command(args, batch_id, args.output)}",
        file=sys.stderr,
        flush=True,
    )
    return Batch(queue, batch_id, len(jobs))


def _member(maker: JobMaker, batch_id: str, n: int, item: Item) -> NewJob:
    opts = maker.options
    return NewJob(
        item.payload or b"",
        "json",
        maker.options_json,
        member_id(batch_id, n),
        opts.priority,
        opts.delay_s,
    )


def _reattach(queue: Queue, batch_id: str) -> tuple[Batch[Job], list[int], dict[int, str]]:
    try:
        batch = queue.get_batch(batch_id)
    except BatchNotFound as exc:
        raise Exit(f"{exc}", EXIT_FAILED) from None
    progress = batch.progress()
    if progress.enqueued < progress.total:
        raise ConfigError(
            f"batch {batch_id!r} was only partly sent ({progress.enqueued} of "
            f"{progress.total} lines; the run that sent it was stopped while sending): it "
            f"cannot be resumed. Cancel what was sent with: sandboxq batch {queue.name} "
            f"{batch_id} --cancel, then run the file again"
        )
    lines, malformed = read_label(batch_id, progress.label, batch.total)
    why = f"malformed (reported by the run that sent batch {batch_id})"
    return batch, lines, dict.fromkeys(malformed, why)


# -- following ------------------------------------------------------------------------------


def _follow(
    queue: Queue,
    batch: Batch[Job],
    lines: list[int],
    malformed: dict[int, str],
    source: str,
    here: WorkerSettings | None,
    file: IO[str] | None,
    args: argparse.Namespace,
    stop: StopRequests,
) -> int:
    tally = Tally()
    with ExitStack() as stack:
        done = list(written_lines(args.output)) if args.resume else []
        if why := foreign_row(done, lines, malformed, source, batch.id):
            raise ConfigError(
                f"{args.output} {why}: it was written for another input; "
                "resume into the file this batch's run wrote"
            )
        if args.resume:
            end_on_a_whole_row(args.output)
        output = Output(file, tally, batch.id or None)
        output.written_before(done)
        for line, error in malformed.items():
            output.write(line, MALFORMED, attempts=0, error=error)
        left = [line for line in lines if line not in output.written]
        redirect = file is None and sys.stdout.isatty()
        view = stack.enter_context(BatchView(len(left), tally, redirect_stdout=redirect))
        if left and here is None and not queue.backend.workers() and not batch.progress().done:
            view.console.print(
                f"[yellow]no worker serves queue {text.clip(queue.name, 200)} yet: the lines "
                "run once one does (--concurrency N runs N children here)[/]",
                markup=True,
            )
        worker = _local_worker(here) if here is not None and left else None
        try:
            if left:
                _stream(queue, batch, lines, output, view, stop, worker)
        finally:
            if worker is not None:
                worker.stop(now=stop.requests > 1)
                worker.thread.join()
        _not_run(queue, batch, lines, output)
    view.summary(source, interrupted=stop.requests > 0)
    if tally.lines.get(NOT_RUN) and batch.id:
        # what the summary's "did not run" leads to: the lines the stop cancelled wait
        # for a retry, and a resume writes them, into another file (this one has them)
        print(
            f"sandboxq: to run them: sandboxq batch {shlex.quote(queue.name)} {batch.id} "
            f"--retry-failed, then {_reattach_command(args, batch.id, 'NEW.jsonl')}",
            file=sys.stderr,
        )
    if worker is not None and worker.failure:
        raise worker.failure[0]
    if stop.requests:
        return stop.exit_status()
    return EXIT_OK if tally.all_ok else EXIT_FAILED


def _stream(
    queue: Queue,
    batch: Batch[Job],
    lines: list[int],
    output: Output,
    view: BatchView,
    stop: StopRequests,
    worker: _LocalWorker | None,
) -> None:
    """Write each member's line as it finishes, until every member is final."""
    reader = StreamReader(batch.id, batch.total, None)
    backend = queue.backend
    cancelled = False
    recancel_at = math.inf
    while True:
        if stop.requests and not cancelled:
            cancelled = True
            view.stopping(
                now=False,
                text="stopping: lines not started are cancelled, running ones finish; "
                "Ctrl-C again to stop now",
            )
            if worker is not None:
                worker.stop(now=False)  # it hands back what it claimed and did not start
                recancel_at = time.monotonic() + RECANCEL_S
            batch.cancel(running=False)  # as the local mode: what runs goes on to its end
        if time.monotonic() >= recancel_at:
            # What the stopping local worker handed back is waiting again: cancelled too.
            batch.cancel(running=False)
            draining = worker is not None and worker.thread.is_alive()
            recancel_at = time.monotonic() + RECANCEL_S if draining else math.inf
        if stop.requests > 1:
            view.stopping(
                now=True, text="stopping now: running lines are cancelled, the others not run"
            )
            batch.cancel()  # the running ones too: nothing of the run goes on without it
            return
        if worker is not None and worker.failure:
            return
        # Once every member read is final, only a read that brings nothing more ends it:
        # a batch retried after it was done has every member's end, then the reopenings
        # (StreamReader.done); a batch of 1,000 is one read's worth.
        block_s = FOLLOW_TICK_S if reader.left else None
        cursor, rows = backend.batch_finished(batch.id, reader.cursor, block_s)
        if reader.done(rows):
            return
        ids = reader.took(cursor, rows)
        if not rows:
            batch.progress()  # BatchNotFound if it was forgotten meanwhile
        _write_ended(
            queue, [i for i in ids if lines[_index(i)] not in output.written], lines, output, view
        )


def _write_ended(
    queue: Queue, ids: list[str], lines: list[int], output: Output, view: BatchView
) -> None:
    """Write the lines of members ``ids``, which the stream showed final, as each ended."""
    for start in range(0, len(ids), RESULTS_CHUNK):
        chunk = ids[start : start + RESULTS_CHUNK]
        for job_id, (info, data) in zip(chunk, queue.backend.get_many(chunk), strict=True):
            line = lines[_index(job_id)]
            if info is None or not info.state.finished:
                continue  # retried since: it comes again when it ends again
            if info.state is JobState.CANCELLED:  # here by Ctrl-C, or by anyone
                output.stopped(line, info)
            else:
                output.finished(line, info, data)
            view.finished()


def _not_run(queue: Queue, batch: Batch[Job], lines: list[int], output: Output) -> None:
    """What the stream did not deliver (a second Ctrl-C stops reading it): a member that
    finished before the cancel is written as it ended (a user who runs the not_run lines
    again must not run it twice), one the cancel killed running as cancelled, the others
    as not run. Where each stands is read first, and only those whole (``_read_whole``):
    reading every member whole took 30 s after a second Ctrl-C on a run of 200,000 lines
    (146 us a member, against 23)."""
    backend = queue.backend
    todo = [member_id(batch.id, n) for n, line in enumerate(lines) if line not in output.written]
    for start in range(0, len(todo), RESULTS_CHUNK):
        chunk = todo[start : start + RESULTS_CHUNK]
        standings = backend.outcomes(chunk)
        whole = [job_id for job_id, at in zip(chunk, standings, strict=True) if _read_whole(at)]
        read = dict(zip(whole, backend.get_many(whole), strict=True)) if whole else {}
        for job_id, at in zip(chunk, standings, strict=True):
            line = lines[_index(job_id)]
            info, data = read.get(job_id, (None, None))
            if info is not None and info.state.finished and info.state is not JobState.CANCELLED:
                output.finished(line, info, data)
            else:
                output.stopped(line, info or at)


def _read_whole(at: JobStanding | None) -> bool:
    """Whether a member the stream did not deliver is read whole: one that finished before
    the cancel (its result), and one cancelled with an attempt charged (its history says
    whether that attempt ran when the cancel killed it: a few, those the fleet held)."""
    if at is None or not at.state.finished:
        return False
    return at.state is not JobState.CANCELLED or at.attempts > 0


def _index(job_id: str) -> int:
    return int(job_id.rpartition(".")[2])


class _LocalWorker:
    """A SandboxWorker for the batch's queue on a thread here (``--concurrency N``)."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.failure: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, name="sandboxq-run-worker", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.worker.run()
        except BaseException as exc:  # re-raised on the main thread
            self.failure.append(exc)

    def stop(self, now: bool) -> None:
        self.worker.stop(now=now)


def _local_worker(chosen: WorkerSettings) -> _LocalWorker:
    from sandboxq.worker import SandboxWorker

    return _LocalWorker(SandboxWorker(**chosen.model_dump()))
