"""The kernel sandbox's figures: hard-kill overshoot per containment mode, and what the
protections against a root handler cost.

    python bench/sandbox_bench.py [kill|protections|namespace|drop|all] [--json OUT] [--quick]

- kill: hard-kill overshoot of an attempt that forked a burst of 200 processes, in each
  mode this machine has (control groups, forced process tree; each without and with a PID
  namespace per child): median and max, and how many of the burst could still run an
  instruction when the outcome was known.
- protections: no-op pool throughput, and a child's start (replacement) time, with the
  protections (read-only cgroup mounts, dropped capabilities, no_new_privs, group files
  handed to another uid) on and off, run by run back to back, so both see the same load.
  "Off" replaces ``privileges.plan`` in this bench's process with one that gives up
  nothing (no setting turns them off).
- namespace: the same two figures with ``pid_namespace`` on and off (process-tree mode,
  where no other protection is in force).
- drop: the same cost alone: a fork that gives the privileges up and exits, against a
  fork that only exits (pool figures move by tens of percent from run to run here).

Each section runs in its own Python process; the JSON goes to bench/results/sandbox.json.
The machine is shared: run it several times and read medians.
"""

from __future__ import annotations

import itertools
import statistics
import sys
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import containment_bench  # noqa: E402
import figures  # noqa: E402

from sandboxq.pool import privileges  # noqa: E402

_PLAN = privileges.plan

BURST = 200
HARD_S = 1.0


def _kill_overshoots(
    containment: str, kills: int, pid_namespace: bool
) -> tuple[str, list[float], int]:
    import psutil

    from sandboxq import Pool
    from sandboxq.models import Outcome
    from sandboxq.pool.attempt import AttemptResult

    overshoots, left = [], 0
    with Pool(
        "sandboxq.testing.handlers:fork_burst",
        size=1,
        hard_timeout_s=HARD_S,
        containment=containment,  # type: ignore[arg-type]
        pid_namespace=pid_namespace,
    ) as pool:
        mode = pool.containment
        if any("a PID namespace" in p for p in pool.protections):
            mode += ", PID namespace"
        for _ in range(kills):
            done: Future[AttemptResult] = Future()
            pool.execute(pool.make_task(None, BURST, "hang"), done.set_result)
            time.sleep(HARD_S * 0.8)
            burst = [p.pid for c in pool.pids for p in psutil.Process(c).children()]
            r = done.result(timeout=30)
            assert r.outcome is Outcome.HARD_TIMEOUT, r.cause
            overshoots.append(((r.runtime_s or 0) - HARD_S) * 1000)
            left += len(containment_bench._running(burst))
    return mode, overshoots, left


def bench_kill(quick: bool = False) -> dict[str, Any]:
    """Per mode, the deadline kill as it is, then (``before``) the kill that waits for
    every process to exit, alternated kill by kill batch so both see the same load."""
    kills = 4 if quick else 10
    out: dict[str, Any] = {"figures": []}
    for setting, namespace in itertools.product(("cgroup", "process_tree"), (False, True)):
        for swift in (True, False):
            _swift_kill(swift)
            try:
                mode, ms, left = _kill_overshoots(setting, kills, namespace)
            except Exception as exc:  # no control groups here: say so, measure the rest
                print(f"  {setting}: not measured ({exc})", flush=True)
                break
            ms.sort()
            label = mode if swift else f"{mode}, before (waits for exit)"
            targets = (figures.KILL_MEDIAN, figures.KILL_MAX) if swift else (None, None)
            figs = [
                figures.figure(f"kill overshoot, {BURST}-fork burst, {label}, median", ms,
                               "ms", targets[0]),
                figures.figure(f"kill overshoot, {BURST}-fork burst, {label}, max", [ms[-1]],
                               "ms", targets[1]),
                figures.figure(f"burst processes running at the outcome, {label}", [left],
                               "processes", figures.LEFT_RUNNING),
            ]  # fmt: skip
            for fig in figs:
                print(figures.line(fig), flush=True)
            out[label] = {"median_ms": round(statistics.median(ms), 2),
                          "max_ms": round(ms[-1], 2),
                          "samples_ms": [round(x, 2) for x in ms]}  # fmt: skip
            out["figures"] += figs
    _swift_kill(True)
    return out


def _protections(on: bool) -> None:
    from sandboxq.pool import privileges

    privileges.plan = (  # type: ignore[method-assign]
        _PLAN if on else (lambda *_a, **_k: (privileges.NO_CHANGE, None, ()))
    )


def _swift_kill(on: bool) -> None:
    """On: the deadline kill settles once nothing can run (teardown.py); off: the kill
    that waits for every process to exit, as before it."""
    from sandboxq.pool import deadlines, teardown

    deadlines.kill_at_deadline = (  # type: ignore[assignment]
        teardown.kill_at_deadline if on else (lambda child, o, d: child.kill(o, d))
    )


