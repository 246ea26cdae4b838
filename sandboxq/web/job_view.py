"""The job page: one job_detail (one round trip) shown whole: its record, progress,
attempt history (each attempt's traceback and output folded under its title), options,
arguments and result.

Arguments and results are decoded for display only when they are JSON; a pickle payload
is never unpickled here (unpickling what a shared Redis holds runs its code).
"""

from __future__ import annotations

import signal

from sandboxq.backends.base import JobDetail
from sandboxq.codec import decode_stored, reader_codecs
from sandboxq.errors import CodecRefused, SerializationError
from sandboxq.models import JobInfo, JobState
from sandboxq.text import attempts as attempts_text
from sandboxq.text import started as started_text
from sandboxq.web.html import (
    PREVIEW_CHARS,
    Safe,
    clip,
    duration,
    esc,
    fields,
    href,
    link,
    pre,
    pretty,
    table,
    when,
)
from sandboxq.web.views import Ctx


def _payload(
    job_id: str, what: str, codec: str, data: bytes | None, full: bool
) -> tuple[str, bool]:
    """What to show of an encoded payload, and whether it was cut short. The dashboard is
    a reader like any other: it decodes JSON only, through the readers' one gate."""
    if data is None:
        return "", False
    try:
        value = decode_stored(data, codec, allowed=reader_codecs(), job_id=job_id, what=what)
    except CodecRefused:
        return f"{codec} payload, not decoded ({len(data)} bytes)", False
    except SerializationError as exc:
        return f"unreadable ({len(data)} bytes): {exc}", False
    text = pretty(value)
    if full or len(text) <= PREVIEW_CHARS:
        return text, False
    return text[:PREVIEW_CHARS], True


def _memory(limit_mb: float | None, peak_mb: float | None) -> str:
    """An attempt's peak memory and the limit it ran under (memory-aware retries)."""
    if limit_mb is None and peak_mb is None:
        return ""
    peak = "?" if peak_mb is None else f"{peak_mb:g}"
    return f"{peak} / {limit_mb:g} MB" if limit_mb is not None else f"{peak} MB"


def _ended_by(exitcode: int | None, signum: int | None) -> str:
    if signum:
        try:
            return signal.Signals(signum).name
        except ValueError:
            return f"signal {signum}"
    return "" if exitcode is None else f"exit code {exitcode}"


def job_page(ctx: Ctx, name: str, detail: JobDetail, full: bool) -> Safe:
    info = detail.info
    shown: list[Safe] = []
    for label, data in (("arguments", detail.payload), ("result", detail.result)):
        if label == "result" and info.state is not JobState.COMPLETED:
            continue
        text, cut = _payload(info.id, label, info.codec, data, full)
        more = href(ctx.root, "/job", queue=name, id=info.id, full=1)
        tail = f"<p>{link(more, 'show all')} (first {PREVIEW_CHARS} characters shown)</p>"
        shown.append(Safe(f"<h2>{esc(label)}</h2>{pre(text, label)}{tail if cut else ''}"))
    fraction = detail.progress
    progress = ""
    if fraction is not None or not info.state.finished:  # a finished job that never said
        value = esc(fraction if fraction is not None else 0)
        progress = (
            f'<section id="progress-box"><h2>progress</h2>'
            f'<progress id="progress" max="1" value="{value}"></progress> '
            f'<span id="progress-text">{esc(_percent(fraction))}</span> '
            f'<span id="progress-message">{esc(detail.progress_message or "")}</span></section>'
        )
    options = {k: v for k, v in info.options.model_dump().items() if v is not None}
    record = fields(
        [
            ("queue", name),
            ("state", Safe(f'<span id="state" class="state {esc(info.state.value)}">'
                           f"{esc(info.state.value)}</span>")),
            ("attempts", attempts_text(
                info.attempts, (a.attempt for a in info.history), info.stalls
            )),
            ("outcome", info.outcome.value if info.outcome else ""),
            ("created", when(info.created_ms)),
            ("finished", when(info.finished_ms)),
            ("codec", info.codec),
        ]
    )  # fmt: skip
    history = [
        [
            a.attempt,
            a.worker_id or "",
            a.pid or "",
            a.outcome.value,
            a.action.value if a.action else "",
            _ended_by(a.exitcode, a.signal),
            started_text(a.started_ms),
            duration((a.ended_ms - a.started_ms) / 1000) if a.started_ms and a.ended_ms else "",
            clip(a.error, 200),
            _memory(a.memory_limit_mb, a.peak_memory_mb),
        ]
        for a in info.history
    ]
    running = info.running
    if running is not None:  # the history holds only attempts that ended
        left = "" if running.lease_expires_ms is None else (
            f"lease left: {duration(max(0, running.lease_expires_ms - ctx.now) / 1000)}"
        )  # fmt: skip
        history.append(
            [
                running.attempt,
                running.worker_id or "",
                running.pid or "",
                "running",
                "",
                "",
                when(running.started_ms),
                duration(max(0, ctx.now - running.started_ms) / 1000) if running.started_ms else "",
                left,
            ]
        )
    columns = ["attempt", "worker", "pid", "outcome", "action", "exit code or signal",
               "started", "duration", "error", "memory: peak / limit"]  # fmt: skip
    actions = Safe("")
    if info.state in (JobState.FAILED, JobState.CANCELLED):
        actions = ctx.form("Retry", {"action": "retry", "queue": name, "id": info.id})
    elif not info.state.finished:
        actions = ctx.form(
            "Cancel", {"action": "cancel", "queue": name, "id": info.id}, "Cancel this job?"
        )
    error = f"<h2>error</h2>{pre(info.error, 'error')}" if info.error else ""
    unreadable = (
        f"<h2>unreadable fields</h2>{pre(chr(10).join(info.unreadable))}" if info.unreadable else ""
    )
    return Safe(
        f'<h1>Job <span class="job-id" id="job-id">{esc(info.id)}</span></h1>'
        f'<div class="actions">{actions}</div>{record}{progress}{error}'
        f"<h2>attempts</h2>{table(columns, history, 'history')}{_where(info)}"
        f"<h2>options</h2>{pre(pretty(options))}{''.join(shown)}{unreadable}"
    )


def _where(info: JobInfo) -> Safe:
    """Each attempt's traceback and output, folded under its title (a click opens it)."""
    parts: list[str] = []
    for a in info.history:
        for part in ("traceback", "output"):
            value = getattr(a, part)
            if not value:
                continue
            parts.append(
                f'<details class="{part}" id="attempt-{esc(a.attempt)}-{part}">'
                f"<summary>attempt {esc(a.attempt)}: {part}</summary>{pre(value, part)}</details>"
            )
    return Safe("".join(parts))


def _percent(fraction: float | None) -> str:
    return "" if fraction is None else f"{fraction * 100:.0f}%"
