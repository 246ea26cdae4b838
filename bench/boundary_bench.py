"""Attempt-boundary benchmarks: what containment costs and how fast it acts.

    python bench/boundary_bench.py [burst_kill|leftovers|forkserver|cpu_tax|throughput|all]
                                   [--json OUT] [--quick] [--base COMMIT]

- burst_kill: hard-kill overshoot of an attempt that forked 200 sleeping processes
  (median, max), every one of them checked dead when the outcome is reported;
- leftovers: from a handler's normal return (it left 200 processes) until its outcome is
  reported with all of them gone;
- forkserver: the fork server SIGKILLed under a running attempt (processor imports
  numpy): until the interrupted attempt's outcome, and until the pool has run the next job;
- cpu_tax: the CPU time of one 50 ms pure-Python loop in a pool child (with and without a
  fence deadline, as the worker runs it) and in a bare process, side by side;
- throughput: no-op pool jobs/s, this checkout against ``--base`` (default: the commit
  before the boundary work), alternated run by run in fresh processes.

Figures print beside their targets; JSON goes to bench/results/boundary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from sandboxq.testing.processes import still_running

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import figures  # noqa: E402

H = "sandboxq.testing.handlers:"
LOOP_N = 0  # calibrated once per process: iterations of the loop that take ~50 ms


def _fig(name: str, values: list[float], unit: str, target: float | None = None) -> Any:
    goal = figures.Target("<=", target, unit) if target is not None else None
    fig = figures.figure(name, values, unit, goal, digits=1)
    print(figures.line(fig), flush=True)
    return fig


def bench_burst_kill(quick: bool = False) -> dict[str, Any]:
    from sandboxq import Pool

    hard_s, runs = 1.0, 3 if quick else 7
    overshoot_ms, left_total = [], 0
    with Pool(H + "fork_burst", size=1) as pool, tempfile.TemporaryDirectory() as tmp:
        for i in range(runs):
            pid_file = Path(tmp) / f"pids{i}"
            done: Future[Any] = Future()
            task = pool.make_task(str(pid_file), 200, "hang")
            task.hard_timeout_s = hard_s
            pool.execute(
                task, lambda r, d=done, f=pid_file: d.set_result((r, still_running(_pids(f))))
            )
            result, left = done.result(timeout=60)
            assert str(result.outcome) == "hard_timeout", result.cause
            overshoot_ms.append((result.runtime_s - hard_s) * 1000)
            left_total += len(left)
    return {
        "figures": [
            _fig("hard-kill overshoot, 200-process burst, median", overshoot_ms, "ms", 10),
            _fig("hard-kill overshoot, 200-process burst, max", [max(overshoot_ms)], "ms", 30),
        ],
        "left_running": left_total,
    }


def _pids(pid_file: Path) -> list[int]:
    return [int(p) for p in pid_file.read_text().split()] if pid_file.exists() else []


def bench_leftovers(quick: bool = False) -> dict[str, Any]:
    import pickle

    from sandboxq import Pool

    runs = 3 if quick else 7
    gone_ms, left_total = [], 0
    with Pool(H + "call", size=1) as pool, tempfile.TemporaryDirectory() as tmp:
        for i in range(runs):
            pid_file = Path(tmp) / f"pids{i}"
            done: Future[Any] = Future()
            task = pool.make_task("burst_then_clock", str(pid_file), 200)
            pool.execute(
                task,
                lambda r, d=done, f=pid_file: d.set_result(
                    (r, time.time(), still_running(_pids(f)))
                ),
            )
            result, reported, left = done.result(timeout=60)
            returned = pickle.loads(result.result)
            gone_ms.append((reported - returned) * 1000)
            left_total += len(left)
    return {
        "figures": [_fig("normal return → 200 leftovers gone, median", gone_ms, "ms")],
        "left_running": left_total,
    }


NUMPY_MODULE = textwrap.dedent(
    """
    import numpy  # noqa: F401  (the fork server preloads it: a heavy restart)
    from sandboxq.testing.handlers import call
    """
)


def bench_forkserver(quick: bool = False) -> dict[str, Any]:
    from sandboxq import Pool
    from sandboxq.pool import server

    runs = 2 if quick else 5
    interrupted_ms, next_job_ms = [], []
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "np_call.py").write_text(NUMPY_MODULE)
        sys.path.insert(0, tmp)
        with Pool("np_call:call", size=2) as pool:
            for i in range(runs):
                marker = Path(tmp) / f"m{i}"
                running: Future[Any] = Future()
                pool.execute(pool.make_task("mark_then_hang", str(marker)), running.set_result)
                while not marker.exists():
                    time.sleep(0.002)
                dead = server.pid()
                assert dead is not None
                t0 = time.perf_counter()
                os.kill(dead, signal.SIGKILL)
                result = running.result(timeout=30)
                interrupted_ms.append((time.perf_counter() - t0) * 1000)
                assert str(result.outcome) == "interrupted", result.cause
                assert pool.submit("echo", i).result(timeout=30) == i
                next_job_ms.append((time.perf_counter() - t0) * 1000)
                while pool._supervisor._spawner._watch is not None and len(pool.pids) < pool.size:
                    time.sleep(0.01)
                # Spaced out so the pool never sees three deaths a minute (it would break).
                pool._supervisor._spawner._watch._deaths.clear()  # type: ignore[union-attr]
    return {
        "figures": [
            _fig("fork server SIGKILL → attempt interrupted, median", interrupted_ms, "ms", 100),
            _fig("fork server SIGKILL → next job done (numpy), median", next_job_ms, "ms", 1000),
        ]
    }


def _calibrate() -> int:
    n = 100_000
    while True:
        t0 = time.process_time()
        _loop(n)
        took = time.process_time() - t0
        if took > 0.02:
            return int(n * 0.05 / took)
        n *= 2


def _loop(n: int) -> int:  # the same loop as handlers.cpu_loop
    total = 0
    for i in range(n):
        total += i * i % 7
    return total


BARE = textwrap.dedent(
    """
    import sys, time, json
    sys.path.insert(0, sys.argv[1])
    from sandboxq.testing.handlers import cpu_loop
    n, runs = int(sys.argv[2]), int(sys.argv[3])
    print(json.dumps([cpu_loop(n) for _ in range(runs)]))
    """
)


def bench_cpu_tax(quick: bool = False) -> dict[str, Any]:
    import pickle

    from sandboxq import Pool

    n = _calibrate()
    runs = 10 if quick else 30
    bare: list[float] = []
    pooled: list[float] = []
    fenced: list[float] = []
    with Pool(H + "cpu_loop", size=1) as pool:
        for _ in range(3 if quick else 5):  # interleaved rounds: the same machine state
            out = subprocess.run(
                [sys.executable, "-c", BARE, str(ROOT), str(n), str(runs // 5 or 1)],
                capture_output=True,
                check=True,
            )
            bare += json.loads(out.stdout)
            for _ in range(runs // 5 or 1):
                pooled.append(pool.submit(n).result(timeout=30))
                done: Future[Any] = Future()
                task = pool.make_task(n)
                task.fence_deadline = time.monotonic() + 30  # as a worker holding a lease
                pool.execute(task, done.set_result)
                fenced.append(pickle.loads(done.result(timeout=30).result))
    b, p, f = (statistics.median(x) * 1000 for x in (bare, pooled, fenced))
    print(f"loop iterations: {n}", flush=True)
    return {
        "figures": [
            _fig("50 ms loop CPU, bare process, median", [x * 1000 for x in bare], "ms"),
            _fig("50 ms loop CPU, pool child, median", [x * 1000 for x in pooled], "ms"),
            _fig(
                "50 ms loop CPU, pool child with a fence, median", [x * 1000 for x in fenced], "ms"
            ),
            _fig("CPU tax in a pool child vs bare", [(p / b - 1) * 100], "%", 1),
            _fig("CPU tax with a fence vs bare", [(f / b - 1) * 100], "%", 1),
        ]
    }


THROUGHPUT = textwrap.dedent(
    """
    import sys, time, json
    sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[2])
    from concurrent.futures import wait
    from sandboxq import Pool
    n = int(sys.argv[3])
    with Pool("bench_jobs:noop", size=2) as pool:
        wait([pool.submit(i) for i in range(2000)])
        t0 = time.perf_counter()
        futures = [pool.submit(i) for i in range(n)]
        wait(futures)
        print(json.dumps(n / (time.perf_counter() - t0)))
    """
)


def bench_throughput(quick: bool = False, base: str = "3702bf3") -> dict[str, Any]:
    n, rounds = (5000, 2) if quick else (20000, 5)
    rates: dict[str, list[float]] = {"base": [], "this": []}
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", base, "sandboxq"], capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        for _ in range(rounds):
            for name, root in (("base", tmp), ("this", str(ROOT))):
                out = subprocess.run(
                    [sys.executable, "-c", THROUGHPUT, root, str(HERE), str(n)],
                    capture_output=True,
                    check=True,
                    cwd="/",
                )
                rates[name].append(json.loads(out.stdout))
    b, t = statistics.median(rates["base"]), statistics.median(rates["this"])
    return {
        "figures": [
            _fig(f"pool no-op throughput, base {base}", rates["base"], "jobs/s"),
            _fig("pool no-op throughput, this checkout", rates["this"], "jobs/s"),
            _fig("throughput change", [(t / b - 1) * 100], "%"),
        ]
    }


SECTIONS = {
    "burst_kill": bench_burst_kill,
    "leftovers": bench_leftovers,
    "forkserver": bench_forkserver,
    "cpu_tax": bench_cpu_tax,
    "throughput": bench_throughput,
}


def main() -> None:
    def base(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--base", default="3702bf3", help="commit to compare throughput with")

    def call(name: str) -> figures.Section:
        fn = SECTIONS[name]
        if name == "throughput":
            return lambda args: fn(args.quick, args.base)
        return lambda args: fn(args.quick)

    figures.run_sections(
        __file__, {name: call(name) for name in SECTIONS}, HERE / "results" / "boundary.json", base
    )


if __name__ == "__main__":
    main()
