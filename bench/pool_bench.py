"""Pool benchmarks: hard-kill overshoot, replacement-child latency, no-op throughput.

    python bench/pool_bench.py [kill|replace|throughput|all] [--json OUT]

Each section runs in its own Python process (the fork server and its preloaded modules
are per process), prints its figures beside the targets, and the JSON goes to
bench/results/pool.json by default.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import Future, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

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
HARD_S = 0.25
KILLS = 24


def bench_kill() -> dict[str, Any]:
    """Hard deadline → child reaped and outcome recorded, per misbehaving handler."""
    import psutil

    from sandboxq import Pool
    from sandboxq.models import Outcome
    from sandboxq.pool.attempt import AttemptResult

    out: dict[str, Any] = {}
    for handler in KILL_HANDLERS:
        overshoots = []
        with Pool(f"sandboxq.testing.handlers:{handler}", size=2, hard_timeout_s=HARD_S) as pool:
            for _ in range(KILLS // 2):
                done: list[Future[AttemptResult]] = [Future(), Future()]
                for f in done:
                    pool.execute(pool.make_task(), f.set_result)
                for f in done:
                    r = f.result(timeout=30)
                    assert r.outcome is Outcome.HARD_TIMEOUT, r.cause
                    overshoots.append((r.runtime_s or 0) - HARD_S)
        leftovers = [
            p.pid
            for p in psutil.Process().children(recursive=True)
            if "forkserver" not in " ".join(p.cmdline())
            and "resource_tracker" not in " ".join(p.cmdline())
        ]
        ms = sorted(x * 1000 for x in overshoots)
        out[handler] = {
            "kills": len(ms),
            "median_ms": round(statistics.median(ms), 2),
            "max_ms": round(ms[-1], 2),
            "left_running": leftovers,
            "samples_ms": [round(x, 2) for x in ms],
        }
        print(
            f"  {handler:24} median {out[handler]['median_ms']:6.2f} ms  "
            f"max {out[handler]['max_ms']:6.2f} ms  left running: {len(leftovers)}"
        )
    return out


def bench_replace() -> dict[str, Any]:
    """Kill recorded → the next job has run on the replacement child (processor imports numpy)."""
    from sandboxq import Pool
    from sandboxq.pool.attempt import AttemptResult

    samples = []
    with Pool("bench_jobs:numpy_job", size=1, hard_timeout_s=0.1) as pool:
        pool.submit(0).result(timeout=30)
        for _ in range(25):
            killed: Future[AttemptResult] = Future()
            pool.execute(pool.make_task(10), killed.set_result)  # sleeps past the deadline
            killed.result(timeout=30)
            t0 = time.monotonic()
            pool.submit(0).result(timeout=30)
            samples.append((time.monotonic() - t0) * 1000)
    samples.sort()
    result = {
        "median_ms": round(statistics.median(samples), 2),
        "max_ms": round(samples[-1], 2),
        "samples_ms": [round(x, 2) for x in samples],
    }
    print(
        f"  replacement child ready (numpy preloaded): median {result['median_ms']} ms, "
        f"max {result['max_ms']} ms   [target <= 50 ms median]"
    )
    return result


def _rate(submit: Any, n: int) -> float:
    t0 = time.perf_counter()
    futures = [submit(i) for i in range(n)]
    wait(futures)
    for f in futures:
        f.result()
    return n / (time.perf_counter() - t0)


def bench_throughput(n: int = 20000, runs: int = 5) -> dict[str, Any]:
    """No-op jobs, 2 children, all submitted at once; peers measured in the same run."""
    from bench_jobs import noop

    from sandboxq import Pool

    results: dict[str, list[float]] = {"sandboxq": [], "ProcessPoolExecutor": []}
    with Pool("bench_jobs:noop", size=2) as pool:
        _rate(pool.submit, 2000)
        for _ in range(runs):
            results["sandboxq"].append(_rate(pool.submit, n))
    with ProcessPoolExecutor(2) as ppe:
        _rate(lambda i: ppe.submit(noop, i), 2000)
        for _ in range(runs):
            results["ProcessPoolExecutor"].append(_rate(lambda i: ppe.submit(noop, i), n))
    try:
        import pebble

        results["pebble"] = []
        with pebble.ProcessPool(max_workers=2) as pp:
            _rate(lambda i: pp.schedule(noop, args=(i,)), 2000)
            for _ in range(runs):
                results["pebble"].append(_rate(lambda i: pp.schedule(noop, args=(i,)), n))
    except ImportError:
        pass
    out = {}
    for name, rates in results.items():
        out[name] = {
            "median_jobs_s": round(statistics.median(rates)),
            "runs": [round(r) for r in rates],
        }
        print(
            f"  {name:20} {out[name]['median_jobs_s']:8d} jobs/s (median of {runs})"
            + ("   [target >= 15,000]" if name == "sandboxq" else "")
        )
    return out


SECTIONS = {"kill": bench_kill, "replace": bench_replace, "throughput": bench_throughput}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("section", nargs="?", default="all", choices=[*SECTIONS, "all"])
    parser.add_argument("--json", default=str(HERE / "results" / "pool.json"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(SECTIONS[args.section]()), file=sys.stderr)
        return
    sections = list(SECTIONS) if args.section == "all" else [args.section]
    report: dict[str, Any] = {}
    for name in sections:
        print(f"{name}:", flush=True)
        proc = subprocess.run(
            [sys.executable, __file__, name, "--child"],
            stderr=subprocess.PIPE,
            text=True,
            check=True,
        )
        report[name] = json.loads(proc.stderr.strip().splitlines()[-1])
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
