"""Containment benchmarks: what control groups cost, and how fast their kill lands.

    python bench/containment_bench.py [throughput|kill|all] [--json OUT] [--quick]

- throughput: no-op jobs through a 2-child pool with containment ``auto`` (a control
  group per child where the machine allows it) and ``process_tree``, alternated run by
  run so that both see the same machine load.
- kill: hard-kill overshoot of an attempt that forked a burst of 200 processes (the
  group is frozen, every process SIGKILLed, the group thawed), and what is left running.

Each section runs in its own Python process; the JSON goes to bench/results/containment.json.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import figures  # noqa: E402

BURST = 200
HARD_S = 2.0


def _cpu_s(pids: list[int]) -> float:
    """CPU time (user + system) used so far by ``pids``."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / ticks


def bench_throughput(quick: bool = False) -> dict[str, Any]:
    """No-op jobs per second, and CPU time per job (the parent's and the children's): the
    CPU figure is what containment costs, and unlike the rate it barely moves with the
    load of a shared machine."""
    from sandboxq import Pool

    n, runs = (5000, 2) if quick else (20000, 5)
    rates: dict[str, list[float]] = {}
    cpu_us: dict[str, list[float]] = {}
    modes: dict[str, str] = {}
    for _ in range(runs):
        for setting in ("auto", "process_tree"):
            with Pool("bench_jobs:noop", size=2, containment=setting) as pool:  # type: ignore[arg-type]
                figures.submit_rate(pool.submit, 2000)
                modes[setting] = pool.containment
                children, parent0 = pool.pids, time.process_time()
                children0 = _cpu_s(children)
                rates.setdefault(setting, []).append(figures.submit_rate(pool.submit, n))
                used = time.process_time() - parent0 + _cpu_s(children) - children0
                cpu_us.setdefault(setting, []).append(used / n * 1e6)
    out: dict[str, Any] = {"jobs": n, "modes": modes, "figures": []}
    for setting, values in rates.items():
        name = f"pool no-op throughput, containment {modes[setting]}"
        fig = figures.figure(name, values, "jobs/s", figures.POOL_NOOP, digits=0)
        cpu = figures.figure(f"CPU per no-op job, containment {modes[setting]}",
                             cpu_us[setting], "us", digits=1)  # fmt: skip
        out[setting] = {"median_jobs_s": fig["value"], "runs": fig["runs"],
                        "cpu_us_per_job": cpu["value"]}  # fmt: skip
        out["figures"] += [fig, cpu]
        print(figures.line(fig), flush=True)
        print(figures.line(cpu), flush=True)
    for key, a, b in (
        ("rate_cost_pct", out["process_tree"]["median_jobs_s"], out["auto"]["median_jobs_s"]),
        ("cpu_cost_pct", out["auto"]["cpu_us_per_job"], out["process_tree"]["cpu_us_per_job"]),
    ):
        out[key] = round(100 * (a / b - 1), 1)
    print(
        f"  cost of containment {modes['auto']}: {out['rate_cost_pct']} % throughput, "
        f"{out['cpu_cost_pct']} % CPU per job (the rate is noisy on a shared machine)"
    )
    return out


#: /proc/<pid>/stat flags: the task is exiting.
PF_EXITING = 0x4


def _running(pids: list[int]) -> list[int]:
    """Those of ``pids`` that can still run an instruction of their own: not a zombie, not
    exiting, and no SIGKILL pending (a killed task tears itself down in the kernel, which
    can take a while behind hundreds of others, but runs no more user code)."""
    left = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            with open(f"/proc/{pid}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue  # gone
        pending = int(status["SigPnd"], 16) | int(status["ShdPnd"], 16)
        if fields[0] == b"Z" or int(fields[6]) & PF_EXITING or pending & (1 << 8):
            continue  # a zombie, exiting, or SIGKILL (signal 9: bit 8) pending
        left.append(pid)
    return left


def bench_kill(quick: bool = False) -> dict[str, Any]:
    import psutil

    from sandboxq import Pool
    from sandboxq.models import Outcome
    from sandboxq.pool.attempt import AttemptResult

    kills = 4 if quick else 12
    overshoots, left = [], 0
    with Pool("sandboxq.testing.handlers:fork_burst", size=1, hard_timeout_s=HARD_S) as pool:
        mode = pool.containment
        for _ in range(kills):
            done: Future[AttemptResult] = Future()
            pool.execute(pool.make_task(None, BURST, "hang"), done.set_result)
            # The burst's processes, seen while they run (they are the child's children).
            time.sleep(HARD_S * 0.8)
            burst = [p.pid for c in pool.pids for p in psutil.Process(c).children()]
            r = done.result(timeout=30)
            assert r.outcome is Outcome.HARD_TIMEOUT, r.cause
            overshoots.append(((r.runtime_s or 0) - HARD_S) * 1000)
            left += len(_running(burst))  # at the moment the outcome is known: none may run
    ms = sorted(overshoots)
    figs = [
        figures.figure(f"kill overshoot, {BURST}-fork burst, {mode}, median", ms, "ms",
                       figures.KILL_MEDIAN),
        figures.figure(f"kill overshoot, {BURST}-fork burst, {mode}, max", [ms[-1]], "ms",
                       figures.KILL_MAX),
        figures.figure("burst processes running when the outcome was known", [left],
                       "processes", figures.LEFT_RUNNING),
    ]  # fmt: skip
    figs[0]["runs"] = []
    for fig in figs:
        print(figures.line(fig), flush=True)
    return {
        "mode": mode,
        "median_ms": round(statistics.median(ms), 2),
        "max_ms": round(ms[-1], 2),
        "samples_ms": [round(x, 2) for x in ms],
        "figures": figs,
    }


SECTIONS = {"throughput": bench_throughput, "kill": bench_kill}


def main() -> None:
    figures.run_sections(
        __file__, figures.quick_only(SECTIONS), HERE / "results" / "containment.json"
    )


if __name__ == "__main__":
    main()
