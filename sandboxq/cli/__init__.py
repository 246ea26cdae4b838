"""The ``sandboxq`` command (also ``python -m sandboxq``).

    main(argv) ─► parser: one sub-command per verb ─► args.run(args) ─► exit status
                                                      │ SandboxqError / Exit / Ctrl-C
                                                      ▼
                                          "sandboxq: error: <one line>" on stderr

    worker.py   worker                        run a SandboxWorker (Redis)
    enqueue.py  enqueue                       add a job; --wait for its result
    admin.py    info jobs job retry cancel purge   read and manage a queue (Redis)
    batch.py    run                           a JSONL file through the pool, locally
    run_fleet.py run --url --queue [--resume] the same file as a batch over a fleet
    run_files.py, run_label.py                 the input and output files both share; the
    run_readback.py                            fleet batch's label; an output read back
                                               (a fleet --resume, a local --skip-done)
    batches.py  batch                         one batch: progress, failures; retry, cancel
    dashboard.py dashboard                    the web dashboard (sandboxq[web])
    exporter.py exporter                      queue gauges from Redis for Prometheus

A user's mistake (bad processor path, invalid settings, unreachable Redis, malformed
input) ends with a one-line reason and no traceback; a traceback means a bug in sandboxq.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from sandboxq.cli import admin, batch, batches, dashboard, enqueue, exporter, queues, worker
from sandboxq.cli.options import EXIT_ERROR, EXIT_FAILED, EXIT_INTERRUPTED, Exit
from sandboxq.errors import SandboxqError

EPILOG = """\
exit status: 0 done; 1 a job failed (or nothing to retry/cancel); 2 bad input or
settings, unreachable Redis, unimportable processor; 3 `enqueue --wait --timeout-s`
ran out; 130 stopped by Ctrl-C (`run`: 143 by SIGTERM, 129 by a hangup).
environment: SANDBOXQ_URL (the Redis URL), and SANDBOXQ_<SETTING> for every worker
setting (SANDBOXQ_CONCURRENCY, SANDBOXQ_LEASE_S, SANDBOXQ_HARD_TIMEOUT_S, ...);
a flag wins over its variable."""


class _Parser(argparse.ArgumentParser):
    """argparse's parser, its usage errors in one line: the whole usage before them (some
    30 lines for ``worker``) buried the line that says what was wrong."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


@functools.cache
def build_parser() -> argparse.ArgumentParser:
    """The command line's parser, built once per process: it is the same every time (what
    the environment says is read when a verb runs), and building every verb's flags takes
    6.5 ms, paid per call by a process that runs ``main`` many times (a test suite)."""
    parser = _Parser(
        prog="sandboxq",
        description="A job queue whose handlers run in sandboxed, killable child processes.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    worker.add_parser(verbs)
    batch.add_parser(verbs)
    enqueue.add_parser(verbs)
    admin.add_parsers(verbs)
    batches.add_parser(verbs)
    dashboard.add_parser(verbs)
    exporter.add_parser(verbs)
    queues.add_parser(verbs)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    words = _join_negative_pairs(sys.argv[1:] if argv is None else argv)
    try:
        args, extra = parser.parse_known_args(words)
        if extra and not _late_positional(args, extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}{_hint(args, extra)}")
    except SystemExit as exc:  # --help, or a usage error argparse has already printed
        return exc.code if isinstance(exc.code, int) else EXIT_ERROR
    _configure_logging(logging.DEBUG if args.verbose else getattr(args, "log_level", 0))
    try:
        return int(args.run(args))
    except Exit as exc:
        _say(exc.message)
        return exc.code
    except SandboxqError as exc:
        _say(f"error: {exc}")
        return EXIT_ERROR
    except KeyboardInterrupt:
        _say("interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `sandboxq jobs q | head`: the reader left, and that is fine
        # As the Python docs advise: point stdout at devnull so the exit flush cannot fail.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILED


#: A word argparse would take for an option: ``-1=fail`` (a negative ``N=ACTION``).
_NEGATIVE_PAIR = re.compile(r"-\d+=")


def _join_negative_pairs(argv: Sequence[str]) -> list[str]:
    """``--exit-code -1=fail`` as ``--exit-code=-1=fail``.

    argparse reads a word that starts with '-' as an option unless it is a negative
    number, so the value never reached its flag ("expected one argument"). Joined, it
    does, and the flag's own check names what is wrong with it. No option of sandboxq
    starts with a digit, so such a word after an option can only be its value.
    """
    words = list(argv)
    for i in range(len(words) - 1, 0, -1):
        option, value = words[i - 1], words[i]
        if option.startswith("--") and "=" not in option and _NEGATIVE_PAIR.match(value):
            words[i - 1 : i + 1] = [f"{option}={value}"]
    return words


def _late_positional(args: argparse.Namespace, extra: list[str]) -> bool:
    """Take a verb's optional last argument when options came before it.

    argparse binds an optional positional (``retry QUEUE [ID]``) to nothing as soon as an
    option follows the one before it, so ``retry q --url U ID`` would leave ``ID`` over.
    A verb names that argument in ``late_positional``; one word left over is it.
    """
    name = getattr(args, "late_positional", None)
    if name is None or getattr(args, name) is not None or len(extra) != 1:
        return False
    if extra[0].startswith("-"):
        return False
    setattr(args, name, extra[0])
    return True


def _hint(args: argparse.Namespace, extra: list[str]) -> str:
    """What a verb says of words left over (its ``words_hint``), when none is an option:
    ``enqueue q a b`` most likely meant the job's arguments."""
    hint = getattr(args, "words_hint", None)
    if hint is None or any(word.startswith("-") for word in extra):
        return ""
    return f" ({hint(extra)})"


def _say(message: str) -> None:
    """One line on stderr, whatever the message holds (an import error can span several)."""
    print(f"sandboxq: {' '.join(message.split())}", file=sys.stderr, flush=True)


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to the ``sys.stderr`` of the moment: a live progress display replaces it to
    print log lines above the bar, and a test's capture replaces it too."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


class _EveryLineFormatter(logging.Formatter):
    """Time, level and logger in front of *every* line of a message: the worker logs the
    outcomes of one batch of jobs as one record holding one line per job."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if record.exc_info or record.stack_info:
            return text
        message = record.getMessage()
        if "\n" not in message:
            return text
        head = text[: len(text) - len(message)]
        return "\n".join(head + line for line in message.split("\n"))


def _configure_logging(level: int) -> None:
    """The ``sandboxq`` loggers at ``level`` (WARNING when a verb does not say), once per
    process however often ``main`` runs."""
    # A worker logs a line per job: skip the record fields our format never shows (the
    # logging HOWTO's "Optimization" settings; this process is ours to configure).
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    logging._srcfile = None
    logger = logging.getLogger("sandboxq")
    logger.setLevel(level or logging.WARNING)
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(_EveryLineFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
