"""``sandboxq worker QUEUE PROCESSOR``: run a SandboxWorker until it is stopped.

    flags ────────────────┐  a flag wins over its variable, a variable over the default
    SANDBOXQ_* variables ─┼─► settings.from_env(WorkerSettings) ─► SandboxWorker(...).run()
    defaults ─────────────┘  (an error names the setting, or the variable it came from)

One log line per job outcome (the worker's own, at INFO). SIGTERM or Ctrl-C drains; a
second one stops at once. Stopped by Ctrl-C (SIGINT, once or twice), it exits 130, as
the shell reports a command Ctrl-C ended; otherwise 0. The settings model is the Python
API's, so a value is refused for the same reason whichever way it came in; each flag is
made from its field (``options.add_setting_flags``: name, type, help, the default
shown), ``run``'s too.
"""

from __future__ import annotations

import argparse
import logging
import signal
from typing import Any

from sandboxq.cli.options import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    add_setting_flags,
    add_url,
    import_from_cwd,
    own_first,
    setting_flags,
    shared_url,
)
from sandboxq.errors import ConfigError
from sandboxq.settings import ContainmentSettings, WorkerSettings, from_env

log = logging.getLogger("sandboxq.cli")

#: Set on the command line as arguments, never from the environment (the URL has its own
#: variable, SANDBOXQ_URL, read when the backend is opened).
NOT_FROM_ENV = ("queue", "processor", "url")
#: Worker settings with no flag of their own: the arguments above, and tuning that comes
#: from the environment (or the Python API) only.
NO_FLAG = (*NOT_FROM_ENV, "renew_interval_s", "stall_check_s", "start_method", "import_timeout_s")
#: The flags of ``worker``, one per setting, the worker's own first.
WORKER_FLAGS = tuple(name for name in own_first(WorkerSettings) if name not in NO_FLAG)
#: The flags ``run`` shares with ``worker``: a local batch has no lease, metrics or pickle.
POOL_FLAGS = (
    "concurrency",
    "soft_timeout_s",
    "hard_timeout_s",
    "retries",
    "max_memory_mb",
    *ContainmentSettings.model_fields,
    "stop_timeout_s",
    "capture_output",
    "max_queue_s",
    "deadline_s",
    "progress_timeout_s",
    "memory_retry_factor",
    "memory_retry_max_mb",
    "pool_memory_mb",
)
#: Flags not spelt after their setting: ``--exit-code 3=retry``, once per code; a switch
#: that is on by default is turned off (``--no-capture-output``).
FLAG_FORMS = {
    "exit_codes": ("--exit-code", {"action": "append", "metavar": "N=ACTION"}),
    "capture_output": ("--no-capture-output", {"action": "store_false"}),
}


def add_parser(verbs: Any) -> None:
    w = verbs.add_parser(
        "worker",
        help="run a worker for QUEUE with PROCESSOR (pkg.mod:fn)",
        description="Run a worker: claim jobs of QUEUE from Redis and run PROCESSOR on them "
        "in sandboxed children. SIGTERM, Ctrl-C or SIGHUP drains; a second one stops now. "
        "Every setting can also come from SANDBOXQ_<SETTING> (e.g. SANDBOXQ_CONCURRENCY=4); "
        "a flag wins over its variable.",
    )
    w.add_argument("queue")
    w.add_argument("processor", help=WorkerSettings.model_fields["processor"].description)
    add_url(w)
    add_setting_flags(w, WorkerSettings, WORKER_FLAGS, FLAG_FORMS)
    w.add_argument("--burst", action="store_true", help="stop once the queue is empty")
    w.set_defaults(run=run, log_level=logging.INFO)


def settings(args: argparse.Namespace, *, queue: str, url: str, **flags: Any) -> WorkerSettings:
    """Worker settings from ``flags`` (None: left out), and the environment."""
    return from_env(
        WorkerSettings,
        skip=NOT_FROM_ENV,
        queue=queue,
        processor=args.processor,
        url=url,
        **flags,
    )


def parse_exit_codes(items: list[str] | None) -> dict[int, str] | None:
    if not items:
        return None
    codes: dict[int, str] = {}
    for item in items:
        code, sep, action = item.partition("=")
        try:
            number = int(code)
        except ValueError:
            sep = ""
        if not sep or not action:
            raise ConfigError(f"--exit-code {item!r} is not N=ACTION, e.g. --exit-code 3=retry")
        if codes.get(number, action) != action:  # which one was meant cannot be guessed
            raise ConfigError(
                f"--exit-code {number}={codes[number]} and --exit-code {item}: one action a code"
            )
        codes[number] = action
    return codes


def run(args: argparse.Namespace) -> int:
    from sandboxq.worker import SandboxWorker

    flags = setting_flags(args, WORKER_FLAGS)
    flags["exit_codes"] = parse_exit_codes(flags["exit_codes"])
    chosen = settings(args, queue=args.queue, url=shared_url(args.url), **flags)
    import_from_cwd()
    worker = SandboxWorker(**chosen.model_dump())
    worker.run(burst=args.burst)
    log.info("worker %s stopped: %s", worker.id, worker.stats)
    return EXIT_INTERRUPTED if signal.SIGINT in worker.signals else EXIT_OK
