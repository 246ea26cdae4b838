"""Where the round-trip figures stop: single enqueue against PING, the asyncio producer
against the synchronous one, and idle enqueue→start latency beside BullMQ's.

    python bench/floors_bench.py [--runs N] [--jobs N] [--json OUT] [--url URL] [--quick]

Each figure is put beside the floor the transport sets for it, measured in the same run:

- **single enqueue / PING.** redis-py's PING rate is a round trip with nothing to do on
  the server. An enqueue is one round trip too, plus its script's own server time (read
  from ``INFO commandstats`` over the enqueue runs alone) and the client's Python. The
  best an enqueue could reach with no client cost at all is one PING plus that server
  time: the *ceiling* figure. Also shown: ``EVALSHA`` of ``return 1`` (what calling any
  script costs over a PING).
- **asyncio / sync.** ``aio.Queue.enqueue`` awaited one at a time against
  ``Queue.enqueue``, alternating, beside the same ratio for the transport alone: a PING
  written and read on a bare socket, blocking against asyncio streams.
- **idle latency.** From just before the enqueue to the handler's first line, with the
  worker idle (queue_bench.py's ``latency``), beside BullMQ for Python's worker (a
  process of its own, as ours is) on the same server; skipped when ``bullmq`` (the bench
  extra) is missing.

Runs alternate, and each figure is the median of ``--runs``. Without --url it starts its
own redis-server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import redis

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import figures  # noqa: E402
from queue_bench import latency  # noqa: E402

from sandboxq import Queue, aio  # noqa: E402
from sandboxq.models import JobState  # noqa: E402
from sandboxq.testing.redis_server import RedisServer  # noqa: E402

SINGLE_VS_PING = figures.Target(">=", 0.9, "x PING")
AIO_VS_SYNC = figures.Target(">=", 90, "% of sync")
LATENCY_VS_BULLMQ = figures.Target("<=", 0.5, "x BullMQ")

# A BullMQ for Python worker, idle until a job comes: it returns the wall-clock time of
# its processor's first line, as bench_jobs.stamp does for ours.
BULLMQ_WORKER = """
import asyncio, sys, time
from bullmq import Worker

async def stamp(job, token):
    return time.time()

async def main():
    worker = Worker(sys.argv[1], stamp, {"connection": sys.argv[2], "concurrency": 2})
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await worker.close()

