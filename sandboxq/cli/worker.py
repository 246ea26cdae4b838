"""``sandboxq worker QUEUE PROCESSOR``: run a SandboxWorker until it is stopped.

    flags ────────────────┐  a flag wins over its variable, a variable over the default
    SANDBOXQ_* variables ─┼─► settings.from_env(WorkerSettings) ─► SandboxWorker(...).run()
    defaults ─────────────┘  (an error names the setting, or the variable it came from)

One log line per job outcome (the worker's own, at INFO). SIGTERM or Ctrl-C drains; a
second one stops at once. The settings model is the Python API's, so a value is refused
for the same reason whichever way it came in.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from sandboxq.cli.options import EXIT_OK, add_url, import_from_cwd, shared_url
from sandboxq.errors import ConfigError
from sandboxq.settings import WorkerSettings, from_env

log = logging.getLogger("sandboxq.cli")

#: Set on the command line as arguments, never from the environment (the URL has its own
#: variable, SANDBOXQ_URL, read when the backend is opened).
NOT_FROM_ENV = ("queue", "processor", "url")


def add_parser(verbs: Any) -> None:
    w = verbs.add_parser(
        "worker",
        help="run a worker for QUEUE with PROCESSOR (pkg.mod:fn)",
        description="Run a worker: claim jobs of QUEUE from Redis and run PROCESSOR on them "
        "in sandboxed children. SIGTERM or Ctrl-C drains; a second one stops now. Every "
        "setting can also come from SANDBOXQ_<SETTING> (e.g. SANDBOXQ_CONCURRENCY=4); "
        "a flag wins over its variable.",
    )
    w.add_argument("queue")
    w.add_argument("processor", help="the handler, as package.module:function")
    add_url(w)
    add_pool_flags(w)
    w.add_argument("--lease-s", type=float, help="lease length (default 30)")
    w.add_argument("--max-jobs-per-child", type=int, help="recycle a child after N jobs")
    w.add_argument(
        "--prefetch", type=int, help="jobs claimed beyond the children (default: adaptive)"
    )
    w.add_argument(
        "--stop-timeout-s", type=float, help="how long a drain waits for jobs (default 30)"
    )
    w.add_argument(
        "--exit-code",
        action="append",
        metavar="N=ACTION",
        help="map a handler exit code to complete/retry/fail (repeatable)",
    )
    w.add_argument(
        "--allow-pickle", action="store_true", default=None, help="accept pickle payloads"
    )
    w.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics on this port (0: a free one, logged); off by default",
    )
    w.add_argument("--metrics-host", help="the address metrics are served on (default 127.0.0.1)")
    w.add_argument("--burst", action="store_true", help="stop once the queue is empty")
    w.set_defaults(run=run, log_level=logging.INFO)


def add_pool_flags(parser: argparse.ArgumentParser) -> None:
    """The flags ``worker`` and ``run`` share."""
    parser.add_argument("--concurrency", type=int, help="children (default: CPU count)")
    parser.add_argument("--soft-timeout-s", type=float, help="SoftTimeout raised in the handler")
    parser.add_argument("--hard-timeout-s", type=float, help="the child's process tree killed")
    parser.add_argument("--retries", type=int, help="retries after a failed attempt (default 0)")
    parser.add_argument("--max-memory-mb", type=float, help="kill a child over this much memory")
    add_containment_flags(parser)


def add_containment_flags(parser: argparse.ArgumentParser) -> None:
    """Containment and rlimits (README "Containment")."""
    parser.add_argument(
        "--containment",
        choices=["auto", "cgroup", "process_tree"],
        help="control groups where writable (auto, the default), forced, or never",
    )
    parser.add_argument(
        "--max-processes", type=int, help="pids limit of a child's control group (default 1024)"
    )
    parser.add_argument("--cpu-time-s", type=float, help="CPU time per attempt: cpu_limit")
    parser.add_argument("--max-open-files", type=int, help="RLIMIT_NOFILE of a child")
    parser.add_argument("--max-file-size-mb", type=float, help="RLIMIT_FSIZE of a child")
    parser.add_argument(
        "--max-address-space-mb", type=float, help="RLIMIT_AS: breaks numpy/OpenBLAS, opt-in"
    )
    parser.add_argument(
        "--core-dumps", action="store_true", default=None, help="allow core files (default off)"
    )
    parser.add_argument(
        "--keep-strays",
        action="store_true",
        default=None,
        help="let processes an attempt started outlive it (default: killed with it)",
    )
    parser.add_argument(
        "--max-child-growth-mb", type=float, help="replace a child that grew by more than this"
    )


#: The containment flags, by setting name: passed on as they are.
CONTAINMENT_FLAGS = (
    "containment",
    "max_processes",
    "cpu_time_s",
    "max_open_files",
    "max_file_size_mb",
    "max_address_space_mb",
    "core_dumps",
    "keep_strays",
    "max_child_growth_mb",
)


def settings(args: argparse.Namespace, *, queue: str, url: str, **flags: Any) -> WorkerSettings:
    """Worker settings from the flags both verbs share, ``flags``, and the environment."""
    return from_env(
        WorkerSettings,
        skip=NOT_FROM_ENV,
        defaults={"concurrency": os.cpu_count() or 1},
        queue=queue,
        processor=args.processor,
        url=url,
        concurrency=args.concurrency,
        soft_timeout_s=args.soft_timeout_s,
        hard_timeout_s=args.hard_timeout_s,
        retries=args.retries,
        max_memory_mb=args.max_memory_mb,
        **{name: getattr(args, name, None) for name in CONTAINMENT_FLAGS},
        **flags,
    )


def parse_exit_codes(items: list[str] | None) -> dict[int, str] | None:
    if not items:
        return None
    codes: dict[int, str] = {}
    for item in items:
        code, sep, action = item.partition("=")
        try:
            codes[int(code)] = action
        except ValueError:
            sep = ""
        if not sep or not action:
            raise ConfigError(f"--exit-code {item!r} is not N=ACTION, e.g. --exit-code 3=retry")
    return codes


def run(args: argparse.Namespace) -> int:
    from sandboxq.worker import SandboxWorker

    chosen = settings(
        args,
        queue=args.queue,
        url=shared_url(args.url),
        lease_s=args.lease_s,
        max_jobs_per_child=args.max_jobs_per_child,
        prefetch=args.prefetch,
        stop_timeout_s=args.stop_timeout_s,
        exit_codes=parse_exit_codes(args.exit_code),
        allow_pickle=args.allow_pickle,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
    )
    import_from_cwd()
    worker = SandboxWorker(**chosen.model_dump())
    worker.run(burst=args.burst)
    log.info("worker %s stopped: %s", worker.id, worker.stats)
    return EXIT_OK
