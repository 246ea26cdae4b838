"""Dashboard pages on a queue of a million jobs: server time per page, Redis commands per page.

    python bench/dashboard_bench.py [--json OUT] [--url URL] [--jobs N] [--failed N] [--quick]

Fills one queue with N waiting jobs through the producer path (``Queue.enqueue_many`` in
batches: enqueue.lua, the real key layout), and a second state with F failed jobs written
straight in the same layout (a pipeline of HSET + RPUSH history + ZADD failed: running a
million jobs through a worker would take the whole run). Then serves each page through
the ASGI app in this process (httpx's ASGI transport: Starlette's routing, the endpoint,
the backend reads and the HTML, no network) and times each ``RUNS`` times.

Figures: median and worst server time per page (target: <= 200 ms each), the round trips
to Redis per render (counted in this process: a queue page is two, the counts' pipeline
and the one script call that returns the 50 jobs), and the commands Redis ran for it
(``INFO stats``, those inside the script included: they show no page scans all jobs;
the overview's count includes the events reader's blocking read, once a second).
Without --url it starts its own redis-server; the fill takes most of the run (about a
minute for a million jobs here).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import redis

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import figures  # noqa: E402

from sandboxq import JobState, Queue  # noqa: E402
from sandboxq.backends.redis.connection import Lane  # noqa: E402
from sandboxq.backends.redis.keys import QueueKeys  # noqa: E402
from sandboxq.testing.redis_server import RedisServer  # noqa: E402
from sandboxq.web import create_app  # noqa: E402

RUNS = 20
BATCH = 10_000
PAGE_TARGET = figures.Target("<=", 200, "ms")


def fill_waiting(q: Queue, n: int) -> float:
    """``n`` waiting jobs through enqueue_many; returns jobs per second."""
    started = time.perf_counter()
    for first in range(0, n, BATCH):
        q.enqueue_many(
            [((f"photo-{i}.png",), {"size": 256}) for i in range(first, min(n, first + BATCH))]
        )
    return n / (time.perf_counter() - started)


def fill_failed(client: redis.Redis, keys: QueueKeys, n: int) -> list[str]:
    """``n`` failed jobs in the key layout finish.lua leaves (hash, history, failed ZSET);
    one in ten crashed, the rest raised. Returns their ids."""
    now = int(time.time() * 1000)
    ids = [f"failed-{i:07d}" for i in range(n)]
    for first in range(0, n, BATCH):
        pipe = client.pipeline(transaction=False)
        for i in range(first, min(n, first + BATCH)):
            job_id = ids[i]
            crashed = i % 10 == 0
            outcome = "crashed" if crashed else "error"
            error = "crashed: SIGSEGV" if crashed else f"ValueError: bad input in photo-{i}.png"
            finished = now - (n - i)
            pipe.hset(
                keys.job(job_id),
                mapping={
                    "payload": json.dumps([[f"photo-{i}.png"], {"size": 256}]),
                    "codec": "json",
                    "opts": "{}",
                    "state": "failed",
                    "priority": "0",
                    "max_stalls": "1",
                    "seq": str(i),
                    "created_ms": str(finished - 900),
                    "attempts": "1",
                    "outcome": outcome,
                    "error": error,
                    "finished_ms": str(finished),
                },
            )
            record = {
                "attempt": 1, "outcome": outcome, "action": "fail", "worker_id": "bench:1:w",
                "pid": 4242, "signal": 11 if crashed else None, "started_ms": finished - 800,
                "ended_ms": finished, "error": error,
            }  # fmt: skip
            pipe.rpush(keys.history(job_id), json.dumps({k: v for k, v in record.items() if v}))
            pipe.zadd(keys.failed, {job_id: finished})
        pipe.execute()
    return ids


class RoundTrips:
    """Counts this process's round trips to Redis: a plain command, a pipeline, a lane's
    batch of packed commands (the scripts) each count one."""

    def __init__(self) -> None:
        self.count = 0
        plain = redis.Redis.execute_command
        pipeline = redis.client.Pipeline.execute
        lane = Lane.round_trip

        def count_plain(client: Any, *args: Any, **kwargs: Any) -> Any:
            if not isinstance(client, redis.client.Pipeline):
                self.count += 1
            return plain(client, *args, **kwargs)

        def count_pipeline(pipe: Any, *args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return pipeline(pipe, *args, **kwargs)

        def count_lane(lane_: Any, *args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return lane(lane_, *args, **kwargs)

        redis.Redis.execute_command = count_plain  # type: ignore[method-assign]
        redis.client.Pipeline.execute = count_pipeline  # type: ignore[method-assign]
        Lane.round_trip = count_lane  # type: ignore[method-assign]


async def time_pages(
    app: Any, pages: dict[str, str], raw: redis.Redis, trips: RoundTrips
) -> dict[str, Any]:
    transport = httpx.ASGITransport(app=app)
    out: dict[str, Any] = {}
    async with httpx.AsyncClient(transport=transport, base_url="http://bench") as http:
        for name, path in pages.items():
            first = await http.get(path)  # warm: scripts loaded, connections open
            assert first.status_code in (200, 303), (name, first.status_code, first.text[:300])
            before = int(raw.info("stats")["total_commands_processed"])
            trips_before = trips.count
            ms = []
            for _ in range(RUNS):
                started = time.perf_counter()
                response = await http.get(path)
                ms.append((time.perf_counter() - started) * 1000)
                assert response.status_code in (200, 303), name
            round_trips = (trips.count - trips_before) / RUNS
            after = int(raw.info("stats")["total_commands_processed"])
            # commands Redis ran, those a script calls included; each INFO is one command
            # too: the one after is counted, the one before not
            commands = (after - before - 1) / RUNS
            out[name] = {"ms": sorted(ms), "commands": commands, "round_trips": round_trips}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=str(HERE / "results" / "dashboard.json"))
    parser.add_argument("--url", help="an existing redis-server (default: start one)")
    parser.add_argument("--jobs", type=int, default=1_000_000, help="waiting jobs")
    parser.add_argument("--failed", type=int, default=200_000, help="failed jobs")
    parser.add_argument("--quick", action="store_true", help="100,000 + 20,000 jobs")
    args = parser.parse_args()
    if args.quick:
        args.jobs, args.failed = 100_000, 20_000
    name = f"bench-dash-{uuid.uuid4().hex[:6]}"
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(RedisServer()).url
        raw = redis.Redis.from_url(url)
        stack.callback(raw.close)
        q = Queue(name, url=url)
        stack.callback(q.close)
        keys = QueueKeys(name)
        started = time.perf_counter()
        rate = fill_waiting(q, args.jobs)
        failed_ids = fill_failed(raw, keys, args.failed)
        fill_s = time.perf_counter() - started
        waiting_id = q.backend.list_jobs(JobState.WAITING, 1)[0]
        print(
            f"  filled {args.jobs:,} waiting + {args.failed:,} failed jobs in {fill_s:.1f} s "
            f"(enqueue_many: {rate:,.0f} jobs/s); Redis uses "
            f"{raw.info('memory')['used_memory_human']}"
        )
        app = create_app(url, queues=[name])
        stack.callback(app.state.dashboard.close)
        deep = q.backend.job_page(JobState.WAITING, None, 50)
        for _ in range(20):  # 20 pages in: a cursor from the middle of the walk
            deep = q.backend.job_page(JobState.WAITING, deep.next_cursor, 50)
        pages = {
            "overview": "/",
            "queue, waiting, first page": f"/queue?name={name}",
            "queue, waiting, page 21": f"/queue?name={name}&cursor={deep.next_cursor}",
            "queue, failed, newest": f"/queue?name={name}&state=failed",
            "queue, failed, outcome=crashed": f"/queue?name={name}&state=failed&outcome=crashed",
            "queue, search by id": f"/queue?name={name}&id={failed_ids[len(failed_ids) // 2]}",
            "job, failed": f"/job?queue={name}&id={failed_ids[-1]}",
            "job, waiting": f"/job?queue={name}&id={waiting_id}",
            "workers": "/workers",
        }
        timed = asyncio.run(time_pages(app, pages, raw, RoundTrips()))
        # finding the queues without --queue: the queue index, never a SCAN of the keys
        index_started = time.perf_counter()
        found = q.backend.queue_index().names
        index_s = time.perf_counter() - index_started
        assert name in found
    out: dict[str, Any] = {
        "waiting_jobs": args.jobs,
        "failed_jobs": args.failed,
        "fill_s": round(fill_s, 1),
        "enqueue_jobs_per_s": round(rate),
        "runs_per_page": RUNS,
        "pages": timed,
        "figures": [],
    }
    keys_total = args.jobs + 2 * args.failed
    out["figures"].append(
        figures.figure(
            "dashboard queue discovery (the queue index)",
            [index_s * 1000],
            "ms",
            note=f"{keys_total:,} keys on the server, none walked",
        )
    )
    for page, result in timed.items():
        ms = result["ms"]
        out["figures"].append(
            figures.figure(
                f"dashboard {page}, median",
                [figures.percentile(ms, 50)],
                "ms",
                PAGE_TARGET,
                note=f"{result['round_trips']:.1f} round trips, "
                f"{result['commands']:.0f} Redis commands per render",
            )
        )
        out["figures"].append(
            figures.figure(f"dashboard {page}, worst", [ms[-1]], "ms", PAGE_TARGET)
        )
    for fig in out["figures"]:
        print(figures.line(fig) + (f"  ({fig['note']})" if fig.get("note") else ""))
    figures.write_json(args.json, out)


if __name__ == "__main__":
    main()
