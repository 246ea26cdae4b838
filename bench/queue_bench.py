"""Queue benchmarks against a redis-server (concurrency 2 unless said, 2 cores).

    python bench/queue_bench.py [--runs N] [--json OUT] [--url URL] [--quick]

Figures (median of --runs): no-op throughput with the worker's own CPU per job and RSS
(and on ``memory://``, a worker in this process),
enqueue rate one by one and bulk, idle enqueue→start latency p50/p95/p99, CPU-bound
efficiency vs the raw 2-process ceiling, recovery time after SIGKILL of a worker, Redis
memory per retained finished job, and no-op throughput at 1, 2, 4 and 8 children.
Workers run as real `sandboxq worker` processes. Without --url it starts its own
redis-server; ``--quick`` takes fewer samples (a smoke check, not a figure to quote).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from multiprocessing import Pool as RawPool
from pathlib import Path
from typing import Any

import psutil
import redis

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import figures  # noqa: E402
from bench_jobs import cpu  # noqa: E402

from sandboxq import Queue  # noqa: E402
from sandboxq.models import JobState  # noqa: E402
from sandboxq.testing.redis_server import RedisServer  # noqa: E402

RECOVERY_LEASE_S = 2.0
#: Completed jobs the Redis memory figure fills (all retained: far below the count cap;
#: bench/retention_bench.py breaks a retained job's bytes down by key).
RETAINED = 1000
CONCURRENCY_STEPS = (1, 2, 4, 8)


def worker(
    url: str, queue: str, processor: str, *args: str, concurrency: int = 2
) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sandboxq",
            "worker",
            queue,
            processor,
            "--url",
            url,
            "--concurrency",
            str(concurrency),
            *args,
        ],
        env=env,
        stderr=subprocess.DEVNULL,
    )


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


#: How finely the start of a backlog's run is found (its end is read off the server: see below).
POLL_S = 0.02
#: How often the end of a backlog's run is checked for. Each check is a round trip that takes
#: CPU from the worker under test (2 cores in all): rarely, since it costs no precision.
END_CHECK_S = 0.25


def _remaining(q: Queue) -> int:
    """Jobs not finished yet (completed ones are trimmed by retention: not countable)."""
    counts = q.counts()
    assert counts[JobState.FAILED] == 0, counts
    return counts[JobState.WAITING] + counts[JobState.ACTIVE]


def _server_ms(r: redis.Redis) -> float:
    seconds, micros = r.time()
    return seconds * 1000 + micros / 1000


def backlog_rate(q: Queue, n: int, timeout_s: float = 120) -> float:
    """Jobs/s at which a worker works through ``n`` jobs already in the queue: from the
    first check that sees jobs finished to the moment the last one finished. The worker's
    start-up and the producer's enqueue (measured on its own) are not in it.

    Both ends are on the Redis clock; the end is the newest score of the completed set
    (the server's time of the last ack), so it is exact however late it is checked.
    """
    backend: Any = q.backend
    r = redis.Redis.from_url(backend.url)
    deadline = time.monotonic() + timeout_s
    try:
        while (left := _remaining(q)) >= n:
            if time.monotonic() > deadline:
                raise TimeoutError("the worker never started")
            time.sleep(POLL_S)
        t0 = _server_ms(r)
        while now_left := _remaining(q):
            if time.monotonic() > deadline:
                raise TimeoutError(f"backlog not done: {now_left} jobs left")
            time.sleep(END_CHECK_S)
        ((_, last_ms),) = r.zrange(backend.keys.completed, -1, -1, withscores=True)
        return left / ((last_ms - t0) / 1000)
    finally:
        r.close()


def noop_throughput(url: str, n: int = 20000, concurrency: int = 2) -> dict[str, float]:
    """Jobs/s for ``n`` no-op jobs waiting in the queue when the worker starts, with the
    worker process's own CPU time per job (psutil: the parent only, not its children)
    and its RSS afterwards."""
    name = f"b-{uuid.uuid4().hex[:8]}"
    q = Queue(name, url=url)
    q.enqueue_many([((i,), {}) for i in range(n)])
    w = worker(url, name, "bench_jobs:noop", concurrency=concurrency)
    try:
        parent = psutil.Process(w.pid)
        cpu0 = parent.cpu_times()
        rate = backlog_rate(q, n)
        cpu1 = parent.cpu_times()
        busy_s = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
        return {
            "jobs_s": rate,
            # start-up included: an upper bound on the CPU a job costs the worker
            "parent_cpu_us_per_job": busy_s / n * 1e6,
            "parent_rss_mb": parent.memory_info().rss / 2**20,
        }
    finally:
        stop(w)
        q.close()


def memory_throughput(n: int) -> float:
    """Jobs/s of a worker on ``memory://`` (the in-process store, no Redis: local batches,
    tests) for ``n`` no-op jobs waiting when it starts, in this process as a user runs it
    (``SandboxWorker(...).run(burst=True)``: start-up included)."""
    from sandboxq.worker import SandboxWorker

    name = f"m-{uuid.uuid4().hex[:8]}"
    with Queue(name, url="memory://") as q:
        q.enqueue_many([((i,), {}) for i in range(n)])
        w = SandboxWorker(name, "bench_jobs:noop", url="memory://", concurrency=2)
        started = time.perf_counter()
        w.run(burst=True)
        took_s = time.perf_counter() - started
        assert q.counts()[JobState.COMPLETED] == n
    return n / took_s


def bullmq_enqueue_rates(url: str, n: int) -> tuple[float, float] | None:
    """The same two enqueue figures for BullMQ for Python (``Queue.add`` awaited one by
    one, then ``add_bulk``) against the same server in the same run; None when the
    ``bullmq`` package (the bench extra) is not installed."""
    try:
        from bullmq import Queue as BullQueue
    except ImportError:
        return None
    import asyncio

    async def measure() -> tuple[float, float]:
        q = BullQueue(f"bull-{uuid.uuid4().hex[:8]}", {"connection": url})
        try:
            t0 = time.perf_counter()
            for i in range(n):
                await q.add("job", {"i": i})
            single = n / (time.perf_counter() - t0)
            jobs = [{"name": "job", "data": {"i": i}} for i in range(5 * n)]
            t0 = time.perf_counter()
            for start in range(0, len(jobs), 1000):  # its own batches; one call per 1000
                await q.addBulk(jobs[start : start + 1000])
            bulk = len(jobs) / (time.perf_counter() - t0)
            await q.obliterate({"force": True})
            return single, bulk
        finally:
            await q.close()

    return asyncio.run(measure())


def enqueue_rates(url: str, n: int = 20000) -> tuple[float, float]:
    q = Queue(f"b-{uuid.uuid4().hex[:8]}", url=url)
    t0 = time.perf_counter()
    for i in range(n):
        q.enqueue(i)
    single = n / (time.perf_counter() - t0)
    calls = [((i,), {}) for i in range(5 * n)]
    t0 = time.perf_counter()
    q.enqueue_many(calls)
    bulk = len(calls) / (time.perf_counter() - t0)
    q.close()
    return single, bulk


def latency(url: str, n: int = 300) -> list[float]:
    """From just before enqueue() to the handler's first line, with the worker idle."""
    name = f"b-{uuid.uuid4().hex[:8]}"
    q = Queue(name, url=url)
    w = worker(url, name, "bench_jobs:stamp")
    try:
        q.enqueue().result(timeout_s=30)
        samples = []
        for _ in range(n):
            time.sleep(0.01)  # idle: the worker is blocked waiting for work
            t0 = time.time()
            started = q.enqueue().result(timeout_s=10)
            samples.append((started - t0) * 1000)
        return samples
    finally:
        stop(w)
        q.close()


