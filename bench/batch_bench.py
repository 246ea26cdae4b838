"""Batch benchmarks against a redis-server of their own (2 cores).

    python bench/batch_bench.py [--runs N] [--json OUT] [--url URL] [--quick]

Figures (median of --runs, alternating the two sides of each comparison):

- enqueue: ``Queue.batch`` of 100,000 no-op members against ``enqueue_many`` of as many
  calls, each on a fresh queue (target: the batch >= 0.9x enqueue_many).
- ``progress()`` server time at 1,000, 100,000 and 1,000,000 members (target <= 1 ms, flat).
  Method: ``CONFIG RESETSTAT``, then ``progress()`` called 2,000 times, then ``INFO
  commandstats``: the server's own microseconds per HMGET (the one command progress()
  sends). The client's round trip less a PING round trip is given beside it.
- ``as_completed`` producer CPU per member: a finished batch (its members run by a worker
  with 2 children, stopped before the measure) streamed from the start; the process CPU
  time of the iteration over its members (target <= 20 us). Then ``results()`` of the
  same batch, wall time.
- failures grouped by outcome (``sandboxq batch``, the dashboard) over a batch whose every
  member was cancelled, wall time.
- Redis memory per member beyond a single job's: ``used_memory`` after 100,000 members
  against 100,000 plain jobs (the same calls, and ids of the same form and length:
  ``<16 hex>.<index>``, so only what the batch adds differs; retention large enough to
  keep every finished job), while waiting and again once all finished (the batch's
  stream of finished members included) (target <= 100 B).
- ``sandboxq run --url`` over 2 local workers against the local mode, the same file and 2
  cores (target: within 10 %): see ``fleet_run``.

Only the figures' redis-server runs during a measurement; the machine is shared, so the
report records its load. Measured on this project's 2 shared cores (5 runs, medians): the
batch enqueues at 1.00x enqueue_many (0.98-1.23x); progress() costs the server 2.0-2.4 us
at 1,000, 100,000 and 1,000,000 members; as_completed 4.6 us of producer CPU a member;
a member 32 B more than a job while waiting, 51 B once finished; sandboxq run --url 1.17x
the local mode's wall time (0.95-1.85x: the target of 1.1x is missed, see the README).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import figures  # noqa: E402
from queue_bench import stop, worker  # noqa: E402

from sandboxq import Queue  # noqa: E402
from sandboxq.batch import new_batch_id  # noqa: E402
from sandboxq.batch_failures import failures  # noqa: E402
from sandboxq.models import JobState  # noqa: E402
from sandboxq.testing.redis_server import RedisServer  # noqa: E402
from sandboxq.worker import SandboxWorker  # noqa: E402

BATCH_ENQUEUE_RATIO = figures.Target(">=", 0.9, "x")
PROGRESS_SERVER_US = figures.Target("<=", 1000, "us")
AS_COMPLETED_CPU_US = figures.Target("<=", 20, "us")
MEMORY_PER_MEMBER = figures.Target("<=", 100, "B")
FLEET_WALL_RATIO = figures.Target("<=", 1.1, "x")

PROGRESS_SIZES = (1_000, 100_000, 1_000_000)
PROGRESS_CALLS = 2000
#: Far above what a run keeps, so no finished plain job is trimmed before it is counted.
KEEP_ALL = {"retain_completed": 10_000_000, "retain_failed": 10_000_000}

SIZES = {
    False: {"members": 100_000, "progress": PROGRESS_SIZES, "fleet": 20_000},
    True: {"members": 10_000, "progress": (1_000, 10_000, 100_000), "fleet": 4_000},
}


def calls(n: int) -> list[tuple[tuple[int], dict[str, Any]]]:
    return [((i,), {}) for i in range(n)]


def used_memory(r: redis.Redis) -> int:
    return int(r.info("memory")["used_memory"])


def enqueue_rates(url: str, n: int) -> tuple[float, float]:
    """Members/s of ``Queue.batch`` and jobs/s of ``enqueue_many``, the same ``n`` calls,
    each on a fresh queue (calls built beforehand: the encoding is in both figures)."""
    the_calls = calls(n)
    rates = []
    for kind in ("batch", "many"):
        q = Queue(f"b-{uuid.uuid4().hex[:8]}", url=url)
        try:
            started = time.perf_counter()
            if kind == "batch":
                q.batch(the_calls)
            else:
                q.enqueue_many(the_calls)
            rates.append(n / (time.perf_counter() - started))
        finally:
            q.close()
        flush(url)
    return rates[0], rates[1]


def flush(url: str) -> None:
    with contextlib.closing(redis.Redis.from_url(url)) as r:
        r.flushall()


def ping_us(r: redis.Redis, n: int = 500) -> float:
    samples = []
    for _ in range(n):
        started = time.perf_counter()
        r.ping()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples) * 1e6


def progress_latency(
    url: str, sizes: tuple[int, ...], runs: int
) -> dict[int, dict[str, list[float]]]:
    """For each size: a batch of that many members, then ``runs`` rounds of
    ``PROGRESS_CALLS`` progress() calls; per round the server's us per HMGET and the
    client's median round trip less a PING's."""
    out: dict[int, dict[str, list[float]]] = {}
    with contextlib.closing(redis.Redis.from_url(url)) as r:
        for size in sizes:
            q = Queue(f"b-{uuid.uuid4().hex[:8]}", url=url)
            try:
                batch = q.batch(calls(size))
                server, client = [], []
                for _ in range(runs):
                    r.config_resetstat()
                    samples = []
                    for _ in range(PROGRESS_CALLS):
                        started = time.perf_counter()
                        batch.progress()
                        samples.append(time.perf_counter() - started)
                    stats = r.info("commandstats")["cmdstat_hmget"]
                    server.append(float(stats["usec_per_call"]))
                    client.append(statistics.median(samples) * 1e6 - ping_us(r))
                out[size] = {"server_us": server, "client_less_ping_us": client}
            finally:
                q.close()
            flush(url)
    return out


def run_through_worker(url: str, q: Queue) -> None:
    """A worker with 2 children in this process, in burst mode, with ``KEEP_ALL``: the
    finish scripts trim by the *worker's* retention, and none may be trimmed here. (The
    producer's CPU is measured after it stopped.)"""
    worker = SandboxWorker(
        q.name, "bench_jobs:noop", url=url, concurrency=2, backend_options=KEEP_ALL
    )
    worker.run(burst=True)


