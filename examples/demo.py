"""`make demo`: a queue on the embedded in-memory backend (no Redis), a sandboxed worker, and
jobs that hang in C code, crash, exit and raise while the good ones complete."""

from __future__ import annotations

import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))

from sandboxq import JobFailed, Queue, SandboxWorker


def main() -> None:
    queue = Queue("demo", url="memory://")
    good = [queue.enqueue(f"photo-{i}.png", size=256) for i in range(6)]
    bad = {
        kind: queue.options(retries=1, backoff_s=0.1).enqueue(kind)
        for kind in ("hang", "crash", "exit", "raise")
    }
    worker = SandboxWorker(
        "demo",
        "demo_jobs:route",
        url="memory://",
        concurrency=2,
        soft_timeout_s=0.5,
        hard_timeout_s=1.0,
        lease_s=5,
    )
    print("worker running 2 sandboxed children; hard timeout 1 s, one retry for failures\n")
    started = time.monotonic()
    thread = threading.Thread(target=worker.run, kwargs={"burst": True})
    thread.start()
    for job in good:
        print(f"  completed  {job.result(timeout_s=60)}")
    print()
    for kind, job in bad.items():
        try:
            job.result(timeout_s=60)
        except JobFailed as err:
            attempts = ", ".join(f"{a.outcome}" for a in job.info().history)
            print(f"  {kind:6} failed after {err.attempts} attempts ({attempts}): {err.error}")
    thread.join()
    print(f"\n{worker.stats}")
    print(f"all done in {time.monotonic() - started:.1f} s; the worker and every child stopped")


if __name__ == "__main__":
    main()
