"""Pool benchmarks: hard-kill overshoot, replacement-child latency, no-op throughput.

    python bench/pool_bench.py [kill|replace|throughput|all] [--json OUT] [--quick]

Each section runs in its own Python process (the fork server and its preloaded modules
are per process), prints its figures beside the targets, and the JSON goes to
bench/results/pool.json by default. ``--quick`` takes fewer samples (a smoke check, not
a figure to quote).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import figures  # noqa: E402

KILL_HANDLERS = [
    "sleep_forever",
    "cpu_spin",
    "hold_gil",
    "catastrophic_regex",
    "ignore_signals",
    "swallow_soft_timeout",
    "grandchild_hang",
    "setsid_grandchild_hang",
    "block_in_syscall",
]
#: Handlers that take a ``pid_file``: the grandchildren they start are checked too.
RECORDS_PIDS = {"grandchild_hang", "setsid_grandchild_hang"}
HARD_S = 0.25
KILLS = 24


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _leftovers(pid_file: Path) -> list[int]:
    """Processes a kill left behind: our own descendants other than the fork server and
    the resource tracker, and any grandchild a handler recorded (one that called setsid
    and was re-parented is no descendant of ours any more)."""
    import psutil

    ours = [
        p.pid
        for p in psutil.Process().children(recursive=True)
        if "forkserver" not in " ".join(p.cmdline())
        and "resource_tracker" not in " ".join(p.cmdline())
    ]
    recorded = [int(x) for x in pid_file.read_text().split()] if pid_file.exists() else []
    return sorted({pid for pid in ours + recorded if _running(pid)})


def bench_kill(quick: bool = False) -> dict[str, Any]:
    """Hard deadline → child reaped and outcome recorded, per misbehaving handler."""
    from sandboxq import Pool
    from sandboxq.models import Outcome
    from sandboxq.pool.attempt import AttemptResult

    kills = 6 if quick else KILLS
    out: dict[str, Any] = {"hard_timeout_s": HARD_S, "handlers": {}, "figures": []}
    tmp = tempfile.TemporaryDirectory(prefix="sandboxq-bench-")
    for handler in KILL_HANDLERS:
        overshoots = []
        pid_file = Path(tmp.name) / f"{handler}.pids"
        args = (str(pid_file),) if handler in RECORDS_PIDS else ()
        with Pool(f"sandboxq.testing.handlers:{handler}", size=2, hard_timeout_s=HARD_S) as pool:
            for _ in range(kills // 2):
                done: list[Future[AttemptResult]] = [Future(), Future()]
                for f in done:
                    pool.execute(pool.make_task(*args), f.set_result)
                for f in done:
                    r = f.result(timeout=30)
                    assert r.outcome is Outcome.HARD_TIMEOUT, r.cause
                    overshoots.append((r.runtime_s or 0) - HARD_S)
        time.sleep(0.05)  # a tree kill is done when the outcome is; this is only slack
        leftovers = _leftovers(pid_file)
        ms = sorted(x * 1000 for x in overshoots)
        out["handlers"][handler] = {
            "kills": len(ms),
            "median_ms": round(statistics.median(ms), 2),
            "max_ms": round(ms[-1], 2),
            "left_running": leftovers,
            "samples_ms": [round(x, 2) for x in ms],
        }
        figs = [
            figures.figure(f"kill overshoot {handler}, median", ms, "ms", figures.KILL_MEDIAN),
            figures.figure(f"kill overshoot {handler}, max", [ms[-1]], "ms", figures.KILL_MAX),
            figures.figure(
                f"left running after {handler}", [len(leftovers)], "processes", figures.LEFT_RUNNING
            ),
        ]
        figs[0]["runs"] = []  # the samples are kept once, in samples_ms
        out["figures"] += figs
        median, most, left = (f"{f['value']:g} {figures.mark(f['met'])}" for f in figs)
        print(
            f"  {handler:24} median {median:12} max {most:12} left running: {left}   "
            f"[target {figures.KILL_MEDIAN} median, {figures.KILL_MAX} max, none left]",
            flush=True,
        )
    tmp.cleanup()
    return out


def bench_replace(quick: bool = False) -> dict[str, Any]:
    """Kill recorded → the next job has run on the replacement child (processor imports numpy)."""
    from sandboxq import Pool
    from sandboxq.pool.attempt import AttemptResult

    samples = []
    with Pool("bench_jobs:numpy_job", size=1, hard_timeout_s=0.1) as pool:
        pool.submit(0).result(timeout=30)
        for _ in range(8 if quick else 25):
            killed: Future[AttemptResult] = Future()
            pool.execute(pool.make_task(10), killed.set_result)  # sleeps past the deadline
            killed.result(timeout=30)
            t0 = time.monotonic()
            pool.submit(0).result(timeout=30)
            samples.append((time.monotonic() - t0) * 1000)
    samples.sort()
    fig = figures.figure(
        "replacement child ready (numpy preloaded), median", samples, "ms", figures.REPLACE_MEDIAN
    )
    samples_ms, fig["runs"] = fig["runs"], []  # the samples are kept once, in samples_ms
    print(figures.line(fig) + f"  max {samples[-1]:.2f} ms", flush=True)
    return {
        "median_ms": fig["value"],
        "max_ms": round(samples[-1], 2),
        "samples_ms": samples_ms,
        "figures": [fig],
    }


def bench_throughput(quick: bool = False) -> dict[str, Any]:
    """No-op jobs, 2 children, all submitted at once; peers measured in the same run.

    The peers' processes call setsid, as sandboxq's children do, so that on a busy
    machine with autogroup scheduling each gets the same share of the CPU.
    """
    from bench_jobs import noop

    from sandboxq import Pool

    n, runs = (5000, 2) if quick else (20000, 5)
    results: dict[str, list[float]] = {"sandboxq": [], "ProcessPoolExecutor": []}
    with Pool("bench_jobs:noop", size=2) as pool:
        figures.submit_rate(pool.submit, 2000)
        for _ in range(runs):
            results["sandboxq"].append(figures.submit_rate(pool.submit, n))
    with ProcessPoolExecutor(2, initializer=os.setsid) as ppe:
        figures.submit_rate(lambda i: ppe.submit(noop, i), 2000)
        for _ in range(runs):
            results["ProcessPoolExecutor"].append(
                figures.submit_rate(lambda i: ppe.submit(noop, i), n)
            )
    try:
        import pebble

        results["pebble"] = []
        with pebble.ProcessPool(max_workers=2, initializer=os.setsid) as pp:
            figures.submit_rate(lambda i: pp.schedule(noop, args=(i,)), 2000)
            for _ in range(runs):
                results["pebble"].append(
                    figures.submit_rate(lambda i: pp.schedule(noop, args=(i,)), n)
                )
    except ImportError:
        pass
    out: dict[str, Any] = {"jobs": n, "figures": []}
    for name, rates in results.items():
        target = figures.POOL_NOOP if name == "sandboxq" else None
        fig = figures.figure(f"pool no-op throughput, {name}", rates, "jobs/s", target, digits=0)
        out[name] = {"median_jobs_s": fig["value"], "runs": fig["runs"]}
        out["figures"].append(fig)
        print(figures.line(fig), flush=True)
    return out


SECTIONS = {"kill": bench_kill, "replace": bench_replace, "throughput": bench_throughput}


def main() -> None:
    figures.run_sections(__file__, figures.quick_only(SECTIONS), HERE / "results" / "pool.json")


if __name__ == "__main__":
    main()
