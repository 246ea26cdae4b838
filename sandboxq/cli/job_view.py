"""``sandboxq job QUEUE ID``: one job's whole story, in one place.

    backend.get + get_arguments ──► job_data(): one plain dict (what --json prints)
        record, options, arguments (bounded), result or error,
        history: every attempt that ended (traceback, output), then the running one
    └─► otherwise: the record's table, the attempts' table, then each attempt's
        traceback and output under it, newest last

Arguments and results are decoded only with the codecs this command allows (json; pickle
with ``--allow-pickle``), and a long one is cut to ``text.PREVIEW_CHARS`` characters, as
the dashboard shows it: ``--json`` says how long it was. Everything else read from Redis
is printed as text (``render.plain``), never as markup or terminal escapes.
"""

from __future__ import annotations

import argparse
import json
import signal
from collections.abc import Collection
from typing import Any

from sandboxq import codec, text
from sandboxq.backends.base import Backend
from sandboxq.cli import render
from sandboxq.cli.options import EXIT_ERROR, EXIT_OK, Exit, open_queue
from sandboxq.client import read_result
from sandboxq.errors import BackendError, SerializationError
from sandboxq.finished import why_missing
from sandboxq.models import JobState, now_ms


def not_found_text(backend: Backend, job_id: str) -> str:
    """Why ``job_id`` is not there, with what retention has removed (README "Retention")."""
    try:
        trims = backend.retention_trims()
    except BackendError:
        trims = None
    return f"no job {job_id!r} in queue {backend.queue!r} {why_missing(trims)}"


def job_data(backend: Backend, job_id: str, allowed: Collection[str]) -> dict[str, Any]:
    """The job's record; a completed job's ``result`` decoded only with ``allowed`` codecs,
    else ``result_error`` saying why it is not shown (the rest of the record still is)."""
    info = backend.get(job_id)
    if info is None:
        raise Exit(not_found_text(backend, job_id))
    data = info.model_dump(mode="json")
    try:
        payload = backend.get_arguments(job_id)
    except SerializationError as exc:
        data["arguments_error"] = str(exc)
    else:
        data.update(_arguments(info.id, info.codec, payload, allowed))
    if info.state is JobState.COMPLETED:
        try:
            data["result"] = _jsonable(read_result(backend, info, allowed))
        except SerializationError as exc:
            data["result_error"] = str(exc)
    return data


def _arguments(
    job_id: str, codec_name: str, payload: bytes | None, allowed: Collection[str]
) -> dict[str, Any]:
    """``arguments``: ``{"args": [...], "kwargs": {...}}`` when whole it fits in
    ``PREVIEW_CHARS`` characters of JSON, else ``arguments_preview`` (its first characters)
    and ``arguments_chars`` (how many there are); ``arguments_error`` when it is not shown."""
    if payload is None:
        return {}
    try:
        args, kwargs = codec.decode_stored(
            payload, codec_name, allowed=allowed, job_id=job_id, what="arguments"
        )
    except (SerializationError, TypeError, ValueError) as exc:
        return {"arguments_error": f"{exc} ({len(payload)} bytes)"}
    value = {"args": _jsonable(args), "kwargs": _jsonable(kwargs)}
    whole = json.dumps(value, ensure_ascii=False)
    if len(whole) <= text.PREVIEW_CHARS:
        return {"arguments": value}
    return {"arguments_preview": whole[: text.PREVIEW_CHARS], "arguments_chars": len(whole)}


def _jsonable(value: Any) -> Any:
    """A decoded value as JSON can print it (a pickled result may hold anything)."""
    if isinstance(value, set | frozenset):
        value = list(value)
    try:
        json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        return repr(value)[:10_000]
    return value


def job(args: argparse.Namespace) -> int:
    with open_queue(args) as queue:
        data = job_data(queue.backend, args.id, queue.allowed_codecs)
    status = EXIT_OK
    if "result_error" in data:
        # The record is shown, then the refusal ends the command with an error status.
        status = EXIT_ERROR
    if args.json:
        render.print_json(data)
        return _refused(data, status)
    out = render.stdout()
    title = f"job {data['id']} (queue {data['queue']})"
    out.print(render.table(title, ["", "value"], _fields(data), wrap="value", header=False))
    history = [_history_row(a) for a in data["history"]]
    running = data.get("running")
    if running:
        history.append(_running_row(running))
    columns = ["#", "outcome", "action", "worker", "pid", "exit", "started", "took", "error"]
    if history:
        out.print(render.table("attempts", columns, history, keep=["worker"], wrap="error"))
    else:
        out.print("no attempts yet")
    for attempt in data["history"]:
        for part in ("traceback", "output"):
            if attempt.get(part):
                out.print(render.plain(f"\nattempt {attempt['attempt']}: {part}"), style="bold")
                out.print(render.plain(attempt[part].rstrip("\n")))
    return _refused(data, status)


def _fields(data: dict[str, Any]) -> list[tuple[str, Any]]:
    fields = [
        ("state", data["state"]),
        (
            "attempts",
            text.attempts(
                data["attempts"], (a["attempt"] for a in data["history"]), data["stalls"]
            ),
        ),
        ("outcome", data["outcome"]),
        ("error", data["error"]),
        ("created", text.when(data["created_ms"])),
        ("finished", text.when(data["finished_ms"])),
        ("options", json.dumps({k: v for k, v in data["options"].items() if v is not None})),
    ]
    if "arguments" in data:
        fields.append(("arguments", json.dumps(data["arguments"], ensure_ascii=False)))
    elif "arguments_preview" in data:
        more = f"\n(the first {text.PREVIEW_CHARS} of {data['arguments_chars']} characters)"
        fields.append(("arguments", data["arguments_preview"] + more))
    elif "arguments_error" in data:
        fields.append(("arguments", f"not shown: {data['arguments_error']}"))
    if "result" in data:
        fields.append(("result", json.dumps(data["result"], ensure_ascii=False)))
    if data.get("unreadable"):
        fields.append(("unreadable", "\n".join(data["unreadable"])))
    return fields


def _history_row(a: dict[str, Any]) -> tuple[Any, ...]:
    return (
        a["attempt"],
        a["outcome"],
        a["action"],
        a["worker_id"],
        a["pid"],
        _ended_by(a),
        text.started(a["started_ms"], date=False),
        _took(a),
        a["error"],
    )


def _running_row(r: dict[str, Any]) -> tuple[Any, ...]:
    expires = r.get("lease_expires_ms")
    lease = "" if expires is None else f"lease left: {lease_left((expires - now_ms()) / 1000)}"
    started = r.get("started_ms")
    took = text.duration(max(0, now_ms() - started) / 1000) if started else ""
    return (
        r["attempt"],
        "running",
        "",
        r.get("worker_id"),
        r.get("pid") or "",
        "",
        text.when(started, date=False),
        took,
        lease,
    )


def lease_left(seconds: float) -> str:
    return text.duration(seconds) if seconds > 0 else "expired: the worker stopped renewing"


def _refused(data: dict[str, Any], status: int) -> int:
    if "result_error" in data:
        raise Exit(f"result not shown: {data['result_error']}", status)
    return status


def _ended_by(attempt: dict[str, Any]) -> str:
    if attempt.get("signal"):
        try:
            return signal.Signals(attempt["signal"]).name
        except ValueError:
            return f"signal {attempt['signal']}"
    code = attempt.get("exitcode")
    return "" if code is None else f"code {code}"


def _took(attempt: dict[str, Any]) -> str:
    start, end = attempt.get("started_ms"), attempt.get("ended_ms")
    return text.duration((end - start) / 1000) if start and end else ""