def memory_and_streaming(url: str, n: int) -> dict[str, float]:
    """Redis memory of ``n`` batch members against ``n`` plain jobs, waiting and finished;
    the producer CPU of streaming the finished batch, and the time ``results()`` takes."""
    out: dict[str, float] = {}
    with contextlib.closing(redis.Redis.from_url(url)) as r:
        per: dict[str, dict[str, float]] = {}
        for kind in ("many", "batch"):
            flush(url)
            q = Queue(f"b-{uuid.uuid4().hex[:8]}", url=url, **KEEP_ALL)
            try:
                base = used_memory(r)
                if kind == "batch":
                    batch = q.batch(calls(n))
                else:  # the same calls and ids of the same length, outside any batch
                    jobs = q._maker.batch_jobs(new_batch_id(), calls(n))
                    q.backend.enqueue(jobs)
                waiting = used_memory(r) - base
                run_through_worker(url, q)
                assert q.counts()[JobState.COMPLETED] == n, q.counts()
                per[kind] = {"waiting": waiting / n, "finished": (used_memory(r) - base) / n}
                if kind == "batch":
                    started = time.process_time()
                    streamed = sum(1 for _ in batch.as_completed(timeout_s=60))
                    cpu_s = time.process_time() - started
                    assert streamed == n, streamed
                    out["as_completed_cpu_us"] = cpu_s / n * 1e6
                    started = time.perf_counter()
                    assert len(batch.results()) == n
                    out["results_s"] = time.perf_counter() - started
            finally:
                q.close()
        out["extra_waiting_b"] = per["batch"]["waiting"] - per["many"]["waiting"]
        out["extra_finished_b"] = per["batch"]["finished"] - per["many"]["finished"]
        out["job_waiting_b"] = per["many"]["waiting"]
        out["job_finished_b"] = per["many"]["finished"]
    flush(url)
    return out


# -- sandboxq run --url over 2 local workers against the local mode --------------------------


def failures_s(url: str, n: int) -> float:
    """Seconds ``batch_failures.failures`` takes (what ``sandboxq batch`` shows: failures
    grouped by outcome) over a batch of ``n`` members that all ended cancelled, so the
    grouping reads every member."""
    flush(url)
    q = Queue(f"bf-{uuid.uuid4().hex[:8]}", url=url)
    try:
        batch = q.batch(calls(n))
        batch.cancel()
        t0 = time.perf_counter()
        found = failures(q.backend, batch.id)
        took = time.perf_counter() - t0
    finally:
        q.close()
    flush(url)
    assert found.examined == n and found.groups[0].count == n, found
    return took


