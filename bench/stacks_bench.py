"""Where an attempt was, and what it wrote: what the stack capture (stacks.py) costs the
hard kill, and what keeping each attempt's output (output.py) costs a job.

    python bench/stacks_bench.py [kill|output|all] [--json OUT] [--quick] [--base COMMIT]
                                 [--containment auto|cgroup|process_tree]

kill  hard-kill overshoot (reaped and outcome recorded, after the deadline) for every hung
      handler of the catalogue (sandboxq/testing/handlers.py, as bench/pool_bench.py) and
      a 200-process fork burst, with the capture (this checkout) and without it (``--base``,
      default: the commit before the capture), alternated run by run in fresh processes.
      Also counted: how many kills came back with a stack that names a frame.
output no-op jobs/s of a pool of 2 children with ``capture_output`` on and off, back to
      back in fresh processes, alternated; and the base commit's, for the whole change.

Figures print beside their targets; JSON goes to bench/results/stacks.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import figures  # noqa: E402
from pool_bench import KILL_HANDLERS, RECORDS_PIDS  # noqa: E402

#: The commit before the stack capture: the hard kill as it was.
BASE = "505e9c7"
HARD_S = 0.25
BURST_HARD_S = 1.0  # as bench/boundary_bench.py's burst_kill: one child, 1 s
BURST = "fork_burst"

#: One handler's kills, in a fresh process on the checkout at argv[1]; prints
#: [[overshoot_ms, stack named a frame], ...].
KILLS = textwrap.dedent(
    """
    import json, sys, tempfile
    sys.path.insert(0, sys.argv[1])
    from concurrent.futures import Future
    from sandboxq import Pool
    handler, kills, hard_s, records = sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
    containment = sys.argv[6]
    size = 1 if handler == "fork_burst" else 2
    out = []
    with tempfile.TemporaryDirectory() as tmp, Pool(
        "sandboxq.testing.handlers:" + handler, size=size, hard_timeout_s=hard_s,
        containment=containment,
    ) as pool:
        for i in range(kills // size):
            done = [Future() for _ in range(size)]
            for n, f in enumerate(done):
                pid_file = f"{tmp}/{i}-{n}"
                args = (pid_file, 200, "hang") if handler == "fork_burst" else (
                    (pid_file,) if records == "1" else ())
                pool.execute(pool.make_task(*args), f.set_result)
            for f in done:
                r = f.result(timeout=60)
                assert str(r.outcome) == "hard_timeout", r.cause
                stack = getattr(r, "traceback", None)
                out.append([(r.runtime_s - hard_s) * 1000, bool(stack and 'File "' in stack)])
    print(json.dumps(out))
    """
)


TRIES = 5


def _script(what: str, script: str, *argv: str) -> Any:
    """Run ``script`` in a fresh process; its stdout's JSON. Tried again (``TRIES`` times)
    when its pool broke at its start: on a machine shared with other pools' tests, a
    child's control group was seen removed under it as it started."""
    for attempt in range(TRIES):
        out = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, cwd="/")
        if out.returncode == 0:
            return json.loads(out.stdout)
        error = out.stderr.decode(errors="replace")
        if "pool is broken" not in error or attempt == TRIES - 1:
            raise RuntimeError(f"{what} failed:\n{error[-3000:]}")
        print(f"  ({what}: the pool broke at its start; run again)", flush=True)
    raise AssertionError("unreachable")


def _kills(root: str, handler: str, kills: int, containment: str) -> list[list[Any]]:
    hard_s = BURST_HARD_S if handler == BURST else HARD_S
    records = "1" if handler in RECORDS_PIDS else "0"
    result: list[list[Any]] = _script(
        handler, KILLS, root, handler, str(kills), str(hard_s), records, containment
    )
    return result


