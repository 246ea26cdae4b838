"""The read and manage verbs: ``info``, ``jobs``, ``job``, ``retry``, ``cancel``, ``purge``.

    backend (Redis) ──► *_data(): one plain dict ──► --json: printed as it is
                                                 └─► otherwise: tables (render.py)

Worker records come from other processes (``SandboxWorker._register``), so they are read
with ``.get`` and defaults: an old or odd record shows as blanks, it never breaks ``info``.

Everything shown was read from a Redis others can write: a completed job's result is
decoded only with the codecs this command allows (json; pickle with ``--allow-pickle``),
through ``client.read_result``; damaged parts are listed as ``unreadable``; and stored
text is printed as text (``render.plain``), never as markup or terminal escapes.
"""

from __future__ import annotations

import argparse
from typing import Any

from sandboxq import text
from sandboxq.backends.base import Backend
from sandboxq.cli import render
from sandboxq.cli.job_view import job, lease_left
from sandboxq.cli.options import (
    EXIT_FAILED,
    EXIT_OK,
    Exit,
    add_allow_pickle,
    add_json,
    add_url,
    bounded,
    checked,
    open_queue,
)
from sandboxq.errors import BackendError, ConfigError
from sandboxq.models import JobInfo, JobState, check_job_id, now_ms

STATES = [state.value for state in JobState]
#: The most jobs ``jobs --limit`` lists per state: as many as a queue keeps completed by
#: default (``retain_completed``), each read one by one.
MAX_LIMIT = 1_000_000


def add_parsers(verbs: Any) -> None:
    def verb(name: str, help: str, run: Any) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = verbs.add_parser(name, help=help, description=help)
        parser.add_argument("queue")
        add_url(parser)
        add_json(parser)
        add_allow_pickle(parser)
        parser.set_defaults(run=run)
        return parser

    verb("info", "counts by state, live workers and the jobs they run", info)
    jobs_ = verb("jobs", "list jobs (with outcome and error) by state", jobs)
    jobs_.add_argument("--state", choices=STATES, action="append", help="repeatable; default all")
    jobs_.add_argument(
        "--limit",
        type=bounded(int, 1, MAX_LIMIT),
        default=50,
        help=f"at most this many per state, 1 to {MAX_LIMIT} (default: 50)",
    )
    job_ = verb("job", "one job in full: options, result or error, every attempt", job)
    job_.add_argument("id", type=checked(check_job_id))
    retry_ = verb("retry", "put a failed or cancelled job back in the queue", retry)
    retry_.add_argument(
        "id", nargs="?", type=checked(check_job_id), help="the job (or --all-failed)"
    )
    retry_.add_argument("--all-failed", action="store_true", help="every failed job")
    retry_.set_defaults(late_positional="id")
    cancel_ = verb("cancel", "cancel a job (a running one's child is killed)", cancel)
    cancel_.add_argument("id", type=checked(check_job_id))
    purge_ = verb("purge", "delete every job in the given states", purge)
    purge_.add_argument(
        "--state", choices=STATES, action="append", required=True, help="repeatable"
    )


# -- info ---------------------------------------------------------------------------------


def info_data(backend: Backend) -> dict[str, Any]:
    counts = backend.counts()
    now = now_ms()
    workers = []
    registry = backend.worker_registry()
    for record in registry.live:
        lease_s = float(record.get("lease_s") or 0)
        # How old the record is: the lease ages were true when it was written. By the
        # backend's clock (age_ms) where it says: registered_ms is the worker's own clock,
        # and a worker whose clock is off would look as if it had stopped renewing.
        registered = record.get("registered_ms")
        if record.get("age_ms") is not None:
            age_s = record["age_ms"] / 1000
        else:
            age_s = max(0, now - int(registered)) / 1000 if registered is not None else 0.0
        jobs = [
            {
                "id": job.get("id"),
                "attempt": job.get("attempt"),
                "pid": job.get("pid"),
                "lease_left_s": round(
                    lease_s - float(job.get("lease_renewed_s_ago") or 0) - age_s, 1
                ),
            }
            for job in record.get("jobs") or []
        ]
        fields = (
            "worker_id",
            "host",
            "pid",
            "concurrency",
            "lease_s",
            "started_ms",
            "containment",
            "protections",
        )
        entry = {**{k: record.get(k) for k in fields}, "jobs": jobs}
        if record.get("unreadable"):
            entry["unreadable"] = record["unreadable"]
        workers.append(entry)
    return {
        "queue": backend.queue,
        "counts": {state.value: n for state, n in counts.items()},
        "workers": workers,
        "workers_note": registry.note(),  # a read cap was hit: "" when none was
    }


