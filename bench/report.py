"""The Markdown speed report and its plots, rendered from run_all's JSON.

    python bench/report.py [bench/results/latest.json]

Writes ``report.md`` and three PNGs beside the JSON: the kill overshoot per misbehaving
handler, the heartbeat's renewal gaps over time under GIL-holding load, and queue
throughput against the number of children. Re-rendering needs no new measurement.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import figures

SECTION_TITLES = {
    "pool": "Pool (no backend)",
    "queue": "Queue (Redis, worker process, 2 children unless said)",
    "heartbeat": "Heartbeat under GIL-holding load",
    "metrics": "Worker metrics: no-op throughput with and without (side by side)",
    "aio": "Async producer (sandboxq.aio) against the sync one",
    "floors": "Round trips beside their floors: enqueue vs PING, asyncio vs sync, idle latency",
    "containment": "Containment (control group per child against the process-tree mode)",
    "waiters": "Any number of waiters: result() of 10,000 coroutines and 500 threads",
    "batch": "Batches (Redis): enqueue, progress(), as_completed, memory, sandboxq run --url",
    "redis_cost": "Redis CPU per job from the server's counters, beside BullMQ; lease renewal",
    "run_cost": "sandboxq run on CPU-bound jobs beside multiprocessing.Pool and pebble",
    "tracing": "OpenTelemetry tracing: no-op throughput off, on, and sampling none (back to back)",
}


def _verdict(met: bool | None) -> str:
    return {True: "met", False: "**MISSED**", None: ""}[met]


def _table(figs: list[dict[str, Any]]) -> list[str]:
    rows = ["| figure | value | target | | runs |", "|---|---:|---|---|---|"]
    for f in figs:
        runs = f.get("runs") or []
        shown = ", ".join(figures.number(r) for r in runs) if len(runs) > 1 else ""
        rows.append(
            f"| {f['name'].strip()} | {figures.number(f['value'])} {f['unit']} "
            f"| {f['target'] or ''} | {_verdict(f['met'])} | {shown} |"
        )
    return rows


def _kill_table(kill: dict[str, Any]) -> list[str]:
    """One row per handler: the three kill figures side by side."""
    by_name = {f["name"]: f for f in kill["figures"]}
    rows = [
        f"Hard deadline {kill['hard_timeout_s']:g} s → child reaped and outcome recorded "
        f"(target: median {figures.KILL_MEDIAN}, max {figures.KILL_MAX}, nothing left running).",
        "",
        "| handler | kills | median | max | left running |",
        "|---|---:|---:|---:|---:|",
    ]
    for handler, h in kill["handlers"].items():
        cells = [
            by_name[f"kill overshoot {handler}, median"],
            by_name[f"kill overshoot {handler}, max"],
            by_name[f"left running after {handler}"],
        ]
        shown = [
            f"{figures.number(c['value'])}{' ms' if c['unit'] == 'ms' else ''} "
            f"{'' if c['met'] else '**MISSED**'}".strip()
            for c in cells
        ]
        rows.append(f"| {handler} | {h['kills']} | " + " | ".join(shown) + " |")
    return rows


def _horizontal() -> dict[str, Any]:
    """boxplot's keyword for horizontal boxes: ``vert`` was deprecated in Matplotlib 3.10."""
    import matplotlib

    major, minor = (int(x) for x in matplotlib.__version__.split(".")[:2])
    return {"orientation": "horizontal"} if (major, minor) >= (3, 10) else {"vert": False}


def _plot_kills(kill: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    handlers = list(kill["handlers"])
    samples = [kill["handlers"][h]["samples_ms"] for h in handlers]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(handlers) + 1.5))
    ax.boxplot(samples, whis=(0, 100), widths=0.5, **_horizontal())
    for i, s in enumerate(samples, start=1):
        ax.plot(s, [i] * len(s), "o", ms=3, alpha=0.4, color="tab:blue")
    ax.set_yticks(range(1, len(handlers) + 1), handlers)
    ax.axvline(figures.KILL_MEDIAN.limit, ls="--", color="tab:orange", label="median target")
    ax.axvline(figures.KILL_MAX.limit, ls="--", color="tab:red", label="max target")
    ax.set_xlabel("overshoot past the hard deadline (ms)")
    ax.set_title("Hard-kill overshoot per misbehaving handler")
    ax.invert_yaxis()
    ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_gaps(hb: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    t = [x for x, _ in hb["gaps"]]
    gap = [g for _, g in hb["gaps"]]
    target = figures.gap_target(hb["lease_s"])
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot(t, gap, "o-", ms=3, lw=0.8)
    ax.axhline(hb["renew_interval_s"] * 1000, color="grey", ls=":", label="renew interval")
    ax.axhline(target.limit, color="tab:red", ls="--", label=f"target {target}")
    ax.set_ylim(0, max([*gap, target.limit]) * 1.15)
    ax.set_xlabel("time since the jobs were enqueued (s)")
    ax.set_ylabel("gap between renewals (ms)")
    ax.set_title(
        f"Renewal gaps: {hb['children']} children holding the GIL, lease {hb['lease_s']:g} s"
    )
    ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_concurrency(queue: dict[str, Any], cores: int, path: Path) -> None:
    import matplotlib.pyplot as plt

    steps = sorted(queue["concurrency"], key=int)
    x = [int(c) for c in steps]
    med = [queue["concurrency"][c]["median"] for c in steps]
    runs = [queue["concurrency"][c]["runs"] for c in steps]
    low = [m - min(r) for m, r in zip(med, runs, strict=True)]
    high = [max(r) - m for m, r in zip(med, runs, strict=True)]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.errorbar(x, med, yerr=[low, high], fmt="o-", capsize=4, label="median, min-max of runs")
    ax.axhline(figures.QUEUE_NOOP.limit, color="tab:red", ls="--", label="target at 2 children")
    ax.axvline(cores, color="grey", ls=":", label=f"{cores} cores")
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [str(c) for c in x])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("children")
    ax.set_ylabel("no-op jobs/s")
    ax.set_title("Queue throughput vs concurrency")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


