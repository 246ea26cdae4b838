"""The pages, as HTML bodies built from backend reads (no page reads more than a
bounded number of records, whatever the queue's size):

    overview  counts (ZCARD per state), oldest wait, workers, throughput (the hub's counts)
    queue     one job_page (one round trip) per view; search = one job_detail
    job       one job_detail: record, payloads, progress, attempt history (job_view.py)
    workers   the worker registry of each queue
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sandboxq.backends.base import Backend, JobPage
from sandboxq.errors import BackendError
from sandboxq.models import JobState, Outcome
from sandboxq.web import charts
from sandboxq.web.auth import Session
from sandboxq.web.html import (
    Safe,
    ago,
    button_form,
    clip,
    duration,
    esc,
    fields,
    href,
    link,
    table,
    when,
)
from sandboxq.web.hub import Throughput

STATES = [state.value for state in JobState]
CHART_MINUTES = 60  # the overview's charts: the last hour
DURATIONS_SHOWN = 200  # finished jobs whose run time the queue page's chart counts
OUTCOMES = [outcome.value for outcome in Outcome]
PAGE_SIZE = 50


@dataclass(frozen=True, slots=True)
class Ctx:
    """What every page needs from the request: where it is mounted, the time, the user."""

    since: int  # the hub's position before this page read anything
    root: str
    now: int
    actions: bool  # the dashboard has a token and is not read-only
    session: Session | None
    csrf: str

    def form(self, label: str, values: dict[str, Any], confirm: str = "") -> Safe:
        """An action button; shown whenever actions exist, refused by the server without a
        session (the button then leads to the login page's explanation)."""
        if not self.actions:
            return Safe("")
        values = {**values, "csrf": self.csrf}
        return button_form(href(self.root, "/action"), label, values, confirm)


# -- overview -------------------------------------------------------------------------------


def overview(
    ctx: Ctx, queues: list[tuple[str, Backend]], throughput: Throughput, note: str = ""
) -> Safe:
    rows: list[list[object]] = []
    details: list[Safe] = []
    failed: list[BackendError] = []
    damaged: list[str] = []  # queues whose throughput figures are not whole, and why
    columns = ["queue", *STATES, "oldest waiting", "workers", "ended 1 min", "5 min", "15 min"]
    for name, backend in queues:
        q = href(ctx.root, "/queue", name=name)
        try:
            summary = backend.summary()
        except BackendError as exc:
            # one damaged queue (a key changed by hand) stops only its own row; when no
            # queue can be read (the server is down) the page says so as a whole
            failed.append(exc)
            rows.append([link(q, name), f"unavailable: {exc}", *[""] * (len(columns) - 2)])
            continue
        cells: list[object] = [link(q, name)]
        counts, oldest = summary.counts, summary.oldest_waiting_ms
        cells += [
            link(href(ctx.root, "/queue", name=name, state=s.value), counts[s]) for s in JobState
        ]
        cells.append(duration(max(0, ctx.now - oldest) / 1000) if oldest else "")
        workers, capped = summary.workers, summary.workers_capped
        if capped:  # past one read's cap: walk the registry (it forgets the dead it reads)
            registry = backend.worker_registry()
            workers, capped = len(registry.live), registry.capped
        shown = f"{workers}+" if capped else workers
        cells.append(link(href(ctx.root, "/workers", queue=name), shown))
        last = [throughput.recent(name, ctx.now, m) for m in (1, 5, 15)]
        cells += [sum(c.values()) for c in last]
        rows.append(cells)
        if (damage := throughput.damage(name)) is not None:
            damaged.append(damage)
        outcomes = sorted(set().union(*last))
        per_outcome = [[o, *(c[o] for c in last)] for o in outcomes]
        finished = charts.finished_chart(
            throughput.per_minute(name, ctx.now, CHART_MINUTES), f"{name}: attempts ended"
        )
        if summary.depth is None:  # changed by hand, or out of this user's ACL: no chart
            depth = Safe(
                '<p class="empty">waiting depth unavailable: its key could not be read</p>'
            )
        else:
            depth = charts.depth_chart(summary.depth, ctx.now, CHART_MINUTES)
        details.append(
            Safe(
                f'<section class="throughput"><h3>{esc(name)}: attempts ended per minute, '
                f"by outcome</h3>{finished}<h3>{esc(name)}: jobs waiting</h3>{depth}"
                f"{table(['outcome', 'last 1 min', '5 min', '15 min'], per_outcome)}</section>"
            )
        )
    if failed and len(failed) == len(queues):
        raise failed[0]
    empty = (
        ""
        if queues
        else '<p class="empty">No queues found yet: enqueue a job, or name the queues '
        "(sandboxq dashboard --queue NAME).</p>"
    )
    if note:  # a read cap was hit or junk was ignored: never silent
        empty += f'<p class="notice" id="index-note">{esc(note)}</p>'
    for why in damaged:  # nor is a count that cannot be whole
        empty += f'<p class="notice">{esc(why)}</p>'
    return Safe(
        f"<h1>Queues</h1>{empty}{table(columns, rows, 'overview')}"
        f'<div class="grid">{"".join(details)}</div>'
    )


# -- queue ----------------------------------------------------------------------------------


def queue_page(
    ctx: Ctx,
    name: str,
    backend: Backend,
    state: JobState,
    page: JobPage,
    cursor: str | None,
    outcome: str | None,
    missing: str | None,
) -> Safe:
    counts = backend.counts()
    tabs = "".join(
        f'<li class="{"current" if s is state else ""}">'
        f"{link(href(ctx.root, '/queue', name=name, state=s.value), f'{s.value} ({counts[s]})')}"
        "</li>"
        for s in JobState
    )
    options = "".join(
        f'<option value="{esc(o)}"{" selected" if o == outcome else ""}>{esc(o)}</option>'
        for o in ["", *OUTCOMES]
    )
    search = (
        f'<form method="get" action="{href(ctx.root, "/queue")}" class="search">'
        f'<input type="hidden" name="name" value="{esc(name)}">'
        f'<input type="search" name="id" placeholder="exact job id" aria-label="job id">'
        f'<button type="submit">Find job</button></form>'
        f'<form method="get" action="{href(ctx.root, "/queue")}" class="filter">'
        f'<input type="hidden" name="name" value="{esc(name)}">'
        f'<input type="hidden" name="state" value="{esc(state.value)}">'
        f'<label>outcome <select name="outcome">{options}</select></label>'
        f'<button type="submit">Filter</button></form>'
    )
    note = f'<p class="notice">No job {esc(repr(missing))} in queue {esc(name)}.</p>'
    rows = [
        [
            link(href(ctx.root, "/job", queue=name, id=job.id), job.id, "job-id"),
            job.state,
            job.attempts,
            job.outcome or "",
            ago(job.created_ms, ctx.now),
            ago(job.finished_ms, ctx.now),
            clip(job.error, 120),
        ]
        for job in page.jobs
    ]
    columns = ["job", "state", "attempts", "outcome", "created", "finished", "error"]
    pager = [link(href(ctx.root, "/queue", name=name, state=state.value, outcome=outcome), "first")]
    if page.next_cursor is not None:
        more = href(
            ctx.root, "/queue", name=name, state=state.value, outcome=outcome,
            cursor=page.next_cursor,
        )  # fmt: skip
        pager.append(link(more, "next page →", "next"))
    scanned = (
        f"<p>Looked at {page.scanned} {esc(state.value)} jobs, {len(page.jobs)} ended "
        f"{esc(outcome)}.</p>"
        if outcome
        else ""
    )
    purge = (
        ctx.form(
            f"Purge all {state.value} jobs",
            {"action": "purge", "queue": name, "state": state.value},
            f"Delete every {state.value} job of {name}?",
        )
        if state is not JobState.ACTIVE and counts[state]
        else Safe("")
    )
    batches = link(href(ctx.root, "/batches", queue=name), "Batches", "batches")
    durations = charts.duration_chart(backend.recent_durations(DURATIONS_SHOWN))
    return Safe(
        f"<h1>Queue {esc(name)}</h1>{note if missing else ''}<p>{batches}</p>"
        f'<section class="durations"><h2>run time of recent jobs</h2>{durations}</section>'
        f'<div class="tools">{search}</div><ul class="tabs">{tabs}</ul>{scanned}'
        f"{table(columns, rows, 'jobs')}"
        f'<p class="pager">{" ".join(pager)}</p>{purge}'
    )


# -- workers --------------------------------------------------------------------------------


def _rss(job: dict[str, Any]) -> str:
    mb = job.get("rss_mb")
    return f"{float(mb):.0f} MB" if isinstance(mb, int | float) else "not reported"


def workers_page(ctx: Ctx, queues: list[tuple[str, Backend]]) -> Safe:
    sections = []
    failed: list[BackendError] = []
    for name, backend in queues:
        try:
            registry = backend.worker_registry()
        except BackendError as exc:  # a damaged queue (as on the overview): only its own
            failed.append(exc)
            sections.append(f'<p class="notice">Queue {esc(name)} unavailable: {esc(exc)}</p>')
            continue
        if note := registry.note():  # a cap hit is said, never silent
            sections.append(f'<p class="notice">Queue {esc(name)}: {esc(note)}.</p>')
        for record in registry.live:
            lease_s = float(record.get("lease_s") or 0)
            registered = record.get("registered_ms")
            age_s = max(0, ctx.now - int(registered)) / 1000 if registered is not None else None
            children = []
            for job in record.get("jobs") or []:
                renewed = float(job.get("lease_renewed_s_ago") or 0) + (age_s or 0)
                left = lease_s - renewed
                job_id = str(job.get("id"))
                children.append(
                    [
                        job.get("pid") or "not started",
                        link(href(ctx.root, "/job", queue=name, id=job_id), job_id, "job-id"),
                        job.get("attempt"),
                        _rss(job),
                        duration(left) if left > 0 else "expired",
                    ]
                )
            about = fields(
                [
                    ("queue", name),
                    ("host, pid", f"{record.get('host')}, {record.get('pid')}"),
                    ("children", record.get("concurrency")),
                    ("started", when(record.get("started_ms"))),
                    ("renewed", f"{duration(age_s)} ago" if age_s is not None else "unknown"),
                    ("containment", record.get("containment") or "not reported"),
                    ("protections", record.get("protections") or "none"),
                ]
            )
            columns = ["child pid", "job", "attempt", "resident memory", "lease left"]
            sections.append(
                f'<section class="worker"><h2>{esc(record.get("worker_id"))}</h2>{about}'
                f"{table(columns, children, 'children')}</section>"
            )
    if failed and len(failed) == len(queues):
        raise failed[0]  # no queue can be read (the server is down): the page says so
    body = "".join(sections) or '<p class="empty">No live workers.</p>'
    return Safe(f"<h1>Workers</h1>{body}")
