"""``sandboxq queues``: every queue with its counts and live workers, from the queue index.

    --url redis://...  ─► read_index (capped; malformed names ignored) ─► read_stats: two
                          pipelined round trips for all of them (what the exporter reads)
                       ─► --json: a list of dicts │ otherwise: one table (render.py)

No key is scanned: the index is what the enqueue scripts and worker registration keep
(backends/index.py), so this costs a few commands however big the keyspace is. A cap
hit or ignored entries are said on stderr (and in ``--json``'s ``index``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from sandboxq.backends.index import QueueIndex
from sandboxq.cli import render
from sandboxq.cli.options import EXIT_OK, add_json, add_url, shared_url
from sandboxq.models import JobState
from sandboxq.text import visible

PROBE = "sandboxq-cli"  # the backend the index is read through (any queue's would do)


def add_parser(verbs: Any) -> None:
    about = "every queue with its counts by state and live workers (from the queue index)"
    parser: argparse.ArgumentParser = verbs.add_parser("queues", help=about, description=about)
    add_url(parser)
    add_json(parser)
    parser.set_defaults(run=run)


def read(url: str) -> tuple[QueueIndex, list[dict[str, Any]]]:
    """The index and one row per queue: name, counts by state, live workers (a name in
    the index with no key behind it, added by hand, is left out)."""
    from sandboxq.backends.redis.connection import Connections
    from sandboxq.backends.redis.stats import read_index, read_stats

    conns = Connections(url, 5.0, f"sq:{{{PROBE}}}:x")
    try:
        index = read_index(conns)
        stats = read_stats(conns, index.names)
    finally:
        conns.close()
    rows = [
        {
            "queue": s.queue,
            **{state.value: s.jobs.get(state, 0) for state in JobState},
            "workers": s.workers,
            **({"damaged": s.damaged} if s.damaged else {}),
        }
        for s in stats
        if s.exists or s.damaged
    ]
    return index, rows


def run(args: argparse.Namespace) -> int:
    index, rows = read(shared_url(args.url))
    if args.json:
        about = {"total": index.total, "ignored": index.ignored, "capped": index.capped}
        render.print_json({"queues": rows, "index": about})
        return EXIT_OK
    if note := index.note():
        print(f"sandboxq queues: {note}", file=sys.stderr)
    columns = ["queue", *(s.value for s in JobState), "workers"]
    # A damaged queue's counts could not be read: "?" there, not a zero that looks read.
    cells = [
        [row[c] if c == "queue" or "damaged" not in row else "?" for c in columns] for row in rows
    ]
    if not rows:
        print("no queues yet: enqueue a job or start a worker", file=sys.stderr)
        return EXIT_OK
    render.stdout().print(render.table(None, columns, cells, keep=["queue"]))
    for row in rows:
        if "damaged" in row:
            said = visible(f"queue {row['queue']}: damaged, its counts unread ({row['damaged']})")
            print(f"sandboxq queues: {said}", file=sys.stderr)
    return EXIT_OK
