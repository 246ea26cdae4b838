"""What worker metrics cost: no-op throughput with metrics on and off, side by side.

    python bench/metrics_bench.py [--runs N] [--jobs N] [--json OUT] [--url URL]
                                  [--back-to-back]

Each run works through the same number of no-op jobs twice, once with metrics served and once
without, at the same time on two queues (``--back-to-back``: one after the other, in
alternating order), with real ``sandboxq worker`` processes; a scraper reads the
metrics every second during the "on" runs, as Prometheus would. The worker parent's
CPU per job is measured too: a no-op worker is bound by it. Also the recording cost
alone: the CPU the dispatcher spends per job in ``WorkerMetrics`` (attempt_ended, and
one acked per batch), and the CPU of one scrape of a worker with two children.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import psutil
from prometheus_client import generate_latest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import figures  # noqa: E402
from queue_bench import _remaining, backlog_rate, stop, worker  # noqa: E402

from sandboxq import Queue  # noqa: E402
from sandboxq.backends.base import Ack, Claimed  # noqa: E402
from sandboxq.models import AttemptRecord, JobOptions, Outcome  # noqa: E402
from sandboxq.observe.metrics import WorkerMetrics  # noqa: E402
from sandboxq.pool.attempt import AttemptResult  # noqa: E402
from sandboxq.pool.kill import tree_rss  # noqa: E402
from sandboxq.pool.pool import Pool  # noqa: E402
from sandboxq.testing.redis_server import RedisServer, free_port  # noqa: E402

SLOWDOWN = figures.Target("<=", 3, "%")


def scrape_while(port: int, done: threading.Event) -> None:
    """Scrape the worker's metrics once a second, as Prometheus would."""
    while not done.wait(1.0):
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                r.read()


def run_backlog(url: str, n: int, metrics: bool) -> tuple[float, float]:
    """Jobs/s working through ``n`` no-op jobs, and the worker parent's CPU per job in us."""
    name = f"mb-{uuid.uuid4().hex[:8]}"
    q = Queue(name, url=url)
    q.enqueue_many([((i,), {}) for i in range(n)])
    port = free_port()
    args = ("--metrics-port", str(port)) if metrics else ()
    w = worker(url, name, "bench_jobs:noop", *args)
    done = threading.Event()
    if metrics:
        threading.Thread(target=scrape_while, args=(port, done), daemon=True).start()
    try:
        parent = psutil.Process(w.pid)
        # CPU from the first finished job on: start-up (imports, children) is not a job's
        started = threading.Event()
        cpu: list[Any] = []

        def sample_start() -> None:
            while _remaining(q) >= n:
                time.sleep(0.01)
            cpu.append(parent.cpu_times())
            started.set()

        threading.Thread(target=sample_start, daemon=True).start()
        rate = backlog_rate(q, n)
        started.wait(10)
        cpu1 = parent.cpu_times()
        busy_s = (cpu1.user - cpu[0].user) + (cpu1.system - cpu[0].system)
        return rate, busy_s / n * 1e6
    finally:
        done.set()
        stop(w)
        q.close()


def together(url: str, n: int, order: tuple[bool, bool]) -> dict[bool, tuple[float, float]]:
    """Both runs at the same time, on two queues: on a shared machine whose load swings
    by 2x within seconds, only workers running side by side see the same conditions.

    The one started first gets ahead: two identical workers side by side differed by 5 to
    10 % that way (measured), so the order alternates between runs (``order``)."""
    results: dict[bool, tuple[float, float]] = {}

    def one(metrics: bool) -> None:
        results[metrics] = run_backlog(url, n, metrics)

    threads = [threading.Thread(target=one, args=(m,)) for m in order]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if len(results) != 2:
        raise RuntimeError("a backlog run failed (see above)")
    return results