def raw_rate(n: int, ms: float) -> float:
    """Jobs/s of a bare ``multiprocessing.Pool(2)`` running the same CPU-bound jobs.

    Its processes call setsid, as sandboxq's children do: with the kernel's autogroup
    scheduling each session gets its own share of a busy CPU, so without it the raw
    pool would get less CPU than the queue's children and the ceiling would be too low.
    """
    with RawPool(2, initializer=os.setsid) as raw:
        t0 = time.perf_counter()
        raw.map(cpu, [ms] * n, chunksize=1)
        return n / (time.perf_counter() - t0)


def cpu_efficiency(url: str, n: int = 80, ms: float = 50) -> float:
    """The queue's rate for CPU-bound jobs as a percentage of the raw 2-process ceiling.

    The ceiling is measured just before and just after, and the higher of the two is
    used: load from elsewhere on the machine then lowers the figure, never raises it.
    """
    before = raw_rate(n, ms)
    name = f"b-{uuid.uuid4().hex[:8]}"
    q = Queue(name, url=url)
    q.enqueue_many([((ms,), {}) for _ in range(n)])
    w = worker(url, name, "bench_jobs:cpu")
    try:
        rate = backlog_rate(q, n)
    finally:
        stop(w)
        q.close()
    return 100 * rate / max(before, raw_rate(n, ms))


