"""Any number of waiters: 10,000 coroutines (and many threads) waiting for results at once.

    python bench/waiters_bench.py [--waiters N] [--threads N] [--runs N] [--json OUT] [--url URL]

Each run enqueues ``--waiters`` jobs, parks one ``await job.result()`` per job (all of them
registered and waiting before any job runs), then a real worker in a process of its own
(``sandboxq.testing.handlers:echo``, concurrency 2, burst) runs them all. Figures:

- connections the server holds for this process while they wait (``CLIENT LIST``: all of
  them, the finish listeners among them, and those parked in a blocking command);
- from each job's finish (``finished_ms``, stamped by Redis ``TIME`` on this same host, to
  the millisecond) to the moment its ``result()`` returned the value: p50, p99, max
  (target: p99 <= 5 ms);
- the event loop's worst lateness meanwhile: a ticker sleeping 1 ms in a loop, the most it
  woke late (target <= 5 ms), beside the same ticker on an idle loop (the machine's own);
  and the most CPU the loop's thread spent within one tick: the part of a late tick that
  the loop's own work (callbacks, the collector) explains, the rest being a wait for a core;
- this process's CPU per woken waiter (the ticker included): one event loop follows
  finishes up to about its inverse a second; faster, results queue up behind each other.

Both with no-op jobs (the worker at full speed, ~5,000 jobs/s here; once more with
``gc.freeze()`` after the waiters are parked, which takes the garbage collector's full
collections out of the lateness) and with ``--job-s`` jobs (5 ms: two children finish
~360 a second).

Then the listener's connection is killed under ``--waiters`` parked coroutines: once it
reconnects it wakes every one of them to look again; the loop's worst lateness meanwhile.

Then the same with ``--threads`` threads each blocked in the synchronous ``Job.result()``
(``--threads 0``: none).
The machine is shared (2 cores: Redis, the worker, its children and this process): the
figures are what this run got, printed and written as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import figures  # noqa: E402
import redis  # noqa: E402

from sandboxq import Queue, aio  # noqa: E402
from sandboxq.backends.redis import finishes  # noqa: E402
from sandboxq.testing.redis_server import RedisServer  # noqa: E402

WAKE_P99 = figures.Target("<=", 5, "ms")
LATENESS = figures.Target("<=", 5, "ms")
TICK_S = 0.001

#: The worker: a process of its own, so its work does not share this event loop's GIL;
#: every result kept until read (retention keeps 1,000 completed jobs by default); no
#: control groups (what is measured here is the waiting, not the sandbox).
WORKER = """
import sys
from sandboxq import SandboxWorker
queue, url, keep, processor = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
SandboxWorker(queue, processor, url=url, concurrency=2,
              containment="process_tree", backend_options={"retain_completed": keep}
              ).run(burst=True)
"""


def connections(url: str) -> dict[str, int]:
    with redis.Redis.from_url(url) as raw:
        listed = raw.client_list()
    return {
        "all": len(listed),
        "listeners": sum(1 for c in listed if c.get("name") == finishes.CLIENT_NAME),
        "blocked": sum(1 for c in listed if "b" in c.get("flags", "")),
    }


def start_worker(queue: str, url: str, keep: int, job_s: float = 0.0) -> subprocess.Popen[bytes]:
    """A worker running ``echo`` (job_s 0), else ``succeed_after`` (each job ``job_s``
    long, paced: two children finish at most 2 / job_s jobs a second)."""
    processor = "sandboxq.testing.handlers:" + ("succeed_after" if job_s else "echo")
    return subprocess.Popen([sys.executable, "-c", WORKER, queue, url, str(keep), processor])


def wake_ms(returned_s: dict[str, float], finished_ms: dict[str, int]) -> list[float]:
    """Per job: wall-clock ms from its finish (Redis TIME, whole ms) to its wake-up."""
    return sorted(returned_s[j] * 1000 - finished_ms[j] for j in returned_s)


class Ticker:
    """Sleeps ``TICK_S`` in a loop: the most it woke late, and the most CPU the loop's own
    thread spent within one tick (its callbacks, the collector). A tick late by more than
    that waited for a core: the machine's scheduling, not work that held the loop."""

    def __init__(self) -> None:
        self.late_s = 0.0
        self.busy_s = 0.0
        self.measuring = False

    async def run(self) -> None:
        while True:
            before, cpu_before = time.perf_counter(), time.thread_time()
            await asyncio.sleep(TICK_S)
            if self.measuring:
                self.late_s = max(self.late_s, time.perf_counter() - before - TICK_S)
                self.busy_s = max(self.busy_s, time.thread_time() - cpu_before)