def info(args: argparse.Namespace) -> int:
    with open_queue(args) as queue:
        data = info_data(queue.backend)
    if args.json:
        render.print_json(data)
        return EXIT_OK
    out, now = render.stdout(), now_ms()
    counts = data["counts"]
    out.print(render.table(f"queue {data['queue']}", list(counts), [list(counts.values())]))
    workers = data["workers"]
    if data["workers_note"]:  # never silent: a worker left unread may be the one sought
        out.print(f"note: {data['workers_note']}")
    if not workers:
        out.print("no live workers")
        return EXIT_OK
    rows = [
        (
            w["worker_id"],
            w["host"],
            w["pid"],
            w["concurrency"],
            len(w["jobs"]),
            text.ago(w["started_ms"], now),
            w["containment"] or "",
            w["protections"] or "",
        )
        for w in workers
    ]
    columns = ["worker", "host", "pid", "children", "running", "started", "containment"]
    columns.append("protections")
    out.print(render.table(f"live workers ({len(workers)})", columns, rows, keep=["worker"]))
    held = [
        (j["id"], j["attempt"], w["worker_id"], j["pid"] or "not started",
         lease_left(j["lease_left_s"]))
        for w in workers
        for j in w["jobs"]
    ]  # fmt: skip
    if held:
        columns = ["job", "attempt", "worker", "child pid", "lease left"]
        title = f"jobs held by workers ({len(held)})"
        out.print(render.table(title, columns, held, keep=["job"]))
    damaged = [(w["worker_id"], "; ".join(w["unreadable"])) for w in workers if w.get("unreadable")]
    if damaged:
        title = f"unreadable parts of worker records ({len(damaged)})"
        out.print(render.table(title, ["worker", "unreadable"], damaged, wrap="unreadable"))
    return EXIT_OK


# -- jobs and job -------------------------------------------------------------------------


def _summary(info: JobInfo) -> dict[str, Any]:
    return {
        "id": info.id,
        "state": info.state.value,
        "attempts": info.attempts,
        "stalls": info.stalls,
        "outcome": info.outcome.value if info.outcome else None,
        "error": info.error,
        "created_ms": info.created_ms,
        "finished_ms": info.finished_ms,
    }


def jobs_data(backend: Backend, states: list[JobState], limit: int) -> list[dict[str, Any]]:
    rows = []
    for state in states:
        for job_id in backend.list_jobs(state, limit):
            try:
                info = backend.get(job_id)
            except BackendError as exc:  # one unreadable record must not hide the others
                rows.append({"id": job_id, "state": "unreadable", "error": str(exc)})
                continue
            if info is not None:  # it may have been trimmed since it was listed
                rows.append(_summary(info))
    return rows


def jobs(args: argparse.Namespace) -> int:
    states = [JobState(s) for s in args.state] if args.state else list(JobState)
    with open_queue(args) as queue:
        rows = jobs_data(queue.backend, states, args.limit)
    if args.json:
        render.print_json(rows)
        return EXIT_OK
    out = render.stdout()
    if not rows:
        out.print(
            render.plain(f"no {' or '.join(s.value for s in states)} jobs in queue {args.queue}")
        )
        return EXIT_OK
    table = render.table(
        f"jobs of queue {args.queue}",
        ["job", "state", "attempts", "outcome", "finished", "error"],
        [
            (
                r["id"],
                r["state"],
                r.get("attempts"),
                r.get("outcome"),
                text.when(r.get("finished_ms")),
                text.clip(r.get("error"), 200),
            )
            for r in rows
        ],
        keep=["job"],
        wrap="error",
    )
    out.print(table)
    return EXIT_OK


# -- retry, cancel, purge -----------------------------------------------------------------


def _state_of(backend: Backend, job_id: str) -> str:
    info = backend.get(job_id)
    return "unknown" if info is None else info.state.value


def retry(args: argparse.Namespace) -> int:
    if args.all_failed == (args.id is not None):
        raise ConfigError("retry takes a job id or --all-failed (one of them)")
    if args.id is not None:
        check_job_id(args.id)  # taken after options (late_positional): argparse never saw it
    with open_queue(args) as queue:
        backend = queue.backend
        if args.all_failed:
            # The ids are taken once: a job that fails again meanwhile is not retried twice.
            failed = backend.list_jobs(JobState.FAILED, backend.counts()[JobState.FAILED])
            retried = [job_id for job_id in failed if backend.retry_failed(job_id)]
        elif backend.retry_failed(args.id):
            retried = [args.id]
        else:
            state = _state_of(backend, args.id)
            raise Exit(f"job {args.id!r} is {state}: only failed or cancelled jobs can be retried")
    if args.json:
        render.print_json({"retried": retried})
    elif args.all_failed:
        render.stdout().print(
            render.plain(f"retried {len(retried)} failed job(s) of queue {args.queue}")
        )
    else:
        render.stdout().print(render.plain(f"retried job {args.id}"))
    return EXIT_OK if retried else EXIT_FAILED  # 1: nothing to retry (as the README says)


def cancel(args: argparse.Namespace) -> int:
    with open_queue(args) as queue:
        if not queue.backend.cancel(args.id):
            state = _state_of(queue.backend, args.id)
            raise Exit(f"job {args.id!r} is {state}: only unfinished jobs can be cancelled")
    if args.json:
        render.print_json({"cancelled": args.id})
    else:
        render.stdout().print(render.plain(f"cancelled job {args.id}"))
    return EXIT_OK


def purge(args: argparse.Namespace) -> int:
    states = [JobState(s) for s in dict.fromkeys(args.state)]
    if JobState.ACTIVE in states:  # refused before anything is deleted
        raise ConfigError("active jobs cannot be purged: their workers hold leases; cancel them")
    with open_queue(args) as queue:
        purged = {state.value: queue.backend.purge(state) for state in states}
    if args.json:
        render.print_json({"purged": purged})
    else:
        for state, n in purged.items():
            render.stdout().print(
                render.plain(f"purged {n} {state} job(s) from queue {args.queue}")
            )
    return EXIT_OK
