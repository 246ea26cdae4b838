"""Translation between what the scripts read and return and sandboxq data: job hashes into
``JobInfo``, claim replies into ``Claimed``, stream entries into ``Event``, worker records
into dicts (new jobs are framed in enqueue.py). Nothing here talks to Redis.

A record that cannot be read raises ``BackendError`` naming the queue, the job and the
field, so "why can't I see my job" has an answer too.

Everything read back is treated as hostile input (a shared Redis can be written by
anyone with access): every stored text is capped at ``MAX_FIELD_BYTES`` (a field over it
is listed, with its size and the cap, instead of read), a job's history is read from its
end, ``MAX_HISTORY`` records at most, and a worker's registry record is checked field by
field. A damaged part is listed in ``unreadable``; the rest stays readable.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from pydantic import ValidationError

from sandboxq.backends import rules
from sandboxq.backends.base import Claimed, Event, JobStanding
from sandboxq.backends.redis.keys import QueueKeys
from sandboxq.backends.rules import brief
from sandboxq.codec import DEFAULT_MAX_BYTES
from sandboxq.errors import DamagedRecord
from sandboxq.models import (
    LARGEST_STORED,
    AttemptRecord,
    JobInfo,
    JobOptions,
    JobState,
    Outcome,
    RunningAttempt,
    parse_job_options,
    stored_int,
)
from sandboxq.settings import invalid

T = TypeVar("T")

#: Largest stored text a reader takes in: a job field, attempt record, event field or
#: worker record. Results and payloads have their own cap (``codec.DEFAULT_MAX_BYTES``).
MAX_FIELD_BYTES = rules.MAX_FIELD_BYTES

#: The longest state a waiter takes in (a real one is a few letters).
MAX_STATE_BYTES = 64

#: A claimed job's payload over this fails the job instead of reaching a child.
MAX_PAYLOAD_BYTES = DEFAULT_MAX_BYTES
#: Longest codec name a claimed job may carry.
MAX_CODEC_BYTES = 32

#: Attempt records read per job, the newest ones: as many as a job keeps.
MAX_HISTORY = rules.HISTORY_CAP

#: The job hash fields ``job_info`` reads (never the payload or the result).
INFO_FIELDS = (
    "state",
    "codec",
    "attempts",
    "stalls",
    "infra_deaths",
    "opts",
    "created_ms",
    "finished_ms",
    "outcome",
    "error",
    "owner",
    "claimed_ms",
    "uncharged",
    *(SOLE_ATTEMPT_FIELDS := ("worker_id", "pid", "started_ms", "ended_ms")),
    *(SOLE_ATTEMPT_FIGURES := ("memory_limit_mb", "peak_memory_mb")),
)


#: What each queue-level key holds (``TYPE``'s answer); a key holding anything else was
#: changed by hand, and the queue stops with an error naming it.
def queue_key_types(keys: QueueKeys) -> dict[str, str]:
    return {
        keys.waiting: "zset",
        keys.delayed: "zset",
        keys.active: "zset",
        keys.completed: "zset",
        keys.failed: "zset",
        keys.cancelled: "zset",
        keys.seq: "string",
        keys.events: "stream",
        keys.wake: "list",
        keys.workers: "set",
        keys.batches: "zset",
        keys.batch_index: "zset",
        keys.expiry: "zset",
        keys.trims: "hash",
        keys.guard: "zset",
    }


def over_cap(size: int, cap: int = MAX_FIELD_BYTES) -> str:
    return f"{size} bytes, over the read limit of {cap} bytes"


#: Entries per claimed job in a claim/finish reply (common.lua's claim_jobs).
CLAIM_ROW = rules.CLAIM_ROW


def text(value: bytes | str) -> str:
    """Redis replies are bytes (``decode_responses=False``); ids and names are UTF-8."""
    return value if isinstance(value, str) else value.decode("utf-8", errors="replace")


def standing(row: object) -> JobStanding | None:
    """A job's read_outcome.lua reply ``{state, outcome, attempts, kind}``: None for no
    such job or a state that is none (written by hand); an outcome that is none reads as
    absent, attempts that are no count as 0; the kind, a name the script checked."""
    if not isinstance(row, list) or len(row) != 4 or not isinstance(row[0], bytes):
        return None
    try:
        state = JobState(text(row[0]))
    except ValueError:
        return None
    try:
        outcome = Outcome(text(row[1])) if isinstance(row[1], bytes) else None
    except ValueError:
        outcome = None
    try:
        attempts = max(0, stored_int(row[2])) if isinstance(row[2], bytes) else 0
    except ValueError:
        attempts = 0
    kind = text(row[3][: rules.ERROR_KIND_HEAD]) if isinstance(row[3], bytes) else None
    return JobStanding(state, outcome, attempts, kind)


def claimed_rows(flat: Sequence[Any], claimed_at: float) -> list[tuple[Claimed, str | None]]:
    """Claimed jobs from a claim reply, each with the reason its options are unusable
    (None when they validate)."""
    rows: list[tuple[Claimed, str | None]] = []
    for i in range(0, len(flat), CLAIM_ROW):
        job_id, token, payload, codec, opts, attempt, wait_ms, deaths, number, age_ms = flat[
            i : i + CLAIM_ROW
        ]
        problem: str | None = None
        try:
            options = parse_job_options(opts.decode("utf-8"))
        except ValidationError as exc:
            options = JobOptions()
            problem = f"the opts field does not validate: {brief(invalid(JobOptions, exc))}"
        except ValueError as exc:  # not UTF-8
            options = JobOptions()
            problem = f"the opts field does not validate: {brief(exc)}"
        if len(payload) > MAX_PAYLOAD_BYTES:  # never handed to a child to decode
            problem = f"the payload is {over_cap(len(payload), MAX_PAYLOAD_BYTES)}"
            payload = b""
        if len(codec) > MAX_CODEC_BYTES:  # a codec name, not a message to store
            problem = f"the codec field is {over_cap(len(codec), MAX_CODEC_BYTES)}"
            codec = b"?"
        claimed = Claimed(
            id=text(job_id),
            token=text(token),
            payload=bytes(payload),
            codec=text(codec),
            options=options,
            attempt=int(attempt),
            claimed_at=claimed_at,
            # a replayed claim (lua/finish.lua) says -1: it was measured when first made
            wait_s=int(wait_ms) / 1000 if int(wait_ms) >= 0 else None,
            infra_deaths=int(deaths),
            number=int(number),
            age_s=int(age_ms) / 1000,
        )
        rows.append((claimed, problem))
    return rows


def capped(value: bytes | str) -> str:
    """A stored text, or what it was if it is over ``MAX_FIELD_BYTES``."""
    if len(value) > MAX_FIELD_BYTES:
        return f"<{over_cap(len(value))}>"
    return text(value)


def event(entry_id: bytes, fields: dict[bytes, bytes]) -> Event:
    data = {capped(k): capped(v) for k, v in fields.items()}
    kind = data.pop("kind", "")
    job_id = data.pop("job", "")
    return Event(id=text(entry_id), kind=kind, job_id=job_id, data=data)


def job_info(
    queue: str,
    job_id: str,
    fields: dict[bytes, bytes],
    history: Sequence[bytes | int],
    *,
    oversized: dict[str, int] | None = None,
    damaged: Sequence[str] = (),
    history_total: int | None = None,
    running: RunningAttempt | None = None,
) -> JobInfo:
    """``JobInfo`` from a job hash and its history list (a completed job's sole attempt
    may be in the hash instead: ``sole_attempt``).

    ``oversized`` names the fields left unread because they are over ``MAX_FIELD_BYTES``
    (with their sizes); ``damaged`` lists what the caller already found unreadable (a
    history key of the wrong type); ``history_total`` is the length of the whole history
    list when ``history`` holds only its newest entries. An entry of ``history`` that is
    an int is the size of a record left unread, over the cap.

    Only an unreadable ``state`` raises ``BackendError`` (there is no job to show without
    it). Any other field, or attempt record, that does not parse is left at its default
    and listed in ``JobInfo.unreadable``: one damaged field must not hide the job's error,
    history and result from the user who wants to know what happened to it.
    """
    f = {text(k): v for k, v in fields.items()}
    unreadable: list[str] = list(damaged)
    for name, size in (oversized or {}).items():
        if name == "state":
            raise DamagedRecord(
                f"job {job_id!r} in queue {queue!r} has an unreadable state field "
                f"({over_cap(size)})"
            )
        unreadable.append(f"{name}: {over_cap(size)}")

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
        raise DamagedRecord(
            f"job {job_id!r} in queue {queue!r} has an unreadable state field ({raw_state!r})"
        )
    history_records = _attempt_records(history, history_total, sole_attempt(f), unreadable)
    return JobInfo(
        id=job_id,
        queue=queue,
        state=state,
        # Exactly what is stored ("" stays ""): readers check it against their own codecs.
        codec=_codec(f, oversized or {}),
        # charged: what the retry budget counts (the history's numbers count them all)
        attempts=max(0, (read("attempts", _count) or 0) - (read("uncharged", _count) or 0)),
        stalls=read("stalls", _count) or 0,
        infra_deaths=read("infra_deaths", _count) or 0,
        options=read("opts", parse_job_options) or JobOptions(),
        created_ms=read("created_ms", stored_int),
        finished_ms=read("finished_ms", stored_int),
        outcome=read("outcome", lambda raw: Outcome(raw.decode())),
        error=read("error", text),
        history=history_records,
        running=running if state is JobState.ACTIVE else None,
        unreadable=unreadable,
    )


def _attempt_records(
    history: Sequence[bytes | int],
    total: int | None,
    sole: bytes | None,
    unreadable: list[str],
) -> list[AttemptRecord]:
    """The records of ``history`` (the newest of ``total``), then the sole attempt kept in
    the hash, if any; each one that does not parse is listed in ``unreadable``."""
    out: list[AttemptRecord] = []
    skipped = max(0, (total or 0) - len(history))
    if skipped:
        unreadable.append(f"only the newest {len(history)} of {total} attempt records are read")
    if sole is not None:
        history = [*history, sole]
    for n, raw in enumerate(history, 1 + skipped):
        size = raw if isinstance(raw, int) else len(raw)  # read_job.lua sends only the size
        if isinstance(raw, int) or size > MAX_FIELD_BYTES:
            unreadable.append(f"attempt record #{n}: {over_cap(size)}")
            continue
        try:
            out.append(AttemptRecord.model_validate_json(raw))
        except ValidationError as exc:  # said without the link to pydantic's pages
            problem = brief(invalid(AttemptRecord, exc))
            unreadable.append(f"attempt record #{n} ({raw[:60]!r}): {problem}")
        except ValueError as exc:
            unreadable.append(f"attempt record #{n} ({raw[:60]!r}): {brief(exc)}")
    return out


def sole_attempt(fields: dict[str, bytes]) -> bytes | None:
    """The attempt record of a completed job whose only attempt is kept in its hash
    (common.lua's sole_attempt: ``worker_id``, ``pid``, ``started_ms``, ``ended_ms``, and
    the memory figures when it ran under a limit), as the JSON the worker sent; None when
    the hash holds none. Parsed as any record is, so a field changed by hand is reported,
    not trusted."""
    if any(name not in fields for name in SOLE_ATTEMPT_FIELDS):
        return None
    record: dict[str, Any] = {
        "attempt": 1,
        "outcome": text(fields.get("outcome", b"")),
        "action": "complete",
        "worker_id": text(fields["worker_id"]),
    }
    for name in ("pid", "started_ms", "ended_ms"):
        value = text(fields[name])
        record[name] = int(value) if value.isdecimal() else value  # else: reported
    for name in SOLE_ATTEMPT_FIGURES:
        if name in fields:
            value = text(fields[name])
            try:
                figure = float(value)
            except ValueError:
                figure = math.nan
            record[name] = figure if math.isfinite(figure) else value  # else: reported
    return json.dumps(record, separators=(",", ":")).encode()


def running_attempt(
    job_id: str,
    fields: dict[bytes, bytes],
    lease_expiry_ms: float | None,
    owner_record: bytes | None,
) -> RunningAttempt:
    """The attempt an active job is in, from its hash (``attempts``, ``owner``,
    ``claimed_ms``), its lease's expiry and its owner's registry record (the child's pid,
    once the owner's heartbeat published it)."""
    owner = text(fields[b"owner"]) if b"owner" in fields else None
    child = rules.RunningChild(None)
    if owner is not None and owner_record is not None:
        child = rules.running_child(worker_record(owner, owner_record), job_id)
    claimed_ms = _count_or_none(fields.get(b"claimed_ms"))
    return RunningAttempt(
        attempt=_count_or_zero(fields.get(b"attempts")),
        worker_id=owner,
        pid=child.pid,
        # when its child took it; a job claimed ahead waited in its worker before that
        started_ms=child.started_ms if child.started_ms is not None else claimed_ms,
        lease_expires_ms=_score_ms(lease_expiry_ms),
    )


def _score_ms(score: float | None) -> int | None:
    """A time in ms kept as a sorted set's score (a lease's expiry); None for one no clock
    can show (``+inf``, or beyond ``LARGEST_STORED``: written by hand)."""
    if score is None or not math.isfinite(score) or abs(score) > LARGEST_STORED:
        return None
    return int(score)


def _count_or_none(raw: bytes | None) -> int | None:
    try:
        return None if raw is None else _count(raw)
    except ValueError:
        return None


def _count_or_zero(raw: bytes | None) -> int:
    return _count_or_none(raw) or 0


def _codec(fields: dict[str, bytes], oversized: dict[str, int]) -> str:
    if "codec" in oversized:
        return f"<{over_cap(oversized['codec'])}>"
    return text(fields["codec"]) if "codec" in fields else "json"


def worker_record(
    worker_id: str, raw: bytes | str, ttl_left_ms: int | None = None
) -> dict[str, Any]:
    """A worker's registry record, checked: fields of the wrong type become None and every
    problem is listed under ``unreadable`` (a record is another process's word, and a
    shared Redis anyone's). With ``ttl_left_ms`` (its key's PTTL), ``age_ms`` says how long
    ago it was written by the server's clock: ``registered_ms`` is the worker's own."""
    unreadable: list[str] = []
    data: Any = {}
    if len(raw) > MAX_FIELD_BYTES:
        unreadable.append(f"the record is {over_cap(len(raw))}")
    else:
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            unreadable.append(f"the record is not JSON: {brief(exc, 120)}")
        if not isinstance(data, dict):
            if not unreadable:
                unreadable.append(f"the record is a JSON {type(data).__name__}, not an object")
            data = {}
    record: dict[str, Any] = {**data, "worker_id": worker_id}
    for name, kinds in _WORKER_FIELDS.items():
        if name in record and not _is(record[name], kinds):
            unreadable.append(f"{name} ({_clip_repr(record[name])}) is not {_KIND_NAMES[kinds]}")
            record[name] = None
    if "jobs" in record:
        record["jobs"] = _checked_jobs(record["jobs"], unreadable)
    ttl_ms = record.get("ttl_ms")
    if ttl_left_ms is not None and ttl_left_ms >= 0 and isinstance(ttl_ms, int):
        record["age_ms"] = max(0, ttl_ms - ttl_left_ms)
    if unreadable:
        record["unreadable"] = unreadable
    return record


def _checked_jobs(jobs: Any, unreadable: list[str]) -> list[dict[str, Any]]:
    """A worker record's ``jobs``, checked like the record: what is wrong becomes None
    (or is left out) and is listed in ``unreadable``."""
    if jobs is not None and not isinstance(jobs, list):
        unreadable.append(f"jobs ({_clip_repr(jobs)}) is not a list")
        return []
    checked = []
    for n, job in enumerate(jobs or [], 1):
        if not isinstance(job, dict):
            unreadable.append(f"jobs[{n}] ({_clip_repr(job)}) is not an object")
            continue
        job = dict(job)
        for name, kinds in _WORKER_JOB_FIELDS.items():
            if name in job and not _is(job[name], kinds):
                unreadable.append(f"jobs[{n}].{name} ({_clip_repr(job[name])}) is not "
                                  f"{_KIND_NAMES[kinds]}")  # fmt: skip
                job[name] = None
        checked.append(job)
    return checked


_Kinds = tuple[type, ...]
_INT: _Kinds = (int,)
_NUMBER: _Kinds = (int, float)
_STR: _Kinds = (str,)
_KIND_NAMES: dict[_Kinds, str] = {_INT: "an integer", _NUMBER: "a finite number", _STR: "a string"}
_WORKER_FIELDS: dict[str, _Kinds] = {
    "host": _STR,
    "pid": _INT,
    "queue": _STR,
    "concurrency": _INT,
    "started_ms": _INT,
    "registered_ms": _INT,
    "ttl_ms": _INT,
    "lease_s": _NUMBER,
    "protections": _STR,
}
_WORKER_JOB_FIELDS: dict[str, _Kinds] = {
    "id": _STR,
    "attempt": _INT,
    "pid": _INT,
    "started_ms": _INT,
    "lease_renewed_s_ago": _NUMBER,
}


def _is(value: Any, kinds: _Kinds) -> bool:
    if value is None:
        return True
    if isinstance(value, bool) or not isinstance(value, kinds):
        return False
    if isinstance(value, float):
        return math.isfinite(value) and abs(value) < LARGEST_STORED
    if isinstance(value, int):
        return abs(value) < LARGEST_STORED
    return isinstance(value, str) and len(value) <= 1000


def _clip_repr(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."


def _count(raw: bytes) -> int:
    value = stored_int(raw)
    if value < 0:
        raise ValueError(f"a count cannot be negative: {value}")
    return value
