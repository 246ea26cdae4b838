"""The dashboard with many queues, on one redis-server and on a Redis Cluster.

    python bench/dashboard_queues_bench.py [--json OUT] [--queues N] [--runs R] [--quick]

Makes N queues (one job enqueued in each: each is in the queue index), then serves the
overview through the ASGI app in this process (httpx's ASGI transport, no network) with
no queue named, as a new user starts it. Figures, per server kind: the first overview
(every queue's backend opened, the index read), the median of R more, the connections
the servers hold for the dashboard (``CLIENT LIST``, this bench's own left out), and the
CPU the dashboard process spends over IDLE_S with no page asked for (its events reader
following every queue, and the queue index read every half second).

The Cluster is three masters on loopback (``tests/support/redis_cluster.py``: run from a
checkout). Each server kind is measured in a process of its own, so the first overview
pays its imports and first connections as a freshly started dashboard does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # tests.support: the throwaway Cluster

import figures  # noqa: E402

IDLE_S = 10.0
FIRST_TARGET = figures.Target("<=", 2000, "ms")  # issue 23: a new queue shows within 2 s
OVERVIEW_TARGET = figures.Target("<=", 200, "ms")  # as every other page (dashboard_bench)


def measure(kind: str, queues: int, runs: int) -> dict[str, Any]:
    """One server kind, in this process: the figures as plain numbers."""
    import httpx
    import redis

    from sandboxq import Queue
    from sandboxq.testing.redis_server import RedisServer
    from sandboxq.web import create_app
    from tests.support.redis_cluster import LocalCluster

    server: Any = LocalCluster() if kind == "cluster" else RedisServer()
    with server:
        ports = server.ports if kind == "cluster" else [server.port]
        for i in range(queues):
            with Queue(f"bench-q{i}", url=server.url) as queue:
                queue.enqueue(i)

        def connections() -> int:
            total = 0
            for port in ports:
                with redis.Redis(port=port) as raw:
                    total += len(raw.client_list()) - 1  # this one's own
            return total

        base = connections()
        app = create_app(server.url)

        async def pages() -> tuple[float, list[float], float]:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as http:
                started = time.perf_counter()
                first = await http.get("/")
                first_ms = (time.perf_counter() - started) * 1000
                assert first.status_code == 200 and f"bench-q{queues - 1}" in first.text
                ms = []
                for _ in range(runs):
                    started = time.perf_counter()
                    assert (await http.get("/")).status_code == 200
                    ms.append((time.perf_counter() - started) * 1000)
                cpu = time.process_time()
                await asyncio.sleep(IDLE_S)
                return first_ms, sorted(ms), (time.process_time() - cpu) / IDLE_S

        try:
            first_ms, ms, idle_cpu = asyncio.run(pages())
            held = connections() - base
        finally:
            app.state.dashboard.close()
    return {"first_ms": first_ms, "overview_ms": ms, "connections": held, "idle_cpu": idle_cpu}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=str(HERE / "results" / "dashboard_queues.json"))
    parser.add_argument("--queues", type=int, default=200)
    parser.add_argument("--runs", type=int, default=10, help="overviews timed after the first")
    parser.add_argument("--quick", action="store_true", help="50 queues")
    parser.add_argument("--url", help="(ignored: this bench starts its own servers)")
    parser.add_argument("--one", choices=["plain", "cluster"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.queues = 50
    if args.one:  # a child of the run below: print the numbers as JSON
        print(json.dumps(measure(args.one, args.queues, args.runs)))
        return
    out: dict[str, Any] = {"queues": args.queues, "idle_s": IDLE_S, "figures": []}
    for kind in ("plain", "cluster"):
        command = [sys.executable, __file__, "--one", kind, "--queues", str(args.queues)]
        done = subprocess.run(
            [*command, "--runs", str(args.runs)], capture_output=True, text=True, check=True
        )
        got = json.loads(done.stdout.strip().splitlines()[-1])
        out[kind] = got
        where = "one redis-server" if kind == "plain" else "a 3-node Cluster"
        name = f"dashboard, {args.queues} queues on {where}"
        out["figures"] += [
            figures.figure(f"{name}: first overview", [got["first_ms"]], "ms", FIRST_TARGET),
            figures.figure(
                f"{name}: overview, median",
                [statistics.median(got["overview_ms"])],
                "ms",
                OVERVIEW_TARGET,
                note=f"worst {got['overview_ms'][-1]:.0f} ms of {args.runs}",
            ),
            figures.figure(f"{name}: connections held", [got["connections"]], "", digits=0),
            figures.figure(
                f"{name}: idle CPU",
                [got["idle_cpu"] * 100],
                "% core",
                note=f"no page asked for, over {IDLE_S:.0f} s",
            ),
        ]
    for fig in out["figures"]:
        print(figures.line(fig) + (f"  ({fig['note']})" if fig.get("note") else ""))
    figures.write_json(args.json, out)


if __name__ == "__main__":
    main()