#: Under each plot: how to read it.
CAPTIONS = {
    "kill": "Each dot is one kill; boxes span the quartiles, whiskers the extremes.",
    "heartbeat": "Each dot is the gap between two successful renewals, at the time the "
    "second one completed; the renew interval is lease_s / 3.",
    "queue": "No-op jobs enqueued at once; the line joins the medians, bars span the runs. "
    "The target applies at 2 children.",
}


def _plots(data: dict[str, Any], out_dir: Path) -> dict[str, str]:
    """Render what the data allows; section name → PNG file name."""
    try:
        import matplotlib
    except ImportError:
        print("no plots: matplotlib is not installed (pip install -e '.[bench]')")
        return {}

    matplotlib.use("Agg")
    made = {}
    kill = data.get("pool", {}).get("kill")
    if kill:
        _plot_kills(kill, out_dir / "kill_overshoot.png")
        made["kill"] = "kill_overshoot.png"
    hb = data.get("heartbeat", {})
    if hb.get("gaps"):
        _plot_gaps(hb, out_dir / "heartbeat_gaps.png")
        made["heartbeat"] = "heartbeat_gaps.png"
    queue = data.get("queue", {})
    if queue.get("concurrency"):
        _plot_concurrency(queue, data["meta"]["cpu_count"], out_dir / "throughput_concurrency.png")
        made["queue"] = "throughput_concurrency.png"
    return made


def _header(data: dict[str, Any]) -> list[str]:
    meta = data["meta"]
    all_figs = [f for s in SECTION_TITLES for f in figures.collect(data.get(s))]
    judged = [f for f in all_figs if f["met"] is not None]
    missed = [f for f in judged if not f["met"]]

    def load(avg: list[float]) -> str:
        return " / ".join(f"{x:.2f}" for x in avg)

    kind = "**quick run** (few samples: a smoke check)" if meta["quick"] else "full run"
    # Our own processes are not running yet when load_before is read: any load is others'.
    busy = ""
    if meta["load_before"][0] > 0.25 * meta["cpu_count"]:
        busy = ": **the machine was busy before the run; these figures are only indicative**"
    lines = [
        "# sandboxq speed report",
        "",
        f"- {kind}, {meta['started']}, took {meta['duration_s'] / 60:.1f} min",
        f"- commit `{meta['commit']}`, Python {meta['python']}, redis-server {meta['redis']}",
        f"- {meta['cpu_count']} cores, load average {load(meta['load_before'])} before and "
        f"{load(meta['load_after'])} after (1, 5, 15 min){busy}",
        f"- CPU speed: a fixed Python loop took {meta.get('cpu_speed_ms_before', '?')} ms "
        f"before and {meta.get('cpu_speed_ms_after', '?')} ms after the run (lower is "
        "faster; every figure here moves with it)",
        "- a figure measured in several runs shows their median, and each run beside it",
        "- reproduce with `make bench` (or `python bench/run_all.py`, `--quick` for a "
        "smoke check); each bench script in `bench/` also runs on its own",
        "",
        f"**{len(judged) - len(missed)} of {len(judged)} targets met.**",
    ]
    if missed:
        lines += ["", "Missed:", ""]
        lines += [
            f"- {f['name'].strip()}: {figures.number(f['value'])} {f['unit']} "
            f"(target {f['target']})"
            for f in missed
        ]
    failed = [name for name, s in data.items() if isinstance(s, dict) and "error" in s]
    if failed:
        lines += [
            "",
            "Sections that did not finish: "
            + ", ".join(f"{n} ({data[n]['error']})" for n in failed),
        ]
    return lines


def _plot_ref(plots: dict[str, str], key: str) -> list[str]:
    if key not in plots:
        return []
    return ["", f"![{key}]({plots[key]})", "", f"*{CAPTIONS[key]}*"]


def render(data: dict[str, Any], out_dir: Path) -> Path:
    """Write report.md (and its plots) into ``out_dir``; returns the report's path."""
    plots = _plots(data, out_dir)
    lines = _header(data)
    for section, title in SECTION_TITLES.items():
        part = data.get(section)
        if not part or "error" in part:
            continue
        lines += ["", f"## {title}", ""]
        if section == "pool":
            if "kill" in part:
                lines += ["### Hard kill", "", *_kill_table(part["kill"])]
                lines += _plot_ref(plots, "kill")
            rest = [
                f for name in ("replace", "throughput") for f in figures.collect(part.get(name))
            ]
            if rest:
                lines += ["", "### Replacement child and throughput", "", *_table(rest)]
            continue
        lines += [*_table(figures.collect(part)), *_plot_ref(plots, section)]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main() -> None:
    source = Path(
        sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "results" / "latest.json"
    )
    print(f"wrote {render(json.loads(source.read_text()), source.parent)}")


if __name__ == "__main__":
    main()