def recovery(url: str, lease_s: float = RECOVERY_LEASE_S) -> float:
    """SIGKILL a worker mid-job; time until the job has completed on another worker,
    minus the job's own run time."""
    name = f"b-{uuid.uuid4().hex[:8]}"
    q = Queue(name, url=url)
    a = worker(url, name, "bench_jobs:numpy_job", "--lease-s", str(lease_s))
    b = None
    try:
        q.enqueue(0).result(timeout_s=30)
        job = q.enqueue(0.5)
        while job.state() is not JobState.ACTIVE:
            time.sleep(0.005)
        b = worker(url, name, "bench_jobs:numpy_job", "--lease-s", str(lease_s))
        time.sleep(0.1)
        a.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        job.result(timeout_s=60)
        return time.monotonic() - t0 - 0.5
    finally:
        a.wait()
        if b is not None:
            stop(b)
        q.close()


def redis_bytes_per_job(url: str, n: int = RETAINED) -> dict[str, float]:
    """INFO memory (used_memory) before ``n`` no-op jobs are enqueued and after they have
    completed and are retained, per job; and, of that, the events stream's share."""
    import redis

    r = redis.Redis.from_url(url)
    name = f"b-{uuid.uuid4().hex[:8]}"
    q = Queue(name, url=url)
    try:
        before = int(r.info("memory")["used_memory"])
        q.enqueue_many([((i,), {}) for i in range(n)])
        w = worker(url, name, "bench_jobs:noop")
        try:
            backlog_rate(q, n)
        finally:
            stop(w)  # its registration goes with it
        assert q.counts()[JobState.COMPLETED] == n
        after = int(r.info("memory")["used_memory"])
        events = r.memory_usage(f"sq:{{{name}}}:events", samples=0) or 0
        return {"bytes_per_job": (after - before) / n, "events_bytes_per_job": events / n}
    finally:
        q.close()
        r.close()


#: JSON key → (what it is, unit, target). The keys are the JSON's, kept for the scripts
#: that read it.
FIGURES: dict[str, tuple[str, str, figures.Target | None]] = {
    "noop_jobs_s": ("queue no-op throughput", "jobs/s", figures.QUEUE_NOOP),
    "memory_noop_jobs_s": ("memory:// no-op throughput, in-process worker", "jobs/s", None),
    "parent_cpu_us_per_job": ("worker process CPU per no-op job", "us", None),
    "parent_rss_mb": ("worker process RSS after the no-op run", "MB", None),
    "enqueue_single_s": ("enqueue one by one", "jobs/s", figures.ENQUEUE_SINGLE),
    "enqueue_bulk_s": ("enqueue_many", "jobs/s", figures.ENQUEUE_BULK),
    "bullmq_enqueue_single_s": ("BullMQ for Python: add one by one (same run)", "jobs/s", None),
    "bullmq_enqueue_bulk_s": ("BullMQ for Python: addBulk (same run)", "jobs/s", None),
    "latency_p50_ms": ("idle enqueue->start latency p50", "ms", figures.LATENCY_P50),
    "latency_p95_ms": ("idle enqueue->start latency p95", "ms", figures.LATENCY_P95),
    "latency_p99_ms": ("idle enqueue->start latency p99", "ms", None),
    "cpu_efficiency_pct": ("CPU-bound 50 ms jobs vs raw 2 processes", "%", figures.CPU_EFFICIENCY),
    "recovery_s": (
        f"recovery after SIGKILL of a worker (lease {RECOVERY_LEASE_S:g} s)",
        "s",
        figures.recovery_target(RECOVERY_LEASE_S),
    ),
    "redis_bytes_per_job": (f"Redis memory per retained finished job (N={RETAINED})", "B", None),
    "redis_events_bytes_per_job": ("Redis memory per retained job: events stream", "B", None),
}

