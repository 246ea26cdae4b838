"""The asyncio producer against the synchronous one, on one redis-server.

    python bench/aio_bench.py [--runs N] [--jobs N] [--json OUT] [--url URL]

Figures (median of --runs): sync ``Queue.enqueue`` one at a time (one connection) and
``aio.Queue.enqueue`` awaited one at a time, in alternating blocks (target >= 90 % of
sync); 100 coroutines enqueueing at once (target >= 2x sync); and the worst lateness of
an event-loop ticker (a 1 ms sleep in a loop) while ``enqueue_many`` adds 10,000 jobs
(target <= 5 ms), beside the longest stretch of CPU the loop's thread spent between two
ticks and the same ticker's lateness with nothing running (what the machine costs).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import sys
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import figures  # noqa: E402

from sandboxq import Queue, aio  # noqa: E402
from sandboxq.testing.redis_server import RedisServer  # noqa: E402

ONE_BY_ONE = figures.Target(">=", 90, "% of sync")
CONCURRENT = figures.Target(">=", 2, "x sync")
LATENESS = figures.Target("<=", 5, "ms")
BULK = 10_000


def name() -> str:
    return f"ab-{uuid.uuid4().hex[:8]}"


async def one_by_one(url: str, n: int, blocks: int = 10) -> tuple[float, float]:
    """Sync and aio enqueue rates, one job at a time, in alternating blocks: on a shared
    machine whose load swings by 2x within seconds, back-to-back runs would compare the
    load, not the code."""
    spent = {"sync": 0.0, "aio": 0.0}
    with Queue(name(), url) as sq:
        async with aio.Queue(name(), url) as aq:
            sq.enqueue(0)  # connect and load the script outside the timing
            await aq.enqueue(0)
            for _ in range(blocks):
                t0 = time.perf_counter()
                for i in range(n // blocks):
                    sq.enqueue(i)
                t1 = time.perf_counter()
                for i in range(n // blocks):
                    await aq.enqueue(i)
                t2 = time.perf_counter()
                spent["sync"] += t1 - t0
                spent["aio"] += t2 - t1
    done = n // blocks * blocks
    return done / spent["sync"], done / spent["aio"]


async def async_concurrent(url: str, n: int, tasks: int = 100) -> float:
    async with aio.Queue(name(), url) as q:
        await asyncio.gather(*(q.enqueue(0) for _ in range(tasks)))  # open the connections

        async def producer(k: int) -> None:
            for i in range(k, n, tasks):
                await q.enqueue(i)

        t0 = time.perf_counter()
        await asyncio.gather(*(producer(k) for k in range(tasks)))
        return n / (time.perf_counter() - t0)


async def ticker_lateness_ms(url: str) -> tuple[float, float]:
    """The ticker's worst lateness (wall clock) while ``enqueue_many`` runs, and the
    longest stretch of CPU the loop's thread spent between two ticks: the wall figure
    includes time the OS gave to other processes (Redis running the scripts, on 2 cores),
    the CPU figure only what held the loop."""
    async with aio.Queue(name(), url) as q:
        await q.enqueue(0)
        late = held = 0.0
        running = True

        async def ticker() -> None:
            nonlocal late, held
            while running:
                before, cpu = time.perf_counter(), time.thread_time()
                await asyncio.sleep(0.001)
                late = max(late, time.perf_counter() - before - 0.001)
                held = max(held, time.thread_time() - cpu)

        calls = [((i,), {"k": "v"}) for i in range(BULK)]  # the caller's work, not measured
        task = asyncio.create_task(ticker())
        await asyncio.sleep(0.05)
        late = held = 0.0  # the ticker's own start-up is not the enqueue's doing
        jobs = await q.enqueue_many(calls)
        running = False
        await task
        assert len(jobs) == BULK
        return late * 1000, held * 1000


async def idle_lateness_ms(duration_s: float = 0.5) -> float:
    """The same ticker with nothing else running: what the machine itself costs."""
    late, end = 0.0, time.perf_counter() + duration_s
    while time.perf_counter() < end:
        before = time.perf_counter()
        await asyncio.sleep(0.001)
        late = max(late, time.perf_counter() - before - 0.001)
    return late * 1000


def frozen_lateness_ms(url: str) -> float:
    """The same, with the heap present at start-up frozen (``gc.freeze()``, as a service
    does after its imports): the longest stretches otherwise were full collections, 30 to
    60 ms, walking every object the imports made, triggered by the batch's allocations."""
    gc.collect()
    gc.freeze()
    try:
        return asyncio.run(ticker_lateness_ms(url))[0]
    finally:
        gc.unfreeze()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument("--json", default=str(HERE / "results" / "aio.json"))
    parser.add_argument("--url", help="an existing redis-server (default: start one)")
    parser.add_argument("--quick", action="store_true", help="fewer jobs: a smoke check")
    args = parser.parse_args()
    if args.quick:
        args.jobs = min(args.jobs, 1000)
    sync, one, many, late, held, idle, frozen = [], [], [], [], [], [], []
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(RedisServer()).url
        for i in range(args.runs):
            rates = asyncio.run(one_by_one(url, args.jobs))
            sync.append(rates[0])
            one.append(rates[1])
            many.append(asyncio.run(async_concurrent(url, args.jobs)))
            wall, cpu = asyncio.run(ticker_lateness_ms(url))
            late.append(wall)
            held.append(cpu)
            idle.append(asyncio.run(idle_lateness_ms()))
            frozen.append(frozen_lateness_ms(url))
            print(
                f"  run {i + 1}/{args.runs}: sync {sync[-1]:,.0f}/s, aio one {one[-1]:,.0f}/s, "
                f"aio x100 {many[-1]:,.0f}/s, ticker late {late[-1]:.2f} ms "
                f"(CPU held {held[-1]:.2f} ms; after gc.freeze() {frozen[-1]:.2f} ms; "
                f"idle loop: {idle[-1]:.2f} ms)"
            )
    figs = [
        figures.figure("sync enqueue, one at a time", sync, "jobs/s", digits=0),
        figures.figure("aio enqueue, one at a time", one, "jobs/s", digits=0),
        figures.figure(
            "aio one at a time vs sync",
            [a / s * 100 for a, s in zip(one, sync, strict=True)],
            "% of sync",
            ONE_BY_ONE,
            digits=1,
        ),
        figures.figure("aio enqueue, 100 coroutines", many, "jobs/s", digits=0),
        figures.figure(
            "aio 100 coroutines vs sync",
            [a / s for a, s in zip(many, sync, strict=True)],
            "x sync",
            CONCURRENT,
        ),
        figures.figure(f"ticker lateness during enqueue_many({BULK:,})", late, "ms", LATENESS),
        figures.figure("longest loop CPU stretch during it", held, "ms", LATENESS),
        figures.figure("ticker lateness, after gc.freeze()", frozen, "ms", LATENESS),
        figures.figure("ticker lateness, idle loop (the machine's own)", idle, "ms"),
    ]
    for fig in figs:
        print(figures.line(fig))
    figures.write_json(args.json, {"jobs": args.jobs, "figures": figs})


if __name__ == "__main__":
    main()
