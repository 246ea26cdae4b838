"""Figures and their targets: the one place the bench scripts and the report read them.

A *figure* is one measured number as the JSON carries it:

    {"name": "queue no-op throughput", "value": 5234.0, "unit": "jobs/s",
     "target": ">= 5,000 jobs/s", "met": true, "runs": [5101.2, 5234.0, 5410.9]}

``met`` is None when a figure has no target (it is shown for context). A figure that
misses its target is printed and reported as missing it; nothing here rounds it in.
"""

from __future__ import annotations

import argparse
import json
import math
import operator
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_OPS: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le,
    "<": operator.lt,
    ">=": operator.ge,
    "==": operator.eq,
}


@dataclass(frozen=True, slots=True)
class Target:
    op: str  # one of _OPS
    limit: float
    unit: str = ""

    def met(self, value: float) -> bool:
        return _OPS[self.op](value, self.limit)

    def __str__(self) -> str:
        return f"{self.op} {number(self.limit)} {self.unit}".rstrip()


# The targets of the project's speed goals. Targets that depend on a setting of the run
# (the lease) are built by the functions below them.
KILL_MEDIAN = Target("<=", 10, "ms")
KILL_MAX = Target("<=", 30, "ms")
LEFT_RUNNING = Target("==", 0, "processes")
REPLACE_MEDIAN = Target("<=", 50, "ms")
POOL_NOOP = Target(">=", 15_000, "jobs/s")
QUEUE_NOOP = Target(">=", 5_000, "jobs/s")
ENQUEUE_SINGLE = Target(">=", 10_000, "jobs/s")
ENQUEUE_BULK = Target(">=", 50_000, "jobs/s")
LATENCY_P50 = Target("<=", 1, "ms")
LATENCY_P95 = Target("<=", 2, "ms")
CPU_EFFICIENCY = Target(">=", 97, "%")
NO_STALLS = Target("==", 0, "jobs")

#: Slack allowed over the renewal interval for a heartbeat gap: the renew round trip
#: and the thread's wake-up on a loaded machine.
GAP_MARGIN_S = 0.05


def recovery_target(lease_s: float) -> Target:
    return Target("<=", lease_s + 1, "s")


def gap_target(lease_s: float) -> Target:
    return Target("<", round((lease_s / 3 + GAP_MARGIN_S) * 1000, 1), "ms")


def figure(
    name: str,
    runs: Sequence[float],
    unit: str,
    target: Target | None = None,
    *,
    digits: int = 2,
    note: str = "",
) -> dict[str, Any]:
    """The median of ``runs`` as a figure, judged against ``target``."""
    value = statistics.median(runs)
    out: dict[str, Any] = {
        "name": name,
        "value": round(value, digits),
        "unit": unit,
        "target": str(target) if target else None,
        "met": target.met(value) if target else None,
        "runs": [round(r, digits) for r in runs],
    }
    if note:
        out["note"] = note
    return out


def mark(met: bool | None) -> str:
    return {True: "ok", False: "MISSED", None: ""}[met]


def number(value: float) -> str:
    """1234.5 → '1,234.5'; small values keep their decimals."""
    if math.isfinite(value) and value == int(value):
        return f"{int(value):,}"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}" if abs(value) < 1 else f"{value:.2f}"


def line(fig: dict[str, Any]) -> str:
    """One terminal line: name, value, target and a mark where it is missed."""
    runs = fig.get("runs") or []
    spread = f"   runs: {', '.join(number(r) for r in runs)}" if len(runs) > 1 else ""
    target = f"[target {fig['target']}] {mark(fig['met'])}" if fig["target"] else ""
    return f"  {fig['name']:48} {number(fig['value']):>10} {fig['unit']:8} {target:30}{spread}"


def percentile(sorted_values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile of already sorted values."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(pct / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def collect(data: Any) -> list[dict[str, Any]]:
    """Every figure in a bench script's JSON, in order (sections nest their own)."""
    if not isinstance(data, dict):
        return []
    found = list(data.get("figures", []))
    for key, value in data.items():
        if key != "figures":
            found += collect(value)
    return found


def submit_rate(submit: Callable[[int], Future[Any]], n: int) -> float:
    """Jobs/s of ``n`` tasks handed to ``submit`` at once, until every result is in."""
    t0 = time.perf_counter()
    futures = [submit(i) for i in range(n)]
    wait(futures)
    for f in futures:
        f.result()
    return n / (time.perf_counter() - t0)


def write_json(path: str | Path, data: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=2))
    print(f"wrote {path}")


Section = Callable[[argparse.Namespace], dict[str, Any]]


def quick_only(sections: Mapping[str, Callable[[bool], dict[str, Any]]]) -> dict[str, Section]:
    """Sections whose only option is ``--quick``, in the form ``run_sections`` takes."""
    return {name: (lambda args, fn=fn: fn(args.quick)) for name, fn in sections.items()}


def run_sections(
    script: str,
    sections: Mapping[str, Section],
    json_path: Path,
    add_options: Callable[[argparse.ArgumentParser], None] | None = None,
) -> None:
    """A bench script's command line: ``[section|all] [--json F] [--quick]`` plus the
    script's own options. Each section runs in a fresh process of its own (no fork server,
    warm cache or leftover child carried from one section into the next), and the figures
    of all of them go into one JSON file."""
    parser = argparse.ArgumentParser()
    parser.add_argument("section", nargs="?", default="all", choices=[*sections, "all"])
    parser.add_argument("--json", default=str(json_path))
    parser.add_argument("--quick", action="store_true", help="fewer samples: a smoke check")
    parser.add_argument("--child", metavar="OUT", help=argparse.SUPPRESS)
    if add_options is not None:
        add_options(parser)
    args = parser.parse_args()
    if args.child:
        Path(args.child).write_text(json.dumps(sections[args.section](args)))
        return
    options = [a for a in sys.argv[1:] if a != args.section]
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="sandboxq-bench-") as tmp:
        for name in list(sections) if args.section == "all" else [args.section]:
            print(f"{name}:", flush=True)
            out = Path(tmp) / f"{name}.json"
            command = [sys.executable, script, name, *options, "--child", str(out)]
            subprocess.run(command, check=True)
            report[name] = json.loads(out.read_text())
    write_json(args.json, report)
