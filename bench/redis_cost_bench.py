"""Redis CPU per job, measured the way a shard owner would: from the server's own counters.

    python bench/redis_cost_bench.py [--runs N] [--json OUT] [--url URL] [--quick]

Method: ``CONFIG RESETSTAT``, the server's ``used_cpu_user + used_cpu_sys`` (``INFO cpu``:
the redis-server process's own CPU, reading sockets and parsing included), the phase,
then the counters again and ``INFO commandstats`` (the commands sent and the server's
microseconds inside them). Each phase runs on a fresh queue; the peer's run alternates
with ours in every round, against the same server.

    sandboxq, one operation at a time (the backend's own calls):
        enqueue one by one ─► claim one at a time ─► finish (complete, nothing claimed)
        enqueue_many
        life: enqueue one by one, then a real ``sandboxq worker`` (2 children) runs them
              (its claims ride on its finishes)
    BullMQ for Python (the bench extra), on the same server:
        add one by one, addBulk, life: add one by one, then a Worker (concurrency 2) runs
        them (its next job rides on moveToFinished)
    renewal: one worker holding 10,000 leases renews them all, RENEWALS times: the server
        CPU per held lease per renewal, and the calls it took (the heartbeat sends one
        renew per interval with every lease it holds: worker/heartbeat.py)

Targets: the life of a no-op job <= 0.5x BullMQ's; renewal <= 2 us per lease.

Measured (5,000 jobs, runs of one tree alternated with runs of the one before it,
medians): the scripts as a function library: the life of a no-op job 93.5 us of server
CPU (runs 92-117) against 107 us as EVALSHA (106-110); enqueue one by one 60 us (before
72), claim one at a time 65 us (80), finish 72 us (85): a function call saves the ~12 us
an EVALSHA paid to define common.lua's helpers anew on every call (15 us for that prelude
with ``return 0`` against 2.4-2.8 us for a bare ``return 0``). Then a finish trimming once
for all its jobs and a claim popping its jobs in one call: Redis calls per job's life 24.9
-> 21.0, server CPU inside the scripts 73 -> 60 us a job, the life 92.9 us (runs 91.5-94.2)
against 102 us (97.7-108). BullMQ's life in those runs: 164, 178 and 221 us: 0.52x
(0.43-0.57x; target 0.5x: met in one run of three). Enqueue one by one costs as much as
BullMQ's add (60 us): half of it is outside the script (reading the request, writing the
reply), the rest is its eight calls inside. Renewal: 3.4-4.0 us per lease (before the
ZMSCORE/ZADD chunks and the library 4.4-4.9; target 2 us missed); the floor of bare renew is
2.5 us (the owner check, HMGET of three fields of a job's hash, ~1.7 us, and the ZADD), so
the owner check per lease (design invariant 1) alone puts 2 us out of reach.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import figures  # noqa: E402
from queue_bench import backlog_rate, stop, worker  # noqa: E402

from sandboxq import Queue  # noqa: E402
from sandboxq.backends.base import Claimed  # noqa: E402
from sandboxq.models import AttemptRecord, Outcome  # noqa: E402
from sandboxq.testing.redis_server import RedisServer  # noqa: E402

LIFE_RATIO = figures.Target("<=", 0.5, "x BullMQ")
RENEW_PER_LEASE = figures.Target("<=", 2, "us")
LEASES = 10_000
RENEWALS = 20
WORKER_ID = "bench-worker"


def server_cpu_s(r: redis.Redis) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


@contextlib.contextmanager
def server_cost(r: redis.Redis) -> Iterator[dict[str, Any]]:
    """The server CPU (s) and the commands (calls, us inside them) of the block."""
    out: dict[str, Any] = {}
    r.config_resetstat()
    cpu0 = server_cpu_s(r)
    yield out
    out["cpu_s"] = server_cpu_s(r) - cpu0
    out["commands"] = {
        name.removeprefix("cmdstat_"): {"calls": int(s["calls"]), "usec": int(s["usec"])}
        for name, s in r.info("commandstats").items()
        if name not in ("cmdstat_info", "cmdstat_config")
    }


def per_job_us(cost: dict[str, Any], n: int) -> float:
    return float(cost["cpu_s"]) / n * 1e6


def fresh(url: str) -> Queue:
    return Queue(f"c-{uuid.uuid4().hex[:8]}", url=url)


def sandboxq_phases(url: str, r: redis.Redis, n: int) -> dict[str, dict[str, Any]]:
    """Enqueue, claim and finish one at a time; enqueue_many; the life under a worker."""
    out: dict[str, dict[str, Any]] = {}
    q = fresh(url)
    backend: Any = q.backend
    try:
        with server_cost(r) as out["enqueue_single"]:
            for i in range(n):
                q.enqueue(i)
        claimed: list[Claimed] = []
        with server_cost(r) as out["claim"]:
            for _ in range(n):
                claimed += backend.claim(WORKER_ID, 1, 300.0)
        assert len(claimed) == n, len(claimed)
        with server_cost(r) as out["finish"]:
            for job in claimed:
                record = AttemptRecord(attempt=job.attempt, outcome=Outcome.OK, worker_id=WORKER_ID)
                backend.finish(WORKER_ID, job.id, job.token, "complete", record, result=b"N.")
    finally:
        q.close()
    q = fresh(url)
    try:
        with server_cost(r) as out["enqueue_many"]:
            for start in range(0, n, 1000):
                q.enqueue_many([((i,), {}) for i in range(start, min(n, start + 1000))])
    finally:
        q.close()
    q = fresh(url)
    try:
        with server_cost(r) as out["life"]:
            for i in range(n):
                q.enqueue(i)
            w = worker(url, q.name, "bench_jobs:noop")
            try:
                backlog_rate(q, n)
            finally:
                stop(w)
    finally:
        q.close()
    return out


def bullmq_phases(url: str, r: redis.Redis, n: int) -> dict[str, dict[str, Any]] | None:
    """BullMQ's add one by one, addBulk, and the life under its Worker; None without it."""
    try:
        from bullmq import Queue as BullQueue
        from bullmq import Worker as BullWorker
    except ImportError:
        return None

    async def noop(job: Any, token: str) -> None:
        return None

    async def measure() -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        name = f"bull-{uuid.uuid4().hex[:8]}"
        q = BullQueue(name, {"connection": url})
        with server_cost(r) as out["enqueue_single"]:
            for i in range(n):
                await q.add("job", {"i": i})
        await q.obliterate({"force": True})
        with server_cost(r) as out["enqueue_many"]:
            for start in range(0, n, 1000):
                jobs = [
                    {"name": "job", "data": {"i": i}} for i in range(start, min(n, start + 1000))
                ]
                await q.addBulk(jobs)
        await q.obliterate({"force": True})
        await q.close()
        name = f"bull-{uuid.uuid4().hex[:8]}"
        q = BullQueue(name, {"connection": url})
        done = asyncio.Event()
        finished = 0

        def on_completed(*_: Any) -> None:
            nonlocal finished
            finished += 1
            if finished == n:
                done.set()

        with server_cost(r) as out["life"]:
            for i in range(n):
                await q.add("job", {"i": i})
            w = BullWorker(name, noop, {"connection": url, "concurrency": 2})
            w.on("completed", on_completed)
            await asyncio.wait_for(done.wait(), 600)
            await w.close()
        await q.obliterate({"force": True})
        await q.close()
        return out

    return asyncio.run(measure())