def _replacement_ms(pool: Any, n: int) -> float:
    """Per job through one child replaced after every job: a child's start, mostly."""
    t0 = time.perf_counter()
    for i in range(n):
        pool.submit(i).result(timeout=30)
    return (time.perf_counter() - t0) / n * 1000


def _on_and_off(what: str, pool_kwargs: Any, quick: bool) -> dict[str, Any]:
    """No-op throughput and a child's start with ``what`` on and off, run by run back to
    back; ``pool_kwargs(on)`` gives the pools' keywords (and may switch ``what`` itself)."""
    from sandboxq import Pool

    n, starts, runs = (3000, 20, 2) if quick else (10000, 60, 5)
    rates: dict[bool, list[float]] = {True: [], False: []}
    start_ms: dict[bool, list[float]] = {True: [], False: []}
    shown: tuple[str, ...] = ()
    for _ in range(runs):
        for on in (True, False):
            with Pool("bench_jobs:noop", size=2, **pool_kwargs(on)) as pool:
                shown = pool.protections if on else shown
                figures.submit_rate(pool.submit, 1000)
                rates[on].append(figures.submit_rate(pool.submit, n))
            with Pool("bench_jobs:noop", 1, max_jobs_per_child=1, **pool_kwargs(on)) as pool:
                pool.submit(0).result(timeout=30)
                start_ms[on].append(_replacement_ms(pool, starts))
    out: dict[str, Any] = {"protections": list(shown), "figures": []}
    for on in (True, False):
        word = "on" if on else "off"
        out["figures"] += [
            figures.figure(f"pool no-op throughput, {what} {word}", rates[on], "jobs/s",
                           digits=0),
            figures.figure(f"child replacement, {what} {word}", start_ms[on], "ms"),
        ]  # fmt: skip
    rate_on, rate_off = (statistics.median(rates[b]) for b in (True, False))
    start_on, start_off = (statistics.median(start_ms[b]) for b in (True, False))
    out["throughput_cost_pct"] = round(100 * (1 - rate_on / rate_off), 1)
    out["start_cost_pct"] = round(100 * (start_on / start_off - 1), 1)
    for fig in out["figures"]:
        print(figures.line(fig), flush=True)
    print(f"  protections in force: {', '.join(shown)}")
    print(
        f"  cost of the {what}: {out['throughput_cost_pct']} % throughput, "
        f"{out['start_cost_pct']} % child start (target within 5 %; a shared machine)"
    )
    return out


def bench_protections(quick: bool = False) -> dict[str, Any]:
    def cgroup_pool(on: bool) -> dict[str, Any]:
        _protections(on)
        return {"containment": "cgroup"}

    try:
        return _on_and_off("protections", cgroup_pool, quick)
    finally:
        _protections(True)


def bench_namespace(quick: bool = False) -> dict[str, Any]:
    """The PID namespace alone (its reaper's fork at a child's start, the reaper's check
    after each attempt), in the process-tree mode: no other protection is in force there."""
    return _on_and_off(
        "PID namespace",
        lambda on: {"containment": "process_tree", "pid_namespace": on},
        quick,
    )


def _forked_ms(given_up: Any) -> float:
    """Wall time of a fork that gives up ``given_up`` (privileges.drop) and exits."""
    import os

    from sandboxq.pool.privileges import drop

    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        try:
            drop(given_up)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    return (time.perf_counter() - t0) * 1000


def bench_drop(quick: bool = False) -> dict[str, Any]:
    """What giving the privileges up adds to a child's start, alone: a fork that drops them
    and exits, against one that only exits, alternated (the pool-level figures above are
    within the noise of a shared machine)."""
    from sandboxq.pool.privileges import NO_CHANGE

    given_up, _, shown = _PLAN(True)
    n = 50 if quick else 300
    on, off = [], []
    for _ in range(n):
        on.append(_forked_ms(given_up))
        off.append(_forked_ms(NO_CHANGE))
    cost_ms = statistics.median(on) - statistics.median(off)
    figs = [
        figures.figure("fork + drop the privileges + exit", on, "ms", digits=3),
        figures.figure("fork + exit", off, "ms", digits=3),
    ]
    for fig in figs:
        fig["runs"] = []
        print(figures.line(fig), flush=True)
    print(f"  dropping {', '.join(shown)}: {cost_ms:.3f} ms per child start")
    return {"protections": list(shown), "cost_ms": round(cost_ms, 3), "figures": figs}


SECTIONS = {
    "kill": bench_kill,
    "protections": bench_protections,
    "namespace": bench_namespace,
    "drop": bench_drop,
}


def main() -> None:
    figures.run_sections(__file__, figures.quick_only(SECTIONS), HERE / "results" / "sandbox.json")


if __name__ == "__main__":
    main()
