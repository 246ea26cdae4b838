"""Translation between sandboxq data and what the scripts read and return: new jobs into
enqueue.lua's framed argument, job hashes into ``JobInfo``, claim replies into
``Claimed``, stream entries into ``Event``. Nothing here talks to Redis.

A record that cannot be read raises ``BackendError`` naming the queue, the job and the
field, so "why can't I see my job" has an answer too.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from sandboxq.backends.base import Claimed, Event, NewJob
from sandboxq.errors import BackendError, ConfigError
from sandboxq.models import (
    MAX_PRIORITY,
    AttemptRecord,
    JobInfo,
    JobOptions,
    JobState,
    Outcome,
    parse_job_options,
)

T = TypeVar("T")

#: Entries per claimed job in a claim/finish reply (see lua/claim.lua).
CLAIM_ROW = 7

#: One job inside enqueue.lua's framed argument: id, payload, codec and opts lengths,
#: priority, delay ms, max_stalls; then those four byte strings (see lua/enqueue.lua).
ENQUEUE_HEADER = struct.Struct(">HIHIhqH")


def frame_job(job_id: str, job: NewJob) -> bytes:
    """``job`` as enqueue.lua reads it. Options are validated here, once per distinct
    string: ``max_stalls`` is stored as its own field because Lua needs it at recovery."""
    try:
        max_stalls = parse_job_options(job.options_json).max_stalls
    except ValueError as exc:
        raise ConfigError(f"job {job_id!r}: invalid options: {brief(exc)}") from exc
    if not -MAX_PRIORITY <= job.priority <= MAX_PRIORITY:
        raise ConfigError(f"job {job_id!r}: priority {job.priority} is outside ±{MAX_PRIORITY}")
    id_bytes, codec, opts = job_id.encode(), job.codec.encode(), job.options_json.encode()
    if len(id_bytes) > 0xFFFF or len(job.payload) > 0xFFFFFFFF or len(opts) > 0xFFFFFFFF:
        raise ConfigError(f"job {job_id!r}: id, payload or options too large for one job")
    delay_ms = max(0, math.ceil(job.delay_s * 1000))
    header = ENQUEUE_HEADER.pack(
        len(id_bytes), len(job.payload), len(codec), len(opts), job.priority, delay_ms, max_stalls
    )
    return b"".join((header, id_bytes, job.payload, codec, opts))


def brief(exc: BaseException, limit: int = 300) -> str:
    """One line of an exception's text, short enough for an error field or event."""
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def text(value: bytes | str) -> str:
    """Redis replies are bytes (``decode_responses=False``); ids and names are UTF-8."""
    return value if isinstance(value, str) else value.decode("utf-8", errors="replace")


def claimed_rows(flat: Sequence[Any], claimed_at: float) -> list[tuple[Claimed, str | None]]:
    """Claimed jobs from a claim reply, each with the reason its options are unusable
    (None when they validate)."""
    rows: list[tuple[Claimed, str | None]] = []
    for i in range(0, len(flat), CLAIM_ROW):
        job_id, token, payload, codec, opts, attempt, wait_ms = flat[i : i + CLAIM_ROW]
        problem: str | None = None
        try:
            options_json = opts.decode("utf-8")
            parse_job_options(options_json)
        except ValueError as exc:
            options_json = "{}"
            problem = f"the opts field does not validate: {brief(exc)}"
        claimed = Claimed(
            id=text(job_id),
            token=text(token),
            payload=bytes(payload),
            codec=text(codec),
            options_json=options_json,
            attempt=int(attempt),
            claimed_at=claimed_at,
            wait_s=int(wait_ms) / 1000,
        )
        rows.append((claimed, problem))
    return rows


def event(entry_id: bytes, fields: dict[bytes, bytes]) -> Event:
    data = {text(k): text(v) for k, v in fields.items()}
    kind = data.pop("kind", "")
    job_id = data.pop("job", "")
    return Event(id=text(entry_id), kind=kind, job_id=job_id, data=data)


def job_info(
    queue: str, job_id: str, fields: dict[bytes, bytes], history: Sequence[bytes]
) -> JobInfo:
    """``JobInfo`` from a job hash and its history list.

    Only an unreadable ``state`` raises ``BackendError`` (there is no job to show without
    it). Any other field, or attempt record, that does not parse is left at its default
    and listed in ``JobInfo.unreadable``: one damaged field must not hide the job's error,
    history and result from the user who wants to know what happened to it.
    """
    f = {text(k): v for k, v in fields.items()}
    unreadable: list[str] = []

    def read(name: str, parse: Callable[[bytes], T]) -> T | None:
        raw = f.get(name)
        if raw is None:
            return None
        try:
            return parse(raw)
        except ValueError as exc:
            unreadable.append(f"{name} ({raw[:60]!r}): {brief(exc)}")
            return None

    raw_state = f.get("state")
    try:
        state = JobState(text(raw_state)) if raw_state is not None else None
    except ValueError:
        state = None
    if state is None:
        raise BackendError(
            f"job {job_id!r} in queue {queue!r} has an unreadable state field ({raw_state!r})"
        )
    history_records: list[AttemptRecord] = []
    for n, raw in enumerate(history, 1):
        try:
            history_records.append(AttemptRecord.model_validate_json(raw))
        except ValueError as exc:
            unreadable.append(f"attempt record #{n} ({raw[:60]!r}): {brief(exc)}")
    return JobInfo(
        id=job_id,
        queue=queue,
        state=state,
        codec=read("codec", text) or "json",
        attempts=read("attempts", _count) or 0,
        stalls=read("stalls", _count) or 0,
        options=read("opts", parse_job_options) or JobOptions(),
        created_ms=read("created_ms", int),
        finished_ms=read("finished_ms", int),
        outcome=read("outcome", lambda raw: Outcome(raw.decode())),
        error=read("error", text),
        history=history_records,
        unreadable=unreadable,
    )


def _count(raw: bytes) -> int:
    value = int(raw)
    if value < 0:
        raise ValueError(f"a count cannot be negative: {value}")
    return value
