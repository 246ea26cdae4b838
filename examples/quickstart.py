"""Quickstart: enqueue a few jobs and run them in sandboxed child processes, on the
in-memory backend, so there is nothing to set up.

    python examples/quickstart.py

The processor is named by import path ("module:function"): the children import it, so it
must live in an importable module (here examples/jobs_quickstart.py), not in this script.
For Redis, give both sides the same URL: Queue("primes", url="redis://localhost:6379/0").
"""

from __future__ import annotations

import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # finds jobs_quickstart

from sandboxq import Queue, SandboxWorker


def main() -> None:
    queue = Queue("primes", url="memory://")
    limits = [100_000, 1_000_000, 5_000_000, 10_000_000]
    jobs = [queue.enqueue(n) for n in limits]

    worker = SandboxWorker(
        "primes",
        "jobs_quickstart:count_primes",
        url="memory://",
        concurrency=2,  # two child processes
        hard_timeout_s=30,  # a job still running after 30 s has its process tree killed
    )
    # burst: the worker returns once the queue is empty (a service would just call run()).
    thread = threading.Thread(target=worker.run, kwargs={"burst": True})
    thread.start()

    for limit, job in zip(limits, jobs, strict=True):
        primes = job.result(timeout_s=60)
        attempt = job.info().history[-1]
        took_ms = (attempt.ended_ms or 0) - (attempt.started_ms or 0)
        print(f"primes below {limit:>10,}: {primes:>7,}   (child pid {attempt.pid}, {took_ms} ms)")
    thread.join()
    print(f"worker stopped: {worker.stats['completed']} jobs completed")


if __name__ == "__main__":
    main()
