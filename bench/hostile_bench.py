"""Hostile jobs: what one parent-killing job costs a worker, and what a child's isolation
costs a replacement.

    python bench/hostile_bench.py [poison|isolation|all] [--json OUT] [--quick]
        [--baseline PATH]

poison     one worker (concurrency 1, then 2) on a real redis-server, one job that SIGKILLs
           its fork server and 100 ordinary jobs: how many ordinary jobs complete, how long
           until the parent-killer is failed as ``poison``, and how many times the worker
           restarted its fork server. Several runs; the medians are the figures.
isolation  replacement child ready after a kill, back to back (numpy preloaded), this
           checkout against ``--baseline`` (a checkout of the code before children were
           isolated: default none, then only this one is measured), runs alternated; and
           the cost of one ``descriptors.keep_only`` in a child, measured inside it.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import figures  # noqa: E402

ORDINARY = 100
#: Runs of the replacement bench per checkout, alternated.
ROUNDS = 6


def _poison_run(url: str, queue_name: str, concurrency: int) -> dict[str, float]:
    from sandboxq import JobFailed, Queue
    from sandboxq.testing.workers import BackgroundWorkers

    queue = Queue(queue_name, url=url)
    try:
        with BackgroundWorkers(join_timeout_s=30) as workers:
            worker = workers.start(
                queue,
                "sandboxq.testing.hostile:call",
                concurrency=concurrency,
                hard_timeout_s=30,
                lease_s=10,
            )
            t0 = time.monotonic()
            poison = queue.enqueue("kill_parent")
            plain = [queue.enqueue("echo", i) for i in range(ORDINARY)]
            try:
                poison.result(timeout_s=120)
                outcome = "completed?"
            except JobFailed as failed:
                outcome = failed.outcome
            poisoned_s = time.monotonic() - t0
            done = 0
            for job in plain:
                try:
                    done += job.result(timeout_s=120) is not None
                except JobFailed:
                    pass
            total_s = time.monotonic() - t0
            pool = worker._pool
            restarts = pool.helper_restarts if pool is not None else -1
            assert outcome == "poison", outcome
        return {
            "ordinary_completed": done,
            "poisoned_after_s": poisoned_s,
            "all_done_s": total_s,
            "helper_restarts": restarts,
        }
    finally:
        queue.close()


def bench_poison(quick: bool = False) -> dict[str, Any]:
    from sandboxq.testing.redis_server import RedisServer

    out: dict[str, Any] = {"figures": []}
    with RedisServer() as redis:
        for concurrency in (1, 2):
            runs = [
                _poison_run(redis.url, f"hostile-{concurrency}-{i}", concurrency)
                for i in range(2 if quick else 5)
            ]
            out[f"concurrency_{concurrency}"] = runs
            for key, unit, target, digits in (
                ("ordinary_completed", "jobs", figures.Target("==", ORDINARY, "jobs"), 0),
                ("poisoned_after_s", "s", None, 2),
                ("helper_restarts", "restarts", None, 0),
            ):
                fig = figures.figure(
                    f"parent-killer + {ORDINARY} jobs, concurrency {concurrency}: {key}",
                    [float(r[key]) for r in runs],
                    unit,
                    target,
                    digits=digits,
                )
                out["figures"].append(fig)
                print(figures.line(fig), flush=True)
    return out


# -- isolation ---------------------------------------------------------------------------


def isolate_cost_us(rounds: int = 200) -> float:
    """Processor: the median cost, in µs, of pointing this child's inherited descriptors at
    /dev/null (as at its start: the same descriptors, already /dev/null here)."""
    from sandboxq.pool import descriptors

    keep = [fd for fd in descriptors.open_descriptors() if _what(fd).startswith("socket:")]
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        descriptors.keep_only(keep)
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def _what(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


_REPLACE = """
import sys, time, json
sys.path.insert(0, {bench!r})
from concurrent.futures import Future
from sandboxq import Pool
samples = []
with Pool("bench_jobs:numpy_job", size=1, hard_timeout_s=0.1) as pool:
    pool.submit(0).result(timeout=30)
    for _ in range({n}):
        killed = Future()
        pool.execute(pool.make_task(10), killed.set_result)
        killed.result(timeout=30)
        t0 = time.monotonic()
        pool.submit(0).result(timeout=30)
        samples.append((time.monotonic() - t0) * 1000)
print(json.dumps(samples))
"""


def _replace_ms(checkout: Path, n: int) -> float:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(checkout), str(HERE)])}
    code = _REPLACE.format(bench=str(HERE), n=n)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, check=True, text=True
    )
    return float(statistics.median(json.loads(out.stdout.strip().splitlines()[-1])))


def bench_isolation(quick: bool = False, baseline: str | None = None) -> dict[str, Any]:
    from sandboxq import Pool

    n = 8 if quick else 25
    checkouts = {"isolated": ROOT}
    if baseline:
        checkouts["before"] = Path(baseline)
    runs: dict[str, list[float]] = {name: [] for name in checkouts}
    for _ in range(2 if quick else ROUNDS):
        for name, checkout in checkouts.items():
            runs[name].append(_replace_ms(checkout, n))
    out: dict[str, Any] = {"figures": [], "replace_ms": runs}
    for name, values in runs.items():
        fig = figures.figure(f"replacement child ready, {name} (median of runs)", values, "ms")
        out["figures"].append(fig)
        print(figures.line(fig), flush=True)
    if "before" in runs:
        ratio = statistics.median(runs["isolated"]) / statistics.median(runs["before"]) - 1
        fig = figures.figure(
            "replacement time, isolated vs before",
            [ratio * 100],
            "%",
            figures.Target("<=", 5, "%"),
        )
        out["figures"].append(fig)
        print(figures.line(fig), flush=True)
    with Pool("hostile_bench:isolate_cost_us", size=1) as pool:
        cost = [pool.submit().result(timeout=30) for _ in range(3 if quick else 7)]
    fig = figures.figure("one keep_only in a child (its start's cost)", cost, "µs", digits=1)
    out["figures"].append(fig)
    print(figures.line(fig), flush=True)
    return out


SECTIONS: dict[str, figures.Section] = {
    "poison": lambda args: bench_poison(args.quick),
    "isolation": lambda args: bench_isolation(args.quick, args.baseline),
}


def main() -> None:
    figures.run_sections(
        __file__,
        SECTIONS,
        HERE / "results" / "hostile.json",
        lambda parser: parser.add_argument("--baseline", default=None),
    )


if __name__ == "__main__":
    main()
