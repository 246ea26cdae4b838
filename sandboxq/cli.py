"""The ``sandboxq`` command (also ``python -m sandboxq``).

    sandboxq worker QUEUE PROCESSOR [--url URL] [--concurrency N] [--lease-s S] ...

User errors (bad processor path, invalid settings, unreachable Redis) exit non-zero with a
one-line reason, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from sandboxq.errors import ConfigError, SandboxqError

log = logging.getLogger("sandboxq")


def _worker(args: argparse.Namespace) -> int:
    from sandboxq.worker import SandboxWorker

    exit_codes = {}
    for item in args.exit_code or []:
        code, sep, action = item.partition("=")
        if not sep or not code.strip().lstrip("-").isdigit():
            raise ConfigError(
                f"--exit-code {item!r}: expected N=ACTION, N an exit code and ACTION one of "
                "complete, retry, fail"
            )
        exit_codes[int(code)] = action
    worker = SandboxWorker(
        args.queue,
        args.processor,
        url=args.url,
        concurrency=args.concurrency,
        lease_s=args.lease_s,
        soft_timeout_s=args.soft_timeout_s,
        hard_timeout_s=args.hard_timeout_s,
        retries=args.retries,
        max_memory_mb=args.max_memory_mb,
        max_jobs_per_child=args.max_jobs_per_child,
        exit_codes=exit_codes,
        prefetch=args.prefetch,
        stop_timeout_s=args.stop_timeout_s,
        allow_pickle=args.allow_pickle,
    )
    log.info("worker %s on queue %r: %s", worker.id, args.queue, args.processor)
    worker.run(burst=args.burst)
    log.info("worker %s stopped: %s", worker.id, worker.stats)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sandboxq", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    verbs = parser.add_subparsers(dest="verb", required=True)

    w = verbs.add_parser("worker", help="run a worker for QUEUE with PROCESSOR (pkg.mod:fn)")
    w.add_argument("queue")
    w.add_argument("processor")
    w.add_argument("--url", help="backend URL (default: $SANDBOXQ_URL, else memory://)")
    w.add_argument("--concurrency", type=int, help="children (default: CPU count)")
    w.add_argument("--lease-s", type=float, default=30.0)
    w.add_argument("--soft-timeout-s", type=float)
    w.add_argument("--hard-timeout-s", type=float)
    w.add_argument("--retries", type=int, default=0)
    w.add_argument("--max-memory-mb", type=float)
    w.add_argument("--max-jobs-per-child", type=int)
    w.add_argument(
        "--prefetch", type=int, help="jobs claimed beyond the children (default: adaptive)"
    )
    w.add_argument("--stop-timeout-s", type=float, default=30.0)
    w.add_argument(
        "--exit-code",
        action="append",
        metavar="N=ACTION",
        help="map a handler exit code to complete/retry/fail (repeatable)",
    )
    w.add_argument("--allow-pickle", action="store_true", help="accept pickle payloads")
    w.add_argument("--burst", action="store_true", help="stop once the queue is empty")
    w.set_defaults(run=_worker)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.run(args))
    except SandboxqError as exc:
        print(f"sandboxq: error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # e.g. a malformed --exit-code
        print(f"sandboxq: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
