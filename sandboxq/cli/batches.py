"""``sandboxq batch QUEUE ID``: one batch's progress and its failures grouped by outcome
and kind; ``--retry-failed`` and ``--cancel`` act on every member at once.

    Queue.get_batch(ID) ─► progress() (one O(1) read) ┐
                        └► batch_failures.failures(): the batch's stream of finished
                           members, then where each failed and cancelled member stands
                           ─► groups by outcome, each by kind (the type of error raised)
                                                     ├─► --json: one dict, printed as it is
                                                     └─► otherwise: two tables (render.py)

A batch id that does not exist ends the command like an unknown job does (``sandboxq
job``): one line on stderr, exit status 1. Everything shown was read from a Redis others
can write, and is printed as text (``render.plain`` and the tables), never as markup.
"""

from __future__ import annotations

import argparse
from typing import Any

from sandboxq import text
from sandboxq.batch import Batch
from sandboxq.batch_failures import failures
from sandboxq.cli import render
from sandboxq.cli.options import EXIT_FAILED, EXIT_OK, Exit, add_json, add_url, open_queue
from sandboxq.client import Job, Queue
from sandboxq.errors import BatchNotFound
from sandboxq.models import BatchProgress, check_batch_id


def add_parser(verbs: Any) -> None:
    about = (
        "one batch: progress, failures grouped by outcome and kind of error; "
        "retry or cancel its members"
    )
    parser: argparse.ArgumentParser = verbs.add_parser("batch", help=about, description=about)
    parser.add_argument("queue")
    parser.add_argument("id", help="the batch id (Batch.id, or the id sandboxq run --url printed)")
    add_url(parser)
    add_json(parser)
    act = parser.add_mutually_exclusive_group()
    act.add_argument(
        "--retry-failed", action="store_true", help="run its failed and cancelled members again"
    )
    act.add_argument(
        "--cancel", action="store_true", help="cancel its members that have not finished"
    )
    parser.set_defaults(run=run)


def open_batch(queue: Queue, batch_id: str) -> Batch[Job]:
    check_batch_id(batch_id)
    try:
        return queue.get_batch(batch_id)
    except BatchNotFound as exc:
        raise gone(queue, batch_id, exc) from None


def gone(queue: Queue, batch_id: str, exc: BatchNotFound) -> Exit:
    """One line for a batch that is not there; one that expired says when (retention may
    still be deleting it: nothing of it is shown)."""
    if exc.expired_ms is not None:
        return Exit(str(exc))
    return Exit(
        f"no batch {batch_id!r} in queue {queue.name!r} "
        "(unknown, forgotten, or removed batch_ttl_s after it was done)"
    )


def batch_data(batch: Batch[Job]) -> dict[str, Any]:
    progress = batch.progress()
    found = failures(batch.queue.backend, batch.id)
    return {
        **progress_data(progress),
        "failures": [
            {
                "outcome": g.outcome,
                "count": g.count,
                "job_ids": g.job_ids,
                "kinds": [
                    {"kind": k.kind, "count": k.count, "job_ids": k.job_ids} for k in g.kinds
                ],
            }
            for g in found.groups
        ],
    }


def progress_data(progress: BatchProgress) -> dict[str, Any]:
    return {
        "batch_id": progress.batch_id,
        "queue": progress.queue,
        "total": progress.total,
        "enqueued": progress.enqueued,
        "waiting": progress.waiting,
        "active": progress.active,
        "delayed": progress.delayed,
        "completed": progress.completed,
        "failed": progress.failed,
        "cancelled": progress.cancelled,
        "done": progress.done,
        "then": progress.then,
        "then_sent": progress.then_sent,
        "then_error": progress.then_error,
        "created_ms": progress.created_ms,
        "done_ms": progress.done_ms,
        "label": progress.label,
    }


def run(args: argparse.Namespace) -> int:
    with open_queue(args) as queue:
        batch = open_batch(queue, args.id)
        try:  # it may expire, or be forgotten, between the reads
            if args.retry_failed or args.cancel:
                return act(batch, "retry" if args.retry_failed else "cancel", args.json)
            data = batch_data(batch)
        except BatchNotFound as exc:
            raise gone(queue, args.id, exc) from None
    if args.json:
        render.print_json(data)
        return EXIT_OK
    show(data)
    return EXIT_OK


def act(batch: Batch[Job], action: str, as_json: bool) -> int:
    acted = batch.retry_failed() if action == "retry" else batch.cancel()
    done = "retried" if action == "retry" else "cancelled"
    if as_json:
        render.print_json({done: acted, "batch_id": batch.id})
    if not acted:
        which = "failed or cancelled" if action == "retry" else "unfinished"
        raise Exit(f"batch {batch.id!r} has no {which} members", EXIT_FAILED)
    if not as_json:
        render.stdout().print(render.plain(f"{done} {acted} member(s) of batch {batch.id}"))
    return EXIT_OK


def show(data: dict[str, Any]) -> None:
    out = render.stdout()
    finished = data["completed"] + data["failed"] + data["cancelled"]
    state = "done" if data["done"] else f"{finished} of {data['total']} finished"
    if data["enqueued"] < data["total"]:
        state += f"; only {data['enqueued']} of {data['total']} members were enqueued"
    fields: list[tuple[str, Any]] = [
        ("state", state),
        ("created", text.when(data["created_ms"])),
    ]
    if data["label"]:
        fields.append(("label", text.clip(data["label"], 200)))
    if data["done_ms"]:
        fields.append(("done", text.when(data["done_ms"])))
    if data["then"]:
        sent = "sent" if data["then_sent"] else "not sent yet"
        if data["then_error"]:
            sent = f"not sent: {data['then_error']}"
        fields.append(("then", f"{data['then']} ({sent})"))
    title = f"batch {data['batch_id']} (queue {data['queue']})"
    out.print(render.table(title, ["", "value"], fields, wrap="value", header=False))
    columns = ["total", "waiting", "active", "delayed", "completed", "failed", "cancelled"]
    out.print(render.table(None, columns, [[data[c] for c in columns]]))
    groups = data["failures"]
    if not groups:
        out.print("no failed or cancelled members")
        return
    rows = [
        (
            g["outcome"],
            k["kind"],
            k["count"],
            ", ".join(k["job_ids"]) + (" ..." if k["count"] > len(k["job_ids"]) else ""),
        )
        for g in groups
        for k in g["kinds"]
    ]
    columns = ["outcome", "kind", "members", "e.g."]
    out.print(render.table("failures by outcome and kind", columns, rows, wrap="e.g."))