asyncio.run(main())
"""


def rate(n: int, call: Any) -> float:
    t0 = time.perf_counter()
    for i in range(n):
        call(i)
    return n / (time.perf_counter() - t0)


def enqueue_vs_ping(url: str, n: int) -> dict[str, float]:
    r = redis.Redis.from_url(url)
    q = Queue(f"fl-{uuid.uuid4().hex[:8]}", url=url)
    try:
        q.enqueue(0)  # the script loaded, the connections open
        nothing = r.script_load("return 1")
        ping = rate(n, lambda i: r.ping())
        script = rate(n, lambda i: r.evalsha(nothing, 0))
        r.config_resetstat()
        cpu0 = time.process_time()
        single = rate(n, q.enqueue)
        client_us = (time.process_time() - cpu0) / n * 1e6
        stats = r.info("commandstats")  # the scripts run as functions (FCALL)
        server_us = float(stats.get("cmdstat_fcall", stats.get("cmdstat_evalsha"))["usec_per_call"])
        ceiling = 1 / (1 / ping + server_us / 1e6)
        return {
            "ping": ping,
            "script": script,
            "single": single,
            "server_us": server_us,
            "client_us": client_us,
            "ratio": single / ping,
            "ceiling_ratio": ceiling / ping,
        }
    finally:
        q.backend.purge(JobState.WAITING)
        q.close()
        r.close()


async def aio_enqueue_rate(url: str, n: int) -> float:
    async with aio.Queue(f"fl-{uuid.uuid4().hex[:8]}", url) as q:
        await q.enqueue(0)
        t0 = time.perf_counter()
        for i in range(n):
            await q.enqueue(i)
        return n / (time.perf_counter() - t0)


def sync_enqueue_rate(url: str, n: int) -> float:
    with Queue(f"fl-{uuid.uuid4().hex[:8]}", url=url) as q:
        q.enqueue(0)
        return rate(n, q.enqueue)


def socket_ping_rates(url: str, n: int) -> tuple[float, float]:
    """PINGs on a bare socket: blocking, then asyncio streams (what the loop itself costs)."""
    where = urlparse(url)
    host, port = where.hostname or "127.0.0.1", where.port or 6379
    with socket.create_connection((host, port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def ping(_: int) -> None:
            s.sendall(b"PING\r\n")
            s.recv(64)

        blocking = rate(n, ping)

    async def streams() -> float:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            t0 = time.perf_counter()
            for _ in range(n):
                writer.write(b"PING\r\n")
                await reader.readline()
            return n / (time.perf_counter() - t0)
        finally:
            writer.close()

    return blocking, asyncio.run(streams())


def bullmq_latency(url: str, n: int) -> list[float] | None:
    """Idle enqueue→start latency of BullMQ for Python's worker, in ms; None without it."""
    try:
        from bullmq import Job
        from bullmq import Queue as BullQueue
    except ImportError:
        return None
    name = f"bull-{uuid.uuid4().hex[:8]}"
    worker = subprocess.Popen(
        [sys.executable, "-c", BULLMQ_WORKER, name, url],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert worker.stdout is not None and worker.stdin is not None
    worker.stdout.readline()  # ready

    async def measure() -> list[float]:
        q = BullQueue(name, {"connection": url})
        try:

            async def started_at() -> float:
                job = await q.add("job", {})
                while True:  # how the producer learns it is not part of the figure
                    await asyncio.sleep(0.002)
                    done = await Job.fromId(q, job.id)
                    if done is not None and done.returnvalue is not None:
                        return float(done.returnvalue)

            await started_at()
            samples = []
            for _ in range(n):
                await asyncio.sleep(0.01)  # idle: the worker waits for work
                t0 = time.time()
                samples.append((await started_at() - t0) * 1000)
            await q.obliterate({"force": True})
            return samples
        finally:
            await q.close()

    try:
        return asyncio.run(measure())
    finally:
        worker.stdin.close()
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument("--latency", type=int, default=200, help="samples per latency run")
    parser.add_argument("--json", default=str(HERE / "results" / "floors.json"))
    parser.add_argument("--url", help="an existing redis-server (default: start one)")
    parser.add_argument("--quick", action="store_true", help="fewer samples: a smoke check")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.jobs, args.latency = 2, 1000, 50
    runs: dict[str, list[float]] = {}

    def keep(key: str, value: float) -> None:
        runs.setdefault(key, []).append(value)

    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(RedisServer()).url
        for i in range(args.runs):
            for key, value in enqueue_vs_ping(url, args.jobs).items():
                keep(key, value)
            sync, one = (
                sync_enqueue_rate(url, args.jobs),
                asyncio.run(aio_enqueue_rate(url, args.jobs)),
            )
            keep("aio_pct", one / sync * 100)
            blocking, streams = socket_ping_rates(url, args.jobs)
            keep("socket_aio_pct", streams / blocking * 100)
            ours = sorted(latency(url, args.latency))
            keep("latency_p50", figures.percentile(ours, 50))
            keep("latency_p95", figures.percentile(ours, 95))
            peer = bullmq_latency(url, args.latency)
            if peer is not None:
                peer.sort()
                keep("bullmq_p50", figures.percentile(peer, 50))
                keep("bullmq_p95", figures.percentile(peer, 95))
                keep("latency_vs_bullmq", runs["latency_p50"][-1] / runs["bullmq_p50"][-1])
            print(f"  run {i + 1}/{args.runs} done", flush=True)
    figs = [
        figures.figure("redis-py PING", runs["ping"], "/s", digits=0),
        figures.figure("EVALSHA of 'return 1'", runs["script"], "/s", digits=0),
        figures.figure("Queue.enqueue, one at a time", runs["single"], "jobs/s", digits=0),
        figures.figure("single enqueue vs PING", runs["ratio"], "x PING", SINGLE_VS_PING),
        figures.figure("enqueue script's server time", runs["server_us"], "µs"),
        figures.figure("client CPU per enqueue", runs["client_us"], "µs"),
        figures.figure(
            "ceiling: one PING + the script's server time, no client cost",
            runs["ceiling_ratio"],
            "x PING",
        ),
        figures.figure(
            "aio enqueue one at a time vs sync", runs["aio_pct"], "% of sync", AIO_VS_SYNC, digits=1
        ),
        figures.figure(
            "transport alone: asyncio streams PING vs a blocking socket",
            runs["socket_aio_pct"],
            "% of blocking",
            digits=1,
        ),
        figures.figure("idle enqueue->start p50", runs["latency_p50"], "ms"),
        figures.figure("idle enqueue->start p95", runs["latency_p95"], "ms"),
    ]
    if "bullmq_p50" in runs:
        figs += [
            figures.figure("BullMQ for Python: idle enqueue->start p50", runs["bullmq_p50"], "ms"),
            figures.figure("BullMQ for Python: idle enqueue->start p95", runs["bullmq_p95"], "ms"),
            figures.figure(
                "idle latency p50 vs BullMQ",
                runs["latency_vs_bullmq"],
                "x BullMQ",
                LATENCY_VS_BULLMQ,
            ),
        ]
    for fig in figs:
        print(figures.line(fig))
    figures.write_json(args.json, {"jobs": args.jobs, "figures": figs})


if __name__ == "__main__":
    main()