#: Jobs (or samples) per figure: the full run, and --quick.
SIZES = {
    False: {"noop": 20000, "enqueue": 20000, "latency": 300, "cpu": 160},
    True: {"noop": 5000, "enqueue": 5000, "latency": 100, "cpu": 40},
}


def one_run(url: str, size: dict[str, int], values: dict[str, list[float]]) -> None:
    """Every figure once, appended to ``values``; throughput at each concurrency too."""
    noop = noop_throughput(url, size["noop"])
    for key in ("parent_cpu_us_per_job", "parent_rss_mb"):
        values[key].append(noop[key])
    values["noop_jobs_s"].append(noop["jobs_s"])
    values["memory_noop_jobs_s"].append(memory_throughput(size["noop"]))
    for c in CONCURRENCY_STEPS:
        rate = noop["jobs_s"] if c == 2 else noop_throughput(url, size["noop"], c)["jobs_s"]
        values[f"noop_jobs_s_c{c}"].append(rate)
    single, bulk = enqueue_rates(url, size["enqueue"])
    values["enqueue_single_s"].append(single)
    values["enqueue_bulk_s"].append(bulk)
    peer = bullmq_enqueue_rates(url, size["enqueue"])
    if peer is not None:
        values["bullmq_enqueue_single_s"].append(peer[0])
        values["bullmq_enqueue_bulk_s"].append(peer[1])
    lat = sorted(latency(url, size["latency"]))
    for pct in (50, 95, 99):
        values[f"latency_p{pct}_ms"].append(figures.percentile(lat, pct))
    values["cpu_efficiency_pct"].append(cpu_efficiency(url, size["cpu"]))
    values["recovery_s"].append(recovery(url))
    memory = redis_bytes_per_job(url)
    values["redis_bytes_per_job"].append(memory["bytes_per_job"])
    values["redis_events_bytes_per_job"].append(memory["events_bytes_per_job"])


def summarize(values: dict[str, list[float]], quick: bool) -> dict[str, Any]:
    report: dict[str, Any] = {"quick": quick, "figures": [], "concurrency": {}}
    for key, (name, unit, target) in FIGURES.items():
        if not values[key]:
            continue  # a peer that is not installed
        fig = figures.figure(name, values[key], unit, target, digits=3)
        report[key] = {"median": fig["value"], "runs": fig["runs"], "target": fig["target"]}
        report["figures"].append(fig)
    report["recovery_s"]["lease_s"] = RECOVERY_LEASE_S
    for c in CONCURRENCY_STEPS:
        fig = figures.figure(
            f"queue no-op throughput, {c} child{'ren' if c > 1 else ''}",
            values[f"noop_jobs_s_c{c}"],
            "jobs/s",
        )
        report["concurrency"][str(c)] = {"median": fig["value"], "runs": fig["runs"]}
        report["figures"].append(fig)
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", default=str(HERE / "results" / "queue.json"))
    parser.add_argument("--url", help="an existing redis-server (default: start one)")
    parser.add_argument("--quick", action="store_true", help="fewer samples: a smoke check")
    args = parser.parse_args()
    values: dict[str, list[float]] = {k: [] for k in FIGURES}
    values.update({f"noop_jobs_s_c{c}": [] for c in CONCURRENCY_STEPS})
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(RedisServer()).url
        for i in range(args.runs):
            t0 = time.monotonic()
            one_run(url, SIZES[args.quick], values)
            print(f"  run {i + 1}/{args.runs} took {time.monotonic() - t0:.0f} s", flush=True)
    report = summarize(values, args.quick)
    for fig in report["figures"]:
        print(figures.line(fig))
    figures.write_json(args.json, report)


if __name__ == "__main__":
    main()
