"""Every benchmark, several runs each, into one JSON and one Markdown report.

    python bench/run_all.py [--quick] [--only pool,queue,...,containment] [--out DIR]
    make bench                    (the same, full)

Starts one redis-server (``RedisServer``) on a free port, runs each bench script in a
process of its own (pool_bench runs each of its sections in a fresh process again: the
fork server and its preloaded imports must not carry over), then gathers their JSON
into DIR/latest.json and renders DIR/report.md with its plots (report.py). Each figure
is printed beside its target as it is measured, and again in the summary at the end.

A section that crashes is recorded as such and the others still run; the exit status
is then 1. A missed target is a finding, not a failure: the exit status stays 0.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import figures  # noqa: E402
import report  # noqa: E402

from sandboxq.testing.redis_server import RedisServer  # noqa: E402

#: Runs of each queue figure: the full run, and --quick.
QUEUE_RUNS = {False: 3, True: 1}
SECTIONS = (
    "pool",
    "queue",
    "heartbeat",
    "metrics",
    "tracing",
    "aio",
    "floors",
    "containment",
    "exporter",
    "dashboard_queues",
    "waiters",
    "run_cost",
    "redis_cost",
    "batch",
)


def _command(section: str, json_path: Path, url: str, quick: bool) -> list[str]:
    runs = str(QUEUE_RUNS[quick])
    script = {
        "pool": ["pool_bench.py", "all"],
        "queue": ["queue_bench.py", "--url", url, "--runs", runs],
        "heartbeat": ["heartbeat_bench.py", "--url", url],
        "metrics": ["metrics_bench.py", "--url", url, "--runs", runs],
        "tracing": ["tracing_bench.py", "--url", url, "--runs", runs],
        "aio": ["aio_bench.py", "--url", url, "--runs", runs],
        "floors": ["floors_bench.py", "--url", url, "--runs", runs],
        "containment": ["containment_bench.py", "all"],
        "exporter": ["exporter_bench.py"],  # a redis-server of its own
        "dashboard_queues": ["dashboard_queues_bench.py"],  # its own server and Cluster
        "waiters": ["waiters_bench.py", "--url", url],
        "run_cost": ["run_cost_bench.py", "--runs", runs],  # no Redis: the local mode
        "redis_cost": ["redis_cost_bench.py", "--url", url, "--runs", runs],  # FLUSHALLs
        "batch": ["batch_bench.py", "--url", url, "--runs", runs],  # FLUSHALLs: runs last
    }[section]
    quick_flag = ["--quick"] if quick else []
    return [
        sys.executable,
        str(HERE / script[0]),
        *script[1:],
        "--json",
        str(json_path),
        *quick_flag,
    ]


def cpu_speed_ms() -> float:
    """Milliseconds of CPU for a fixed pure-Python loop (best of 5): on a shared or virtual
    machine the same code can run much slower from one hour to the next, and every figure
    here moves with it, so the report records how fast the CPU was."""
    times = []
    for _ in range(5):
        t0 = time.process_time()
        total = 0
        for i in range(1_000_000):
            total += i
        times.append(time.process_time() - t0)
    return round(min(times) * 1000, 1)


def _meta(quick: bool) -> dict[str, Any]:
    def run(*cmd: str) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, cwd=HERE).stdout.strip()
        except OSError:
            return "unknown"

    commit = run("git", "rev-parse", "--short", "HEAD")
    if run("git", "status", "--porcelain", "--untracked-files=no"):
        commit += " (with uncommitted changes)"
    return {
        "started": datetime.now().astimezone().isoformat(timespec="seconds"),
        "quick": quick,
        "commit": commit,
        "python": platform.python_version(),
        "redis": run("redis-server", "--version").split(" v=")[-1].split(" ")[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "load_before": [round(x, 2) for x in os.getloadavg()],
        "cpu_speed_ms_before": cpu_speed_ms(),
    }


def run_sections(names: list[str], out_dir: Path, quick: bool) -> dict[str, Any]:
    data: dict[str, Any] = {"meta": _meta(quick)}
    t0 = time.monotonic()
    durations = {}
    with RedisServer() as server:
        for name in names:
            print(f"== {name}", flush=True)
            path = out_dir / f"{name}.json"
            path.unlink(missing_ok=True)
            started = time.monotonic()
            proc = subprocess.run(_command(name, path, server.url, quick))
            durations[name] = round(time.monotonic() - started, 1)
            if proc.returncode == 0 and path.exists():
                data[name] = json.loads(path.read_text())
            else:
                data[name] = {"error": f"exit status {proc.returncode}"}
            print(f"== {name} took {durations[name]:.0f} s", flush=True)
    data["meta"].update(
        duration_s=round(time.monotonic() - t0, 1),
        section_durations_s=durations,
        load_after=[round(x, 2) for x in os.getloadavg()],
        cpu_speed_ms_after=cpu_speed_ms(),
    )
    return data


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer runs and samples")
    parser.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n]
    unknown = set(names) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown section(s) {sorted(unknown)}; choose from {SECTIONS}")
    args.out.mkdir(parents=True, exist_ok=True)
    data = run_sections(names, args.out, args.quick)
    latest = args.out / "latest.json"
    latest.write_text(json.dumps(data, indent=2))
    path = report.render(data, args.out)
    print(
        f"\n== summary ({'quick' if args.quick else 'full'} run, "
        f"{data['meta']['duration_s'] / 60:.1f} min, load average now "
        f"{data['meta']['load_after'][0]})"
    )
    for name in names:
        if "error" in data[name]:
            print(f"  {name}: did not finish ({data[name]['error']})")
        for fig in figures.collect(data[name]):
            print(figures.line(fig))
    print(f"\nwrote {latest} and {path}")
    return 1 if any("error" in data[n] for n in names) else 0


if __name__ == "__main__":
    sys.exit(main())
