"""The batch pages: a queue's batches, and one batch.

    batches  Backend.list_batches: the newest BATCHES_SHOWN, each one O(1) read of counters
    batch    Backend.batch_progress (one read) and batch_failures.failures: the batch's
             stream of finished members (at most FAILURES_STREAM_LIMIT entries a view) and
             where each failed and cancelled member stands, grouped by outcome and kind
             (the type of error raised) with links to the jobs

Both pages follow the queue's events (the hub's coalesced queue-wide stream: at most a
message a second), so the progress bar and the counts move while the batch runs. A batch
id, label or error is text someone may have written to Redis by hand: it reaches the
page only through ``esc`` (and links through ``href``).
"""

from __future__ import annotations

from sandboxq.backends.base import Backend
from sandboxq.batch_failures import Failures, failures
from sandboxq.errors import BackendError
from sandboxq.models import BatchProgress
from sandboxq.web.html import Safe, ago, clip, esc, fields, href, link, table, when
from sandboxq.web.views import Ctx

BATCHES_SHOWN = 50
#: Entries of a batch's finished stream one view reads to group its failures.
FAILURES_STREAM_LIMIT = 20_000
LABEL_CHARS = 120


def bar(progress: BatchProgress) -> Safe:
    """A progress bar of the finished members, with its numbers as text beside it."""
    total = max(progress.total, 1)
    return Safe(
        f'<progress class="batch" max="{total}" value="{progress.finished}"></progress> '
        f'<span class="batch-count">{esc(progress.finished)} / {esc(progress.total)}</span>'
    )


def batches_page(ctx: Ctx, name: str, found: list[BatchProgress]) -> Safe:
    rows = [
        [
            link(href(ctx.root, "/batch", queue=name, id=p.batch_id), p.batch_id, "batch-id"),
            bar(p),
            p.waiting + p.delayed,
            p.active,
            p.completed,
            p.failed,
            p.cancelled,
            "done" if p.done else "",
            ago(p.created_ms, ctx.now),
            clip(p.label or "", LABEL_CHARS),
        ]
        for p in found
    ]
    columns = ["batch", "progress", "waiting", "active", "completed", "failed", "cancelled",
               "done", "created", "label"]  # fmt: skip
    back = link(href(ctx.root, "/queue", name=name), f"queue {name}")
    more = f"<p>The newest {BATCHES_SHOWN} shown.</p>" if len(found) >= BATCHES_SHOWN else ""
    return Safe(
        f"<h1>Batches of queue {esc(name)}</h1><p>{back}</p>{table(columns, rows, 'batches')}{more}"
    )


def batch_page(ctx: Ctx, name: str, backend: Backend, progress: BatchProgress) -> Safe:
    bid = progress.batch_id
    state = "done" if progress.done else f"{progress.finished} of {progress.total} finished"
    if progress.enqueued < progress.total:
        state += f"; only {progress.enqueued} of {progress.total} members were enqueued"
    then = ""
    if progress.then:
        sent = "sent" if progress.then_sent else "not sent yet"
        if progress.then_error:
            sent = f"not sent: {progress.then_error}"
        then = f"{progress.then} ({sent})"
    record = fields(
        [
            ("queue", name),
            ("state", Safe(f'<span id="batch-state">{esc(state)}</span>')),
            ("created", when(progress.created_ms)),
            ("done", when(progress.done_ms) if progress.done_ms else ""),
            ("then", then),
            ("label", clip(progress.label or "", 2000)),
        ]
    )
    columns = ["total", "waiting", "delayed", "active", "completed", "failed", "cancelled"]
    counts = table(columns, [[getattr(progress, c) for c in columns]], "batch-counts")
    try:
        found = failures(backend, bid, stream_limit=FAILURES_STREAM_LIMIT)
    except BackendError as exc:  # its stream damaged (a key of another type): the rest shows
        found = Failures([], 0, 0, True)
        unread = f"<p>Its finished members cannot be read: {esc(exc)}</p>"
    else:
        unread = ""
    rows = [
        [
            g.outcome,
            k.kind,
            k.count,
            Safe(
                " ".join(
                    link(href(ctx.root, "/job", queue=name, id=job_id), job_id, "job-id")
                    for job_id in k.job_ids
                )
            ),
        ]
        for g in found.groups
        for k in g.kinds
    ]
    partial = (
        "" if found.complete else f"<p>Grouped from the first {found.read} members to finish.</p>"
    )
    actions = []
    if progress.failed + progress.cancelled:
        actions.append(
            ctx.form(
                f"Retry {progress.failed + progress.cancelled} failed",
                {"action": "batch_retry", "queue": name, "id": bid},
                "Run the failed and cancelled members of this batch again?",
            )
        )
    if progress.waiting + progress.delayed + progress.active:
        actions.append(
            ctx.form(
                "Cancel",
                {"action": "batch_cancel", "queue": name, "id": bid},
                "Cancel every unfinished member of this batch?",
            )
        )
    batches = link(href(ctx.root, "/batches", queue=name), f"batches of queue {name}")
    return Safe(
        f'<h1>Batch <span class="batch-id" id="batch-id">{esc(bid)}</span></h1>'
        f"<p>{batches}</p>"
        f'<div class="actions">{"".join(actions)}</div>'
        f'<section id="batch-progress">{bar(progress)}</section>{counts}{record}'
        "<h2>failures by outcome and kind</h2>"
        f"{table(['outcome', 'kind', 'members', 'e.g.'], rows, 'failures')}"
        f"{partial}{unread}"
    )
