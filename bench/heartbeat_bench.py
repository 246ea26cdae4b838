"""Heartbeat renewal gaps while every core is held by GIL-holding children (design invariant 5).

    python bench/heartbeat_bench.py [--json OUT] [--url URL] [--lease-s S] [--quick]

A worker with 2 x cores children runs jobs five times longer than the lease, each
holding the GIL in long C calls (``spin_gil_for``). The worker runs on a thread of this
process so its heartbeat's renewal times (``Heartbeat.renewed_at``) can be read; the
children are processes of their own, as in production. Figures: the largest and p99
gap between two renewals (target: under the renew interval, lease_s / 3, plus a small
margin) and the jobs that stalled, lost their lease or ran twice (target: none).
Without --url it starts its own redis-server.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import figures  # noqa: E402

from sandboxq import Queue, SandboxWorker  # noqa: E402
from sandboxq.testing.redis_server import RedisServer  # noqa: E402

LEASE_S = 1.0


def renewal_gaps(url: str, lease_s: float, waves: int) -> dict[str, Any]:
    """Run ``waves`` rounds of GIL-holding jobs on every child; the gaps between renewals
    that ended while they ran, and what became of each job."""
    children = 2 * (os.cpu_count() or 1)
    job_s = 5 * lease_s
    name = f"b-{uuid.uuid4().hex[:8]}"
    q = Queue(name, url=url)
    worker = SandboxWorker(
        name,
        "sandboxq.testing.handlers:spin_gil_for",
        url=url,
        concurrency=children,
        lease_s=lease_s,
        prefetch=0,  # a prefetched job would wait under a lease, not hold a core
    )
    thread = threading.Thread(target=worker.run, name="bench-worker", daemon=True)
    thread.start()
    try:
        assert q.enqueue(0.01).result(timeout_s=60) is True  # the worker and its pool are up
        t0 = time.monotonic()
        jobs = q.enqueue_many([((job_s,), {}) for _ in range(children * waves)])
        for job in jobs:
            assert job.result(timeout_s=job_s * waves + 60) is True
        t1 = time.monotonic()
    finally:
        worker.stop()
        thread.join(30)
    infos = [job.info() for job in jobs]
    q.close()
    times = list(worker.heartbeat.renewed_at)
    gaps = [(b - t0, b - a) for a, b in itertools.pairwise(times) if t0 < b <= t1]
    troubled = sum(1 for i in infos if i.attempts != 1 or i.stalls != 0)
    return {
        "lease_s": lease_s,
        "renew_interval_s": worker.settings.renew_every_s,
        "children": children,
        "job_s": job_s,
        "jobs": len(jobs),
        "duration_s": round(t1 - t0, 3),
        # (seconds since the first job was enqueued, gap in ms) per renewal
        "gaps": [(round(t, 4), round(g * 1000, 2)) for t, g in gaps],
        "troubled_jobs": troubled,
        "lease_lost": worker.stats["lease_lost"],
        "rejected_acks": worker.stats["rejected_acks"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=str(HERE / "results" / "heartbeat.json"))
    parser.add_argument("--url", help="an existing redis-server (default: start one)")
    parser.add_argument("--lease-s", type=float, default=LEASE_S)
    parser.add_argument("--quick", action="store_true", help="one wave of jobs, not four")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(RedisServer()).url
        out = renewal_gaps(url, args.lease_s, waves=1 if args.quick else 4)
    ms = sorted(g for _, g in out["gaps"])
    target = figures.gap_target(args.lease_s)
    out["figures"] = [
        figures.figure("heartbeat renewal gap, max", [ms[-1]], "ms", target),
        figures.figure("heartbeat renewal gap, p99", [figures.percentile(ms, 99)], "ms", target),
        figures.figure("heartbeat renewal gap, median", [figures.percentile(ms, 50)], "ms"),
        figures.figure(
            "jobs stalled, lost or run twice under GIL load",
            [out["troubled_jobs"] + out["lease_lost"] + out["rejected_acks"]],
            "jobs",
            figures.NO_STALLS,
        ),
    ]
    print(
        f"  {out['children']} children holding the GIL, {out['jobs']} jobs of {out['job_s']:g} s, "
        f"lease {args.lease_s:g} s, {len(ms)} renewals in {out['duration_s']:.1f} s"
    )
    for fig in out["figures"]:
        print(figures.line(fig))
    figures.write_json(args.json, out)


if __name__ == "__main__":
    main()
