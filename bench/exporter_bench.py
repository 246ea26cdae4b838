"""What one exporter scrape costs with many queues and keys that only look like queues.

    python bench/exporter_bench.py [--queues N] [--junk N] [--scrapes N] [--json OUT] [--quick]

On a redis-server of its own: ``--queues`` real queues (a few jobs each, a registered
worker on every tenth), then ``--junk`` keys shaped like queue keys (``sq:{junk-i}:seq``
and ``sq:{junk-i}:workers``, what a keyspace SCAN took for queues) plus malformed and
unbacked names added to the queue index by hand. Each scrape is timed end to end
through ``/metrics`` over HTTP, as Prometheus does, before and after the junk, and the
series counted: the junk must add none. Then the same queues on a 3-node Redis Cluster
(``tests/support/redis_cluster.py``: run from a checkout), without the junk.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import urllib.request
from pathlib import Path

import redis

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import figures  # noqa: E402

from sandboxq.backends.redis.keys import INDEX  # noqa: E402
from sandboxq.client import Queue  # noqa: E402
from sandboxq.observe.exporter import QueueExporter  # noqa: E402
from sandboxq.testing.redis_server import RedisServer  # noqa: E402

SCRAPE = figures.Target("<=", 100, "ms")
NO_SERIES = figures.Target("==", 0, "series")


def scrape(address: tuple[str, int]) -> tuple[float, int]:
    """Milliseconds for one GET /metrics, and the number of series (sample lines) it had."""
    started = time.perf_counter()
    with urllib.request.urlopen(f"http://{address[0]}:{address[1]}/metrics", timeout=30) as r:
        text = r.read().decode()
    took_ms = (time.perf_counter() - started) * 1000
    return took_ms, sum(1 for line in text.splitlines() if line and not line.startswith("#"))


def scrapes(address: tuple[str, int], n: int) -> tuple[list[float], int]:
    scrape(address)  # the first one also opens the connection
    runs = [scrape(address) for _ in range(n)]
    return [ms for ms, _ in runs], runs[-1][1]


def fill(url: str, queues: int) -> None:
    for i in range(queues):
        with Queue(f"real-{i}", url=url) as q:
            q.enqueue_many([((j,), {}) for j in range(3)])
            if i % 10 == 0:
                q.backend.register_worker(f"w-{i}", {"host": "bench"}, 3600.0)


def add_junk(raw: redis.Redis, junk: int) -> None:
    pipe = raw.pipeline(transaction=False)
    for i in range(junk):
        pipe.set(f"sq:{{junk-{i}}}:seq", 1)
        if i % 2:
            pipe.sadd(f"sq:{{junk-{i}}}:workers", "ghost")
    pipe.sadd(INDEX, "not a queue!", "x" * 300, b"\xff", *[f"unbacked-{i}" for i in range(100)])
    pipe.execute()


def cluster_scrapes(queues: int, n: int) -> list[float]:
    """Scrape times with ``queues`` queues on a throwaway Cluster."""
    sys.path.insert(0, str(HERE.parent))
    from tests.support.redis_cluster import LocalCluster

    with LocalCluster() as cluster:
        fill(cluster.url, queues)
        exporter = QueueExporter(cluster.url)
        try:
            return scrapes(exporter.serve(0), n)[0]
        finally:
            exporter.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--queues", type=int, default=1000)
    parser.add_argument("--junk", type=int, default=10_000)
    parser.add_argument("--scrapes", type=int, default=20)
    parser.add_argument("--json", default=str(HERE / "results" / "exporter.json"))
    parser.add_argument("--quick", action="store_true", help="5 scrapes instead of 20")
    args = parser.parse_args()
    if args.quick:
        args.scrapes = 5
    with RedisServer() as server:
        raw = redis.Redis.from_url(server.url)
        started = time.perf_counter()
        fill(server.url, args.queues)
        fill_s = time.perf_counter() - started
        exporter = QueueExporter(server.url)
        try:
            address = exporter.serve(0)
            clean_ms, clean_series = scrapes(address, args.scrapes)
            add_junk(raw, args.junk)
            junk_ms, junk_series = scrapes(address, args.scrapes)
        finally:
            exporter.close()
            raw.close()
    on_cluster_ms = cluster_scrapes(args.queues, args.scrapes)
    figs = [
        figures.figure(f"scrape, {args.queues} queues", clean_ms, "ms", SCRAPE, digits=1),
        figures.figure(
            f"scrape, {args.queues} queues + {args.junk} junk keys",
            junk_ms,
            "ms",
            SCRAPE,
            digits=1,
        ),
        figures.figure(
            f"scrape, {args.queues} queues on a 3-node Cluster",
            on_cluster_ms,
            "ms",
            SCRAPE,
            digits=1,
        ),
        figures.figure("series, real queues only", [clean_series], "series", digits=0),
        figures.figure(
            "series added by the junk", [junk_series - clean_series], "series", NO_SERIES, digits=0
        ),
    ]
    for fig in figs:
        print(figures.line(fig))
    p95 = figures.percentile(sorted(junk_ms), 95)
    print(f"  p95 scrape with junk: {p95:.1f} ms; mean {statistics.mean(junk_ms):.1f} ms")
    figures.write_json(
        args.json,
        {"queues": args.queues, "junk_keys": args.junk, "fill_s": round(fill_s, 1),
         "scrape_p95_ms": round(p95, 1), "figures": figs},
    )  # fmt: skip


if __name__ == "__main__":
    main()