def renewal(url: str, r: redis.Redis, leases_n: int, renewals: int) -> dict[str, Any]:
    """One worker holding ``leases_n`` leases renews them all ``renewals`` times."""
    q = fresh(url)
    backend: Any = q.backend
    try:
        for start in range(0, leases_n, 1000):
            q.enqueue_many([((i,), {}) for i in range(start, min(leases_n, start + 1000))])
        leases: list[tuple[str, str]] = []
        while len(leases) < leases_n:
            got = backend.claim(WORKER_ID, 1000, 600.0)
            assert got, "the queue ran dry before every lease was held"
            leases += [(job.id, job.token) for job in got]
        took_s: list[float] = []
        with server_cost(r) as cost:
            for _ in range(renewals):
                t0 = time.perf_counter()
                lost = backend.renew(WORKER_ID, leases, 600.0)
                took_s.append(time.perf_counter() - t0)
                assert not lost, f"{len(lost)} leases lost"
        scripts = {  # the scripts run as functions (FCALL), or as EVALSHA under an ACL user
            part: sum(cost["commands"].get(c, {}).get(part, 0) for c in ("fcall", "evalsha"))
            for part in ("calls", "usec")
        }
        return {
            "cpu_us_per_lease": cost["cpu_s"] / (leases_n * renewals) * 1e6,
            "script_us_per_lease": scripts["usec"] / (leases_n * renewals),
            "calls_per_renewal": scripts["calls"] / renewals,
            "client_ms_per_renewal": sorted(took_s)[len(took_s) // 2] * 1000,
        }
    finally:
        q.close()


#: Lua loops over the same ARGV as renew.lua (id, token pairs), doing less and less of its
#: work per lease: what the server pays per lease for each part, on this server.
FLOOR_SCRIPTS = {
    "loop only": "for i = 1, #ARGV, 2 do local id = ARGV[i] end return 0",
    "ZADD": "for i = 1, #ARGV, 2 do redis.call('ZADD', KEYS[1], 1, ARGV[i]) end return 0",
    "HMGET + ZADD": """
        for i = 1, #ARGV, 2 do
          local f = redis.call('HMGET', KEYS[2] .. ARGV[i], 'owner', 'token', 'state')
          if f[1] == 'w' and f[2] == ARGV[i + 1] then redis.call('ZADD', KEYS[1], 2, ARGV[i]) end
        end
        return 0""",
    "HMGET + ZSCORE + ZADD": """
        for i = 1, #ARGV, 2 do
          local f = redis.call('HMGET', KEYS[2] .. ARGV[i], 'owner', 'token', 'state')
          if f[1] == 'w' and f[2] == ARGV[i + 1] and redis.call('ZSCORE', KEYS[1], ARGV[i]) then
            redis.call('ZADD', KEYS[1], 2, ARGV[i])
          end
        end
        return 0""",
}


def renew_floor(r: redis.Redis, leases_n: int, renewals: int) -> dict[str, float]:
    """Server microseconds per lease of each FLOOR_SCRIPTS loop (commandstats, EVAL)."""
    zset, prefix = f"floor:{uuid.uuid4().hex[:8]}:active", f"floor:{uuid.uuid4().hex[:8]}:job:"
    pipe = r.pipeline(transaction=False)
    argv: list[str] = []
    for i in range(leases_n):
        pipe.hset(f"{prefix}{i}", mapping={"owner": "w", "token": f"t{i}", "state": "active"})
        pipe.zadd(zset, {str(i): 1})
        argv += [str(i), f"t{i}"]
    pipe.execute()
    out: dict[str, float] = {}
    for name, script in FLOOR_SCRIPTS.items():
        r.config_resetstat()
        for _ in range(renewals):
            r.eval(script, 2, zset, prefix, *argv)
        stats = r.info("commandstats")["cmdstat_eval"]
        out[name] = int(stats["usec"]) / (leases_n * renewals)
    return out


def one_round(url: str, n: int, values: dict[str, list[float]], raw: list[Any]) -> None:
    r = redis.Redis.from_url(url)
    try:
        ours = sandboxq_phases(url, r, n)
        peer = bullmq_phases(url, r, n)
        renew = renewal(url, r, LEASES, RENEWALS)
        for name, us in renew_floor(r, LEASES, RENEWALS).items():
            renew[f"floor {name}"] = us
        r.flushall()
    finally:
        r.close()
    raw.append({"sandboxq": ours, "bullmq": peer, "renewal": renew})
    for phase, cost in ours.items():
        values[f"sandboxq_{phase}"].append(per_job_us(cost, n))
    values["sandboxq_parts"].append(
        sum(per_job_us(ours[p], n) for p in ("enqueue_single", "claim", "finish"))
    )
    if peer is not None:
        for phase, cost in peer.items():
            values[f"bullmq_{phase}"].append(per_job_us(cost, n))
        values["life_ratio"].append(per_job_us(ours["life"], n) / per_job_us(peer["life"], n))
    for key, value in renew.items():
        values[f"renew_{key}"].append(value)


FIGURES: dict[str, tuple[str, str, figures.Target | None]] = {
    "sandboxq_enqueue_single": ("Redis CPU: enqueue one by one", "us/job", None),
    "bullmq_enqueue_single": ("Redis CPU: BullMQ add one by one (same run)", "us/job", None),
    "sandboxq_enqueue_many": ("Redis CPU: enqueue_many (1,000 a call)", "us/job", None),
    "bullmq_enqueue_many": ("Redis CPU: BullMQ addBulk (same run)", "us/job", None),
    "sandboxq_claim": ("Redis CPU: claim one at a time", "us/job", None),
    "sandboxq_finish": ("Redis CPU: finish (complete) one at a time", "us/job", None),
    "sandboxq_parts": ("Redis CPU: enqueue + claim + finish, one call each", "us/job", None),
    "sandboxq_life": ("Redis CPU: life of a no-op job (enqueue + worker)", "us/job", None),
    "bullmq_life": ("Redis CPU: BullMQ life of a no-op job (same run)", "us/job", None),
    "life_ratio": ("Redis CPU: life of a no-op job vs BullMQ's", "x", LIFE_RATIO),
    "renew_cpu_us_per_lease": (
        f"Redis CPU per held lease per renewal ({LEASES:,} leases)",
        "us",
        RENEW_PER_LEASE,
    ),
    "renew_script_us_per_lease": ("  of which inside the renew script", "us", None),
    "renew_floor loop only": ("  floor: a Lua loop over the pairs alone", "us", None),
    "renew_floor ZADD": ("  floor: one ZADD per lease", "us", None),
    "renew_floor HMGET + ZADD": ("  floor: the owner check and the ZADD alone", "us", None),
    "renew_floor HMGET + ZSCORE + ZADD": (
        "  floor: HMGET, ZSCORE, ZADD per lease (renew before its chunks), bare",
        "us",
        None,
    ),
    "renew_calls_per_renewal": ("renew calls per renewal of every lease", "calls", None),
    "renew_client_ms_per_renewal": (f"renewal of {LEASES:,} leases, round trip", "ms", None),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument("--json", default=str(HERE / "results" / "redis_cost.json"))
    parser.add_argument("--url", help="an existing redis-server (default: start one)")
    parser.add_argument("--quick", action="store_true", help="one round of 1,000 jobs")
    args = parser.parse_args()
    runs, n = (1, 1000) if args.quick else (args.runs, args.jobs)
    values: dict[str, list[float]] = {k: [] for k in FIGURES}
    raw: list[Any] = []
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(RedisServer()).url
        for i in range(runs):
            t0 = time.monotonic()
            one_round(url, n, values, raw)
            print(f"  round {i + 1}/{runs} took {time.monotonic() - t0:.0f} s", flush=True)
    report: dict[str, Any] = {"quick": args.quick, "jobs": n, "figures": [], "rounds": raw}
    for key, (name, unit, target) in FIGURES.items():
        if values[key]:
            fig = figures.figure(name, values[key], unit, target, digits=3)
            report["figures"].append(fig)
            print(figures.line(fig))
    figures.write_json(args.json, report)


if __name__ == "__main__":
    main()
