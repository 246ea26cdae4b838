"""Queue benchmarks against a redis-server this script starts (concurrency 2, 2 cores).

    python bench/queue_bench.py [--runs N] [--json OUT]

Figures (median of --runs): no-op throughput, enqueue rate one by one and bulk, idle
enqueue→start latency p50/p95/p99, CPU-bound efficiency vs the raw 2-process ceiling,
recovery time after SIGKILL of a worker. Workers run as real `sandboxq worker` processes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from multiprocessing import Pool as RawPool
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_jobs import cpu  # noqa: E402

from sandboxq import Queue  # noqa: E402
from sandboxq.models import JobState  # noqa: E402
from sandboxq.testing.redis_server import RedisServer  # noqa: E402

TARGETS = {
    "noop_jobs_s": ">= 5,000",
    "enqueue_single_s": ">= 10,000",
    "enqueue_bulk_s": ">= 50,000",
    "latency_p50_ms": "<= 1",
    "latency_p95_ms": "<= 2",
    "cpu_efficiency_pct": ">= 97",
    "recovery_s": "<= lease_s + 1",
}


def worker(url: str, queue: str, processor: str, *args: str) -> subprocess.Popen[bytes]:
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
            "2",
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


def wait_drained(q: Queue, timeout_s: float = 120) -> None:
    """Until nothing is waiting or active (completed jobs are trimmed by retention, so
    counting them would undercount)."""
    deadline = time.monotonic() + timeout_s
    while True:
        counts = q.counts()
        if counts[JobState.WAITING] + counts[JobState.ACTIVE] == 0:
            assert counts[JobState.FAILED] == 0, counts
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"not drained: {counts}")
        time.sleep(0.002)


def noop_throughput(url: str, n: int = 20000) -> float:
    name = f"b-{uuid.uuid4().hex[:8]}"
    q = Queue(name, url=url)
    w = worker(url, name, "bench_jobs:noop")
    try:
        q.enqueue(None).result(timeout_s=30)  # the worker is up
        q.enqueue_many([((i,), {}) for i in range(n)])
        t0 = time.perf_counter()
        wait_drained(q)
        return n / (time.perf_counter() - t0)
    finally:
        stop(w)
        q.close()


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


def cpu_efficiency(url: str, n: int = 80, ms: float = 50) -> float:
    with RawPool(2) as raw:
        t0 = time.perf_counter()
        raw.map(cpu, [ms] * n, chunksize=1)
        raw_rate = n / (time.perf_counter() - t0)
    name = f"b-{uuid.uuid4().hex[:8]}"
    q = Queue(name, url=url)
    w = worker(url, name, "bench_jobs:cpu")
    try:
        q.enqueue(1).result(timeout_s=30)
        q.enqueue_many([((ms,), {}) for _ in range(n)])
        t0 = time.perf_counter()
        wait_drained(q)
        rate = n / (time.perf_counter() - t0)
    finally:
        stop(w)
        q.close()
    return 100 * rate / raw_rate


def recovery(url: str, lease_s: float = 2.0) -> float:
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", default=str(HERE / "results" / "queue.json"))
    args = parser.parse_args()
    figures: dict[str, list[float]] = {k: [] for k in TARGETS}
    with RedisServer() as server:
        url = server.url
        for _ in range(args.runs):
            figures["noop_jobs_s"].append(noop_throughput(url))
            single, bulk = enqueue_rates(url)
            figures["enqueue_single_s"].append(single)
            figures["enqueue_bulk_s"].append(bulk)
            lat = sorted(latency(url))
            figures["latency_p50_ms"].append(lat[len(lat) // 2])
            figures["latency_p95_ms"].append(lat[int(len(lat) * 0.95)])
            figures.setdefault("latency_p99_ms", []).append(lat[int(len(lat) * 0.99)])
            figures["cpu_efficiency_pct"].append(cpu_efficiency(url))
            figures["recovery_s"].append(recovery(url))
    report: dict[str, Any] = {}
    for key, values in figures.items():
        med = statistics.median(values)
        report[key] = {
            "median": round(med, 3),
            "runs": [round(v, 3) for v in values],
            "target": TARGETS.get(key, ""),
        }
        print(
            f"  {key:22} {med:12.2f}   [target {TARGETS.get(key, '-')}]   runs: "
            + ", ".join(f"{v:.2f}" for v in values)
        )
    report["recovery_s"]["lease_s"] = 2.0
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
