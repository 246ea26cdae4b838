"""``sandboxq exporter``: serve the queue gauges from Redis to Prometheus until stopped.

    --url ─► QueueExporter (exporter.py) ─► /metrics on --host:--port ─► Prometheus
    --queue Q (repeatable), else every queue found on the server

SIGTERM or Ctrl-C stops it. The port is printed once bound (port 0 picks a free one).
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from typing import Any

from sandboxq.cli.options import EXIT_OK, add_url, shared_url
from sandboxq.errors import ConfigError

log = logging.getLogger("sandboxq.cli")


def add_parser(verbs: Any) -> None:
    e = verbs.add_parser(
        "exporter",
        help="serve queue gauges (backlog, oldest age, workers) from Redis to Prometheus",
        description="Serve Prometheus gauges read from Redis: jobs by state, the age of "
        "the oldest waiting job and live workers, per queue. Each scrape costs two "
        "pipelined round trips, never a scan of jobs.",
    )
    add_url(e)
    e.add_argument("--port", type=int, required=True, help="port to serve on (0: a free one)")
    e.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1)")
    e.add_argument(
        "--queue", action="append", help="a queue to export (repeatable; default: all found)"
    )
    e.set_defaults(run=run, log_level=logging.INFO)


def run(args: argparse.Namespace) -> int:
    from sandboxq.observe.exporter import QueueExporter

    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be 0-65535 (0: a free one), got {args.port}")
    exporter = QueueExporter(shared_url(args.url), args.queue)
    stop = threading.Event()
    old = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            host, port = exporter.serve(args.port, args.host)
        except OSError as exc:  # in use, an address not of this machine, an unknown name
            why = exc.strerror or str(exc)
            raise ConfigError(f"cannot serve on {args.host}:{args.port}: {why}") from None
        print(f"serving queue metrics on http://{host}:{port}/metrics", flush=True)
        stop.wait()
    finally:
        exporter.close()
        for sig, previous in old.items():
            signal.signal(sig, previous)
    return EXIT_OK
