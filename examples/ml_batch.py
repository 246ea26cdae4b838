"""Batch inference in sandboxed children: each job scores one batch with a small numpy MLP
(2 layers, fixed random weights) that examples/jobs_ml.py builds once per fork server.

    python examples/ml_batch.py
"""

from __future__ import annotations

import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # finds jobs_ml

from jobs_ml import infer_batch

from sandboxq import Queue, SandboxWorker

BATCHES, ROWS = 16, 10_000


def main() -> None:
    queue = Queue("inference", url="memory://")
    jobs = queue.enqueue_many(((batch, ROWS, 1000 + batch), {}) for batch in range(BATCHES))
    worker = SandboxWorker(
        "inference",
        "jobs_ml:infer_batch",
        url="memory://",
        concurrency=2,
        hard_timeout_s=60,
        retries=2,  # a crashed or killed batch is tried again
    )
    started = time.monotonic()
    thread = threading.Thread(target=worker.run, kwargs={"burst": True})
    thread.start()

    totals = [0] * 10
    pids = set()
    for job in jobs:
        scored = job.result(timeout_s=120)
        totals = [t + n for t, n in zip(totals, scored["per_class"], strict=True)]
        pids.add(scored["pid"])
        print(
            f"batch {scored['batch']:2}: {scored['rows']:,} rows, "
            f"mean confidence {scored['mean_confidence']:.3f}, per class {scored['per_class']}"
        )
    thread.join()
    elapsed = time.monotonic() - started
    rows = BATCHES * ROWS
    print(f"\n{rows:,} rows in {elapsed:.1f} s ({rows / elapsed:,.0f} rows/s), pids {sorted(pids)}")
    print(f"predicted classes over all batches: {totals}")
    same = infer_batch(0, ROWS, 1000)["per_class"] == jobs[0].result()["per_class"]
    print(f"batch 0 scored again in this process: {'same' if same else 'DIFFERENT'} result")


if __name__ == "__main__":
    main()