def bench_kill(quick: bool = False, base: str = BASE, containment: str = "auto") -> dict[str, Any]:
    kills, rounds = (4, 1) if quick else (12, 2)
    out: dict[str, Any] = {"base": base, "containment": containment, "handlers": {}}
    out["figures"] = []
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", base, "sandboxq"], capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        every: dict[tuple[str, str], list[float]] = {}
        for handler in [*KILL_HANDLERS, BURST]:
            group = "200-process burst" if handler == BURST else "hung-handler catalogue"
            ms: dict[str, list[float]] = {"off": [], "on": []}
            named = 0
            for _ in range(rounds):
                for name, root in (("off", tmp), ("on", str(ROOT))):
                    for overshoot, has_stack in _kills(root, handler, kills, containment):
                        ms[name].append(overshoot)
                        named += name == "on" and has_stack
            row: dict[str, Any] = {}
            for name in ("off", "on"):
                values = sorted(ms[name])
                every.setdefault((group, name), []).extend(values)
                row[name] = {
                    "median_ms": round(statistics.median(values), 2),
                    "max_ms": round(values[-1], 2),
                    "samples_ms": [round(v, 2) for v in values],
                }
            row["stacks_named_a_frame"] = f"{named}/{len(ms['on'])}"
            out["handlers"][handler] = row
            print(
                f"  {handler:24} capture off: median {row['off']['median_ms']:6.2f} max "
                f"{row['off']['max_ms']:6.2f} ms   on: median {row['on']['median_ms']:6.2f} max "
                f"{row['on']['max_ms']:6.2f} ms   stacks {row['stacks_named_a_frame']}",
                flush=True,
            )
        for (group, name), values in every.items():
            values.sort()
            label = f"{group}, capture {name}"
            for fig in (
                figures.figure(
                    f"hard-kill overshoot {label}, median", values, "ms", figures.KILL_MEDIAN
                ),
                figures.figure(
                    f"hard-kill overshoot {label}, max", [values[-1]], "ms", figures.KILL_MAX
                ),
            ):
                fig["runs"] = []  # the samples are kept once, per handler
                out["figures"].append(fig)
                print(figures.line(fig), flush=True)
    return out


#: No-op jobs through a pool of 2 on the checkout at argv[1]; prints jobs/s.
THROUGHPUT = textwrap.dedent(
    """
    import sys, time, json
    sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[2])
    from concurrent.futures import wait
    from sandboxq import Pool
    n, options = int(sys.argv[3]), json.loads(sys.argv[4])
    with Pool("bench_jobs:noop", size=2, **options) as pool:
        wait([pool.submit(i) for i in range(2000)])
        t0 = time.perf_counter()
        futures = [pool.submit(i) for i in range(n)]
        wait(futures)
        print(json.dumps(n / (time.perf_counter() - t0)))
    """
)


def bench_output(quick: bool = False, base: str = BASE) -> dict[str, Any]:
    n, rounds = (5000, 2) if quick else (20000, 5)
    runs = {
        "capture on": (str(ROOT), {"capture_output": True}),
        "capture off": (str(ROOT), {"capture_output": False}),
        f"base {base}": ("", {}),
    }
    rates: dict[str, list[float]] = {name: [] for name in runs}
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", base, "sandboxq"], capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        for _ in range(rounds):
            for name, (root, options) in runs.items():
                argv = [root or tmp, str(HERE), str(n), json.dumps(options)]
                rates[name].append(_script(name, THROUGHPUT, *argv))
    out_figures = []
    for name, values in rates.items():
        fig = figures.figure(f"pool no-op throughput, {name}", values, "jobs/s", digits=0)
        print(figures.line(fig), flush=True)
        out_figures.append(fig)
    on, off = (statistics.median(rates[k]) for k in ("capture on", "capture off"))
    change = figures.figure("throughput, capture on vs off", [(on / off - 1) * 100], "%")
    print(figures.line(change), flush=True)
    costs = [
        figures.figure(name, runs, "µs", digits=2) for name, runs in _per_job_costs_us().items()
    ]
    for fig in costs:
        print(figures.line(fig), flush=True)
    return {"jobs": n, "figures": [*out_figures, change, *costs]}


def _per_job_costs_us(calls: int = 20_000, rounds: int = 5) -> dict[str, list[float]]:
    """What capture adds to one job, timed alone (a loaded machine blurs the jobs/s):
    the supervisor's take() of an attempt that wrote nothing, and clear() before an idle
    child's task; the child's flush of its stdio at the attempt's end."""
    import time

    from sandboxq.pool.output import ChildOutput, Relay, flush_stdio

    relay = Relay()
    out = ChildOutput(relay)
    relay.add(out)
    found: dict[str, list[float]] = {
        "supervisor: take() of a silent attempt": [],
        "supervisor: clear() before an idle child's task": [],
        "child: flush of stdout and stderr": [],
    }
    for _ in range(rounds):
        for name, call in zip(found, (out.take, out.clear, flush_stdio), strict=True):
            t0 = time.perf_counter()
            for _ in range(calls):
                call()
            found[name].append((time.perf_counter() - t0) / calls * 1e6)
    out.launched()
    out.close()
    relay.close()
    return found


def main() -> None:
    def add_base(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--base", default=BASE, help="commit without the capture")
        parser.add_argument(
            "--containment",
            default="auto",
            choices=("auto", "cgroup", "process_tree"),
            help="the pools' containment in the kill section",
        )

    figures.run_sections(
        __file__,
        {
            "kill": lambda args: bench_kill(args.quick, args.base, args.containment),
            "output": lambda args: bench_output(args.quick, args.base),
        },
        HERE / "results" / "stacks.json",
        add_base,
    )


if __name__ == "__main__":
    main()
