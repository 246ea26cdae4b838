"""A SandboxWorker inside a long-running service, with graceful shutdown.

    SANDBOXQ_URL=redis://localhost:6379/0 python examples/service.py [QUEUE]

Producers anywhere enqueue with ``Queue("reports", url).enqueue("acme", pages=12)``.
SIGTERM (what systemd, Docker and Kubernetes send to stop a service) drains: the worker
stops claiming, keeps renewing its leases, lets running jobs finish (up to
``stop_timeout_s``), then ``run()`` returns and the service exits 0. A second SIGTERM, or
Ctrl-C twice, stops at once: interrupted jobs go back to the queue without being charged
an attempt, for another worker to pick up.
"""

from __future__ import annotations

import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # finds jobs_service

from sandboxq import SandboxqError, SandboxWorker

log = logging.getLogger("report-service")


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    url = os.environ.get("SANDBOXQ_URL", "redis://127.0.0.1:6379/0")
    queue = sys.argv[1] if len(sys.argv) > 1 else "reports"
    try:
        worker = SandboxWorker(
            queue,
            "jobs_service:render_report",
            url=url,
            concurrency=2,
            soft_timeout_s=60,
            hard_timeout_s=90,
            retries=2,
            stop_timeout_s=30,  # how long a drain waits for running jobs
        )
    except SandboxqError as exc:  # bad settings or an unimportable processor
        log.error("cannot start: %s", exc)
        return 2
    log.info("ready: worker %s on queue %r (SIGTERM drains)", worker.id, queue)
    worker.run()  # blocks until a signal, then drains
    log.info("stopped cleanly: %s", worker.stats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