def recording_us_per_job(jobs: int = 200_000, batch: int = 64) -> float:
    """CPU per job spent recording (one attempt_ended per job, one acked per batch)."""
    m = WorkerMetrics("bench")
    job = Claimed("id", "tok", b"", "json", JobOptions(), 1, 0.0, wait_s=0.004)
    result = AttemptResult(1, Outcome.OK, runtime_s=0.0008)
    record = AttemptRecord(attempt=1, outcome=Outcome.OK)
    acks = [(job, Ack("id", "tok", "complete", record))] * batch
    accepted = [True] * batch
    t0 = time.process_time()
    for _ in range(jobs // batch):
        for _ in range(batch):
            m.attempt_ended(job, result)
        m.acked(acks, accepted)
    return (time.process_time() - t0) / jobs * 1e6


def scrape_ms(scrapes: int = 200) -> float:
    """CPU of one scrape of a worker's metrics with two live children (RSS included)."""
    with Pool("sandboxq.testing.handlers:echo", 2) as pool:
        m = WorkerMetrics("bench")
        m.bind(
            child_states=pool.child_states,
            held=lambda: 0,
            renewed_at=time.monotonic,
            rejected_acks=lambda: 0,
            recovered=lambda: 0,
            restarts=lambda: pool.restarts,
            rss=lambda pids: sum(tree_rss(pid)[0] for pid in pids),
        )
        t0 = time.process_time()
        for _ in range(scrapes):
            generate_latest(m.registry)
        return (time.process_time() - t0) / scrapes * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=4, help="even: each order as often")
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--json", default=str(HERE / "results" / "metrics.json"))
    parser.add_argument("--url", help="an existing redis-server (default: start one)")
    parser.add_argument("--quick", action="store_true", help="fewer jobs: a smoke check")
    parser.add_argument(
        "--back-to-back",
        action="store_true",
        help="run one after the other (default: both at once, so both see the same load)",
    )
    args = parser.parse_args()
    if args.quick:
        args.jobs = min(args.jobs, 2000)
    off: list[float] = []
    on: list[float] = []
    cpu_off: list[float] = []
    cpu_on: list[float] = []
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(RedisServer()).url
        run_backlog(url, 2000, metrics=False)  # warm-up: imports, fork server, Redis scripts
        for i in range(args.runs):
            order = (False, True) if i % 2 == 0 else (True, False)
            if args.back_to_back:
                results = {metrics: run_backlog(url, args.jobs, metrics) for metrics in order}
            else:
                results = together(url, args.jobs, order)
            off.append(results[False][0])
            on.append(results[True][0])
            cpu_off.append(results[False][1])
            cpu_on.append(results[True][1])
            print(
                f"  run {i + 1}/{args.runs}: off {off[-1]:,.0f}, on {on[-1]:,.0f} jobs/s; "
                f"parent CPU per job off {cpu_off[-1]:.0f} us, on {cpu_on[-1]:.0f} us"
            )
    slowdowns = [(a - b) / a * 100 for a, b in zip(off, on, strict=True)]
    # A no-op worker is bound by its parent's CPU: the extra CPU per job is the slowdown
    # a quiet machine would show, without the load swings of a shared one.
    extra_cpu = [(b - a) / a * 100 for a, b in zip(cpu_off, cpu_on, strict=True)]
    record = [recording_us_per_job() for _ in range(3)]
    scrape = [scrape_ms() for _ in range(3)]
    figs = [
        figures.figure("no-op throughput, metrics off", off, "jobs/s", digits=0),
        figures.figure("no-op throughput, metrics on (scraped every 1 s)", on, "jobs/s", digits=0),
        figures.figure("metrics slowdown (per run pair)", slowdowns, "%", SLOWDOWN, digits=2),
        figures.figure("worker parent CPU per job, metrics off", cpu_off, "us", digits=1),
        figures.figure("worker parent CPU per job, metrics on", cpu_on, "us", digits=1),
        figures.figure("extra parent CPU per job with metrics", extra_cpu, "%", SLOWDOWN),
        figures.figure("recording cost per job", record, "us", digits=3),
        figures.figure("one scrape, two children (CPU)", scrape, "ms", digits=3),
    ]
    for fig in figs:
        print(figures.line(fig))
    print(f"  median of off/on: {statistics.median(off):,.0f} / {statistics.median(on):,.0f}")
    figures.write_json(args.json, {"jobs": args.jobs, "figures": figs})


if __name__ == "__main__":
    main()