def fleet_run(url: str, n: int) -> tuple[float, float]:
    """Wall time of ``sandboxq run bench_jobs:noop FILE --concurrency 2`` (local mode) and
    of ``sandboxq run ... --url URL --queue Q --concurrency 0`` with two ``sandboxq worker``
    processes (one child each) serving Q, started before it: the same file, 2 cores."""
    env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "in.jsonl"
        source.write_text("".join(f'{{"args": [{i}]}}\n' for i in range(n)))
        base = [sys.executable, "-m", "sandboxq", "run", "bench_jobs:noop", str(source)]
        out = ["--output", str(Path(tmp) / "out.jsonl")]

        def timed(command: list[str]) -> float:
            started = time.perf_counter()
            subprocess.run(command, env=env, check=True, stderr=subprocess.DEVNULL)
            return time.perf_counter() - started

        local = timed([*base, *out, "--concurrency", "2"])
        queue = f"b-{uuid.uuid4().hex[:8]}"
        procs = [worker(url, queue, "bench_jobs:noop", concurrency=1) for _ in range(2)]
        try:
            fleet = timed([*base, *out, "--url", url, "--queue", queue, "--concurrency", "0"])
        finally:
            for proc in procs:
                stop(proc)
        flush(url)
    return local, fleet


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", default=str(HERE / "results" / "batch.json"))
    parser.add_argument("--url", help="an existing redis-server (it is FLUSHALLed!)")
    parser.add_argument("--quick", action="store_true", help="fewer samples: a smoke check")
    parser.add_argument("--skip-fleet", action="store_true", help="leave out sandboxq run --url")
    args = parser.parse_args()
    size = SIZES[args.quick]
    values: dict[str, list[float]] = {}

    def add(key: str, value: float) -> None:
        values.setdefault(key, []).append(value)

    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(RedisServer()).url
        for i in range(args.runs):
            t0 = time.monotonic()
            batch, many = enqueue_rates(url, size["members"])
            add("batch_enqueue_s", batch)
            add("many_enqueue_s", many)
            add("batch_vs_many", batch / many)
            for key, value in memory_and_streaming(url, size["members"]).items():
                add(key, value)
            add("failures_s", failures_s(url, size["members"]))
            if not args.skip_fleet:
                local, fleet = fleet_run(url, size["fleet"])
                add("local_run_s", local)
                add("fleet_run_s", fleet)
                add("fleet_vs_local", fleet / local)
            print(f"  run {i + 1}/{args.runs} took {time.monotonic() - t0:.0f} s", flush=True)
        latency = progress_latency(url, size["progress"], args.runs)
    n = size["members"]
    figs = [
        figures.figure(f"Queue.batch, {n:,} members", values["batch_enqueue_s"], "jobs/s"),
        figures.figure(f"enqueue_many, {n:,} jobs (same run)", values["many_enqueue_s"], "jobs/s"),
        figures.figure(
            "batch enqueue vs enqueue_many",
            values["batch_vs_many"],
            "x",
            BATCH_ENQUEUE_RATIO,
            digits=3,
        ),
    ]
    for members, runs in latency.items():
        figs.append(
            figures.figure(
                f"progress() server time, {members:,} members",
                runs["server_us"],
                "us",
                PROGRESS_SERVER_US,
            )
        )
        figs.append(
            figures.figure(
                f"progress() round trip less PING, {members:,} members",
                runs["client_less_ping_us"],
                "us",
            )
        )
    figs += [
        figures.figure(
            "as_completed producer CPU per member",
            values["as_completed_cpu_us"],
            "us",
            AS_COMPLETED_CPU_US,
        ),
        figures.figure(f"results() of {n:,} completed members", values["results_s"], "s"),
        figures.figure(
            f"failures by outcome, {n:,} members all cancelled", values["failures_s"], "s"
        ),
        figures.figure("Redis memory per plain job, waiting", values["job_waiting_b"], "B"),
        figures.figure(
            "Redis memory per member beyond a job's, waiting",
            values["extra_waiting_b"],
            "B",
            MEMORY_PER_MEMBER,
        ),
        figures.figure(
            "Redis memory per plain job, finished (retained)", values["job_finished_b"], "B"
        ),
        figures.figure(
            "Redis memory per member beyond a job's, finished",
            values["extra_finished_b"],
            "B",
            MEMORY_PER_MEMBER,
        ),
    ]
    if not args.skip_fleet:
        figs += [
            figures.figure(
                f"sandboxq run, local mode, {size['fleet']:,} no-op lines",
                values["local_run_s"],
                "s",
            ),
            figures.figure("sandboxq run --url, 2 workers of 1 child", values["fleet_run_s"], "s"),
            figures.figure(
                "run --url vs local wall time",
                values["fleet_vs_local"],
                "x",
                FLEET_WALL_RATIO,
                digits=3,
            ),
        ]
    for fig in figs:
        print(figures.line(fig))
    report = {"quick": args.quick, "load": os.getloadavg(), "figures": figs}
    figures.write_json(args.json, report)


if __name__ == "__main__":
    main()