async def until(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(0.01)


async def async_run(url: str, n: int, job_s: float = 0.0, freeze: bool = False) -> dict[str, Any]:
    """``n`` coroutines parked on ``result()``, then a worker runs the jobs (see
    ``start_worker``); with ``freeze``, ``gc.freeze()`` once they are parked, so the
    collector no longer walks the waiters' objects on every full collection."""
    queue = f"wb-{uuid.uuid4().hex[:8]}"
    returned_s: dict[str, float] = {}
    async with aio.Queue(queue, url) as q:
        calls = [((job_s, i) if job_s else (i,), {}) for i in range(n)]
        jobs = await q.enqueue_many(calls)
        before = connections(url)

        async def wait(job: aio.AsyncJob, expected: int) -> None:
            value = await job.result(timeout_s=600)
            returned_s[job.id] = time.time()
            assert value == expected, (job.id, value)

        tasks = [asyncio.ensure_future(wait(job, i)) for i, job in enumerate(jobs)]
        await until(lambda: finishes.parked_count() >= n, 120, f"{n} waiters parked")
        during = connections(url)
        if freeze:
            gc.freeze()
        ticker = Ticker()
        ticking = asyncio.ensure_future(ticker.run())
        worker = start_worker(queue, url, n, job_s)
        try:
            ticker.measuring = True
            started, cpu_started = time.monotonic(), time.process_time()
            await asyncio.gather(*tasks)
            took_s = time.monotonic() - started
            cpu_s = time.process_time() - cpu_started
            ticker.measuring = False
        finally:
            ticking.cancel()
            if freeze:
                gc.unfreeze()
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.wait(30)
            worker.kill()
            worker.wait()
        finished = {
            info.id: info.finished_ms for info, _ in await q.backend.get_many(list(returned_s))
        }  # type: ignore[union-attr]
    return {
        "before": before,
        "during": during,
        "wake_ms": wake_ms(returned_s, finished),  # type: ignore[arg-type]
        "late_ms": ticker.late_s * 1000,
        "busy_ms": ticker.busy_s * 1000,
        "took_s": took_s,
        "cpu_us": cpu_s * 1e6 / n,
    }


async def reconnect_run(url: str, n: int) -> float:
    """``n`` coroutines parked on ``result()``, then the listener's connection is killed
    (``CLIENT KILL``, as a Redis restart or a failover does): once it reconnects, the
    listener wakes every waiter to look again. The ticker's worst lateness from the kill
    until every waiter is parked again, in ms."""
    queue = f"wb-{uuid.uuid4().hex[:8]}"
    async with aio.Queue(queue, url) as q:
        jobs = await q.enqueue_many([((i,), {}) for i in range(n)])
        tasks = [asyncio.ensure_future(job.result(timeout_s=600)) for job in jobs]
        await until(lambda: finishes.parked_count() >= n, 120, f"{n} waiters parked")
        ticker = Ticker()
        ticking = asyncio.ensure_future(ticker.run())
        await asyncio.sleep(0.05)
        ticker.measuring = True
        with redis.Redis.from_url(url) as raw:
            for client in raw.client_list():
                if client.get("name") == finishes.CLIENT_NAME:
                    raw.client_kill_filter(_id=client["id"])
        # every waiter leaves its wait once woken, and parks again after its read
        await until(lambda: finishes.parked_count() < n, 30, "the wake after the reconnect")
        await until(lambda: finishes.parked_count() >= n, 60, f"{n} waiters parked again")
        ticker.measuring = False
        ticking.cancel()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return ticker.late_s * 1000


def sync_run(url: str, n: int) -> dict[str, Any]:
    queue = f"wb-{uuid.uuid4().hex[:8]}"
    returned_s: dict[str, float] = {}
    errors: list[BaseException] = []
    with Queue(queue, url) as q:
        jobs = q.enqueue_many([((i,), {}) for i in range(n)])
        before = connections(url)

        def wait(i: int) -> None:
            try:
                assert jobs[i].result(timeout_s=600) == i
                returned_s[jobs[i].id] = time.time()
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=wait, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while finishes.parked_count() < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {n} threads parked")
            time.sleep(0.01)
        during = connections(url)
        worker = start_worker(queue, url, n)
        started = time.monotonic()
        for t in threads:
            t.join()
        took_s = time.monotonic() - started
        worker.wait(30)
        if errors:
            raise errors[0]
        finished = {info.id: info.finished_ms for info, _ in q.backend.get_many(list(returned_s))}  # type: ignore[union-attr]
    return {
        "before": before,
        "during": during,
        "wake_ms": wake_ms(returned_s, finished),  # type: ignore[arg-type]
        "took_s": took_s,
    }


async def idle_lateness_ms(duration_s: float = 1.0) -> float:
    ticker = Ticker()
    ticker.measuring = True
    task = asyncio.ensure_future(ticker.run())
    await asyncio.sleep(duration_s)
    task.cancel()
    return ticker.late_s * 1000


def wake_figures(label: str, runs: list[dict[str, Any]], target: bool) -> list[dict[str, Any]]:
    pct = {p: [figures.percentile(r["wake_ms"], p) for r in runs] for p in (50, 99, 100)}
    return [
        figures.figure(f"{label}: finish to wake-up, p50", pct[50], "ms"),
        figures.figure(
            f"{label}: finish to wake-up, p99", pct[99], "ms", WAKE_P99 if target else None
        ),
        figures.figure(f"{label}: finish to wake-up, max", pct[100], "ms"),
    ]


def conn_figures(label: str, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    grew = [r["during"]["all"] - r["before"]["all"] for r in runs]
    return [
        figures.figure(f"{label}: connections added while waiting", grew, "conns", digits=0),
        figures.figure(
            f"{label}: finish listeners",
            [r["during"]["listeners"] for r in runs],
            "conns",
            digits=0,
        ),
        figures.figure(
            f"{label}: blocked connections",
            [r["during"]["blocked"] for r in runs],
            "conns",
            digits=0,
        ),
    ]


def async_line(label: str, a: dict[str, Any], idle_ms: float) -> str:
    return (
        f"{label}: +{a['during']['all'] - a['before']['all']} connections "
        f"({a['during']['listeners']} listener), wake p50 {statistics.median(a['wake_ms']):.1f} "
        f"ms, p99 {figures.percentile(a['wake_ms'], 99):.1f} ms, loop late {a['late_ms']:.1f} "
        f"ms (idle {idle_ms:.1f} ms; busy in one tick {a['busy_ms']:.1f} ms), "
        f"{len(a['wake_ms']) / a['took_s']:,.0f} jobs/s"
    )


def async_figures(label: str, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        *conn_figures(label, runs),
        *wake_figures(label, runs, target=True),
        figures.figure(
            f"{label}: event-loop lateness, worst", [r["late_ms"] for r in runs], "ms", LATENESS
        ),
        figures.figure(
            f"{label}: the loop's own CPU within one tick, worst",
            [r["busy_ms"] for r in runs],
            "ms",
            note="the loop's work (callbacks, collections); lateness beyond it waited for a core",
        ),
        figures.figure(
            f"{label}: this process's CPU per woken waiter",
            [r["cpu_us"] for r in runs],
            "µs",
            digits=0,
            note="its inverse is the finish rate one event loop can follow",
        ),
        figures.figure(
            f"{label}: jobs finished/s",
            [len(r["wake_ms"]) / r["took_s"] for r in runs],
            "jobs/s",
            digits=0,
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--waiters", type=int, default=10_000)
    parser.add_argument("--threads", type=int, default=500)
    parser.add_argument("--job-s", type=float, default=0.005, help="the paced jobs' length")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--json", default=str(HERE / "results" / "waiters.json"))
    parser.add_argument("--url", help="an existing redis-server (default: start one)")
    parser.add_argument("--quick", action="store_true", help="fewer waiters: a smoke check")
    args = parser.parse_args()
    if args.quick:
        args.waiters, args.threads, args.runs = min(args.waiters, 1000), min(args.threads, 100), 1
    fast: list[dict[str, Any]] = []
    paced: list[dict[str, Any]] = []
    sruns: list[dict[str, Any]] = []
    frozen: list[dict[str, Any]] = []
    idle: list[float] = []
    reconnects: list[float] = []
    n = f"{args.waiters:,} coroutines"
    flabel = f"{n}, no-op jobs"
    zlabel = f"{n}, no-op jobs, gc.freeze() once parked"
    plabel = f"{n}, {args.job_s * 1000:g} ms jobs"
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(RedisServer()).url
        for i in range(args.runs):
            idle.append(asyncio.run(idle_lateness_ms()))
            fast.append(asyncio.run(async_run(url, args.waiters)))
            print(f"  run {i + 1}/{args.runs}: " + async_line(flabel, fast[-1], idle[-1]))
            frozen.append(asyncio.run(async_run(url, args.waiters, freeze=True)))
            print(f"  run {i + 1}/{args.runs}: " + async_line(zlabel, frozen[-1], idle[-1]))
            paced.append(asyncio.run(async_run(url, args.waiters, args.job_s)))
            print(f"  run {i + 1}/{args.runs}: " + async_line(plabel, paced[-1], idle[-1]))
            reconnects.append(asyncio.run(reconnect_run(url, args.waiters)))
            print(
                f"  run {i + 1}/{args.runs}: {n}, the listener reconnected: loop late "
                f"{reconnects[-1]:.1f} ms while every waiter looked again"
            )
            if not args.threads:
                continue
            sruns.append(sync_run(url, args.threads))
            s = sruns[-1]
            print(
                f"  run {i + 1}/{args.runs}: {args.threads} threads: "
                f"+{s['during']['all'] - s['before']['all']} connections, wake p50 "
                f"{statistics.median(s['wake_ms']):.1f} ms, p99 "
                f"{figures.percentile(s['wake_ms'], 99):.1f} ms"
            )
    slabel = f"{args.threads} threads, no-op jobs"
    figs = [
        figures.figure("event-loop lateness, idle loop (the machine's own)", idle, "ms"),
        *async_figures(flabel, fast),
        figures.figure(
            f"{zlabel}: event-loop lateness, worst",
            [r["late_ms"] for r in frozen],
            "ms",
            LATENESS,
            note="what is left once the collector no longer walks the parked waiters",
        ),
        *async_figures(plabel, paced),
        figures.figure(
            f"{n}, the listener reconnected: event-loop lateness, worst",
            reconnects,
            "ms",
            LATENESS,
            note="every waiter woken to look again, a slice at a time",
        ),
    ]
    if sruns:
        figs += [*conn_figures(slabel, sruns), *wake_figures(slabel, sruns, target=False)]
    for fig in figs:
        print(figures.line(fig))
    figures.write_json(
        args.json,
        {"waiters": args.waiters, "threads": args.threads, "job_s": args.job_s, "figures": figs},
    )


if __name__ == "__main__":
    main()
