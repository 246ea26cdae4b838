"""Charts as inline SVG, drawn on the server: no script, no CDN, nothing the CSP must allow.

    Throughput.per_minute (hub.py: ended attempts by outcome, from the events streams)
        ──► finished_chart: one stacked bar per minute, the last hour
    Backend.summary().depth (a sample a minute, written by each worker's registry refresh)
        ──► depth_chart: jobs waiting over the last hour
    Backend.recent_durations (the last attempt record of recently finished jobs)
        ──► duration_chart: how many took how long, per outcome, on log-spaced buckets

Every number is also in the SVG's ``<title>`` (a tooltip, and text for a screen reader),
and colours are SVG presentation attributes, which a ``style-src 'self'`` CSP allows.
Outcome names come from a fixed list, but are escaped all the same.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from sandboxq.web.html import Safe, esc

WIDTH, HEIGHT, PAD = 600, 120, 28
SPAN = HEIGHT - 16  # the tallest bar: the scale's label sits above it

#: A colour per outcome (ok green, errors red, timeouts and kills warm, the rest grey).
COLOURS = {
    "ok": "#18794e",
    "error": "#b42318",
    "soft_timeout": "#dc6803",
    "hard_timeout": "#b54708",
    "crashed": "#7a2e0e",
    "memory_limit": "#c11574",
    "lease_lost": "#6941c6",
    "cancelled": "#a15c00",
    "interrupted": "#667085",
    "expired": "#98a2b3",
    "deadline": "#475467",
}
OTHER = "#5b6672"

#: Duration buckets' upper bounds (seconds) and labels: log-spaced, a ms to an hour.
DURATION_BOUNDS_S = (0.01, 0.1, 1.0, 10.0, 60.0, 600.0, 3600.0)
DURATION_LABELS = ("<10ms", "<100ms", "<1s", "<10s", "<1min", "<10min", "<1h", "≥1h")


def colour(outcome: str) -> str:
    return COLOURS.get(outcome, OTHER)


def _svg(label: str, body: str, cls: str) -> Safe:
    return Safe(
        f'<svg class="chart {esc(cls)}" viewBox="0 0 {WIDTH} {HEIGHT + PAD}" role="img" '
        f'aria-label="{esc(label)}" xmlns="http://www.w3.org/2000/svg">'
        f"<title>{esc(label)}</title>{body}</svg>"
    )


def _axis(ymax: float, left: str, right: str) -> str:
    y0 = HEIGHT
    return (
        f'<line x1="0" y1="{y0}" x2="{WIDTH}" y2="{y0}" stroke="#d8dee4"/>'
        f'<text x="0" y="{y0 + 16}" font-size="11" fill="#5b6672">{esc(left)}</text>'
        f'<text x="{WIDTH}" y="{y0 + 16}" font-size="11" fill="#5b6672" '
        f'text-anchor="end">{esc(right)}</text>'
        f'<text x="2" y="11" font-size="11" fill="#5b6672">{esc(_number(ymax))}</text>'
    )


def _number(value: float) -> str:
    return f"{value:,.0f}" if value >= 10 or value == int(value) else f"{value:.1f}"


def legend(outcomes: Sequence[str]) -> Safe:
    """The outcomes of a chart as text, each after a square of its colour (an SVG, since
    inline ``style`` attributes are refused by the CSP)."""
    items = "".join(
        f'<span class="key"><svg width="10" height="10" aria-hidden="true">'
        f'<rect width="10" height="10" fill="{colour(o)}"/></svg> {esc(o)}</span>'
        for o in outcomes
    )
    return Safe(f'<div class="legend">{items}</div>')


def finished_chart(minutes: Sequence[Counter[str]], label: str) -> Safe:
    """One stacked bar per minute (oldest first) of the attempts that ended, by outcome."""
    outcomes = sorted(set().union(*minutes), key=lambda o: (o != "ok", o))
    top = max([sum(c.values()) for c in minutes] + [1])
    step = WIDTH / max(len(minutes), 1)
    bars = []
    for i, counts in enumerate(minutes):
        y = float(HEIGHT)
        parts = []
        for outcome in outcomes:
            n = counts.get(outcome, 0)
            if not n:
                continue
            h = SPAN * n / top
            y -= h
            parts.append(
                f'<rect x="{i * step + 1:.1f}" y="{y:.1f}" width="{max(step - 2, 1):.1f}" '
                f'height="{h:.1f}" fill="{colour(outcome)}"/>'
            )
        if parts:
            ago = len(minutes) - 1 - i
            said = ", ".join(f"{o} {counts[o]}" for o in outcomes if counts.get(o))
            when = "this minute" if ago == 0 else f"{ago} min ago"
            bars.append(f"<g><title>{esc(when)}: {esc(said)}</title>{''.join(parts)}</g>")
    if not bars:
        bars.append(_empty("no attempt ended in the last hour"))
    total = sum(sum(c.values()) for c in minutes)
    body = _axis(top, f"-{len(minutes)} min", "now") + "".join(bars)
    chart = _svg(f"{label}: {total} attempts ended in the last {len(minutes)} minutes", body,
                 "finished")  # fmt: skip
    return Safe(chart + legend(outcomes))


def depth_chart(samples: Sequence[tuple[int, int]], now_ms: int, minutes: int) -> Safe:
    """Jobs waiting, a point per sampled minute, over the last ``minutes``."""
    first = now_ms // 60_000 - minutes + 1
    points = [(m // 60_000 - first, n) for m, n in samples if m // 60_000 >= first]
    top = max([n for _, n in points] + [1])
    step = WIDTH / max(minutes - 1, 1)
    body = _axis(top, f"-{minutes} min", "now")
    if points:
        xy = [(i * step, HEIGHT - SPAN * n / top) for i, n in points]
        line = " ".join(f"{x:.1f},{y:.1f}" for x, y in xy)
        area = f"{xy[0][0]:.1f},{HEIGHT} {line} {xy[-1][0]:.1f},{HEIGHT}"
        body += (
            f'<polygon points="{area}" fill="#1f5fbf" fill-opacity="0.15"/>'
            f'<polyline points="{line}" fill="none" stroke="#1f5fbf" stroke-width="2"/>'
        )
        body += "".join(
            f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="#1f5fbf"><title>'
            f"{minutes - 1 - i} min ago: {n} waiting</title></circle>"
            for (x, y), (i, n) in zip(xy, points, strict=True)
        )
        said = f"now {points[-1][1]} waiting, at most {top} in the last {minutes} minutes"
    else:
        body += _empty("no samples yet: each live worker writes one a minute")
        said = "no samples yet"
    return _svg(f"jobs waiting: {said}", body, "depth")


def duration_chart(durations: Sequence[tuple[str, float]]) -> Safe:
    """How many of the recent attempts took how long, stacked by outcome."""
    buckets: list[Counter[str]] = [Counter() for _ in DURATION_LABELS]
    for outcome, seconds in durations:
        index = next(
            (i for i, bound in enumerate(DURATION_BOUNDS_S) if seconds < bound),
            len(DURATION_BOUNDS_S),
        )
        buckets[index][outcome] += 1
    outcomes = sorted({o for o, _ in durations}, key=lambda o: (o != "ok", o))
    top = max([sum(c.values()) for c in buckets] + [1])
    step = WIDTH / len(buckets)
    body = f'<line x1="0" y1="{HEIGHT}" x2="{WIDTH}" y2="{HEIGHT}" stroke="#d8dee4"/>'
    body += f'<text x="2" y="11" font-size="11" fill="#5b6672">{top}</text>'
    for i, counts in enumerate(buckets):
        x = i * step
        body += (
            f'<text x="{x + step / 2:.1f}" y="{HEIGHT + 16}" font-size="11" fill="#5b6672" '
            f'text-anchor="middle">{esc(DURATION_LABELS[i])}</text>'
        )
        y = float(HEIGHT)
        parts = []
        for outcome in outcomes:
            if not (n := counts.get(outcome, 0)):
                continue
            h = SPAN * n / top
            y -= h
            parts.append(
                f'<rect x="{x + 6:.1f}" y="{y:.1f}" width="{step - 12:.1f}" height="{h:.1f}" '
                f'fill="{colour(outcome)}"/>'
            )
        if parts:
            said = ", ".join(f"{o} {counts[o]}" for o in outcomes if counts.get(o))
            body += f"<g><title>{esc(DURATION_LABELS[i])}: {esc(said)}</title>{''.join(parts)}</g>"
    if not durations:
        body += _empty("no finished attempt to measure yet")
    label = f"run time of the last attempt of {len(durations)} recently finished jobs"
    return Safe(_svg(label, body, "durations") + legend(outcomes))


def _empty(text: str) -> str:
    return (
        f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" font-size="12" fill="#5b6672" '
        f'text-anchor="middle">{esc(text)}</text>'
    )
