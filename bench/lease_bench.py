"""Fenced hand-over and the cost of attempt identity, against a redis-server.

    python bench/lease_bench.py [--runs N] [--before TREE] [--json OUT]

Figures (median of --runs):
- cancel → retry → start: how long a job cancelled while running and retried at once
  waits before it runs again, when its worker confirms the cancelled child dead (target
  <= 20 ms) and when that worker is frozen (SIGSTOP of its whole tree) and cannot (target
  <= lease_s: the fence lifts when the old lease would have run out).
- no-op throughput (5,000 jobs, 2 children) and idle enqueue → start latency p50, of the
  code in this tree and, with ``--before``, of another source tree (e.g. an export of the
  previous commit), measured back to back, alternating, so both see the same load.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import time
import uuid
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import figures  # noqa: E402
import queue_bench  # noqa: E402

from sandboxq import Queue  # noqa: E402
from sandboxq.models import JobState  # noqa: E402
from sandboxq.testing.redis_server import RedisServer  # noqa: E402

FROZEN_LEASE_S = 2.0
POLL_S = 0.001


def wait_state(queue: Queue, job_id: str, state: JobState, timeout_s: float = 30) -> float:
    deadline = time.monotonic() + timeout_s
    while (info := queue.backend.get(job_id)) is None or info.state is not state:
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} never became {state}")
        time.sleep(POLL_S)
    return time.monotonic()


def cancel_retry_confirmed(url: str, samples: int) -> list[float]:
    """ms from retry() to the job running again, its owner confirming the kill."""
    name = f"f-{uuid.uuid4().hex[:8]}"
    q = Queue(name, url=url)
    w = queue_bench.worker(url, name, "sandboxq.testing.handlers:sleep_forever")
    out = []
    try:
        for _ in range(samples):
            job = q.enqueue()
            wait_state(q, job.id, JobState.ACTIVE)
            time.sleep(0.01)  # the child is running the handler
            job.cancel()
            t0 = time.monotonic()
            job.retry()
            out.append((wait_state(q, job.id, JobState.ACTIVE) - t0) * 1000)
            job.cancel()
    finally:
        queue_bench.stop(w)
        q.close()
    return out


def cancel_retry_frozen(url: str, samples: int) -> list[float]:
    """ms from retry() to another worker claiming the job, its owner frozen."""
    name = f"f-{uuid.uuid4().hex[:8]}"
    q = Queue(name, url=url)
    w = queue_bench.worker(
        url, name, "sandboxq.testing.handlers:sleep_forever", "--lease-s", str(FROZEN_LEASE_S)
    )
    out = []
    try:
        for _ in range(samples):
            job = q.enqueue()
            wait_state(q, job.id, JobState.ACTIVE)
            tree = [psutil.Process(w.pid), *psutil.Process(w.pid).children(recursive=True)]
            for proc in tree:
                proc.send_signal(signal.SIGSTOP)
            try:
                job.cancel()
                t0 = time.monotonic()
                job.retry()
                while not (claimed := q.backend.claim("bench-other", 1, 30.0, wait_s=0.05)):
                    if time.monotonic() - t0 > 4 * FROZEN_LEASE_S:
                        raise TimeoutError("the fence never lifted")
                out.append((time.monotonic() - t0) * 1000)
                assert [c.id for c in claimed] == [job.id]
                job.cancel()
            finally:
                for proc in tree:
                    with contextlib.suppress(psutil.Error):  # a child may have been replaced
                        proc.send_signal(signal.SIGCONT)
    finally:
        queue_bench.stop(w)
        q.close()
    return out


def queue_figures(url: str, tree: str | None) -> tuple[float, float, float]:
    """No-op jobs/s, the worker parent's CPU µs per job (less swayed by a loaded machine
    than a rate) and idle latency p50 ms of the worker code in ``tree`` (None: here)."""
    old = os.environ.get("PYTHONPATH", "")
    if tree is not None:
        os.environ["PYTHONPATH"] = f"{tree}{os.pathsep}{old}"
    try:
        noop = queue_bench.noop_throughput(url, 5000)
        lat = statistics.median(queue_bench.latency(url, 100))
    finally:
        os.environ["PYTHONPATH"] = old
    return noop["jobs_s"], noop["parent_cpu_us_per_job"], lat


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--before", help="a source tree of the code to compare with")
    parser.add_argument("--json", default=str(HERE / "results" / "lease.json"))
    parser.add_argument(
        "--queue-only", action="store_true", help="only the before/after queue figures"
    )
    args = parser.parse_args()
    values: dict[str, list[float]] = {}

    def add(key: str, value: float) -> None:
        values.setdefault(key, []).append(value)

    with RedisServer() as server:
        url = server.url
        for run in range(args.runs):
            if not args.queue_only:
                add("confirmed_ms", statistics.median(cancel_retry_confirmed(url, 10)))
                add("frozen_ms", statistics.median(cancel_retry_frozen(url, 2)))
            # alternate which goes first, so a drift in the machine's load favours neither
            trees: list[str | None] = [None]
            if args.before:
                trees = [None, args.before] if run % 2 else [args.before, None]
            for tree in trees:
                rate, cpu, lat = queue_figures(url, tree)
                prefix = "before_" if tree is not None else ""
                add(prefix + "jobs_s", rate)
                add(prefix + "cpu_us", cpu)
                add(prefix + "latency_ms", lat)
    fence_figures = (
        []
        if args.queue_only
        else [
            figures.figure(
                "cancel -> retry -> start, owner confirms",
                values["confirmed_ms"],
                "ms",
                figures.Target("<=", 20, "ms"),
            ),
            figures.figure(
                f"cancel -> retry -> start, owner frozen (lease_s {FROZEN_LEASE_S:g})",
                values["frozen_ms"],
                "ms",
                figures.Target("<=", FROZEN_LEASE_S * 1000, "ms"),
            ),
        ]
    )
    report = {
        "figures": [
            *fence_figures,
            figures.figure("no-op throughput", values["jobs_s"], "jobs/s"),
            figures.figure("worker parent CPU per no-op job", values["cpu_us"], "us"),
            figures.figure("idle enqueue -> start p50", values["latency_ms"], "ms"),
        ]
    }
    if args.before:
        report["figures"] += [
            figures.figure("no-op throughput, before", values["before_jobs_s"], "jobs/s"),
            figures.figure(
                "worker parent CPU per no-op job, before", values["before_cpu_us"], "us"
            ),
            figures.figure("idle enqueue -> start p50, before", values["before_latency_ms"], "ms"),
        ]
    for fig in report["figures"]:
        print(f"{fig['name']}: {fig['value']} {fig['unit']}  runs {fig['runs']}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
