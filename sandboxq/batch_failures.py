"""A batch's failed and cancelled members grouped by outcome, and each outcome by kind:
what ``sandboxq batch``, its ``--json`` and the dashboard's batch page show.

    the batch's stream of finished members, from its start (a member's last entry says
    where it is) ──► the state, outcome and kind of error of those that ended failed or
    cancelled (Backend.outcomes: the kind is taken where the record is, from the error's
    first bytes; the error is never sent), a chunk a round trip ──► groups by outcome,
    the most first, each with its kinds, the most first, with a few job ids each

"error 298" said nothing of why: a member whose outcome is ``error`` (its handler raised)
has the type its record's error names as its kind (``ValueError``, ``pkg.mod.Bad``; see
``rules.error_kind``), ``other`` when that names none (an error written by hand, or
over the size a worker writes). Any other outcome is its own kind (``hard_timeout``,
``crashed``...), and so is each of the two groups below. An outcome's kinds add up to its
count: past ``KINDS`` of them, the fewest fold into ``other``.

A member whose record is gone (deleted by hand: a kept batch's members are never
removed) or damaged (a state that is none) is counted in a group of its own, ``MISSING``
or ``DAMAGED``, so the groups always add up to the batch's failed and cancelled counts:
left out, ``failed 4`` stood above groups adding up to 3, and nothing said why.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sandboxq.backends.base import Backend, JobStanding
from sandboxq.backends.rules import OTHER_KIND, error_kind
from sandboxq.batch import batch_not_found
from sandboxq.errors import DamagedRecord
from sandboxq.models import JobInfo, JobState, Outcome, member_id

__all__ = ["DAMAGED", "MISSING", "FailureGroup", "FailureKind", "Failures", "failures"]

#: Job ids shown per outcome, and per kind.
EXAMPLES = 5
#: Kinds shown per outcome (the rest fold into ``OTHER_KIND``): forged errors could make
#: every member a kind of its own.
KINDS = 10
#: Members whose outcome one round trip reads (read_outcome.lua, 250 a script call).
OUTCOMES_CHUNK = 2000
#: The groups of members whose record cannot say how they ended.
MISSING = "record missing"
DAMAGED = "record damaged"


@dataclass(slots=True)
class FailureKind:
    """The members of an outcome's group of one ``kind``: the type of error they raised
    (outcome ``error``), else the outcome itself; how many, and the first few ids."""

    kind: str
    count: int = 0
    job_ids: list[str] = field(default_factory=list)


@dataclass(slots=True)
class FailureGroup:
    """The members of a batch that ended with one ``outcome`` (failed or cancelled): how
    many, the first few ids, and ``kinds`` by count, most first (their counts add up to
    ``count``)."""

    outcome: str
    count: int = 0
    job_ids: list[str] = field(default_factory=list)
    kinds: list[FailureKind] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Failures:
    """``groups`` by count, most first; ``examined``: failed or cancelled members looked at,
    ``read``: finished-stream entries read (``complete``: all of them)."""

    groups: list[FailureGroup]
    examined: int
    read: int
    complete: bool


def failures(
    backend: Backend,
    batch_id: str,
    *,
    stream_limit: int | None = None,
    examples: int = EXAMPLES,
    kinds: int = KINDS,
) -> Failures:
    """A batch's failed and cancelled members grouped by their outcome, and each outcome by
    kind (at most ``kinds`` of them): its stream of finished members read from the start
    (a member's last entry says where it is; up to ``stream_limit`` entries: bounded work
    for a page), then the state, outcome and kind of those that ended failed or
    cancelled, ``OUTCOMES_CHUNK`` a round trip."""
    ended: dict[int, None] = {}  # failed or cancelled at their last entry, in stream order
    cursor, read = "0", 0
    complete = True
    while True:
        cursor, rows = backend.batch_finished(batch_id, cursor)
        if not rows:
            break
        read += len(rows)
        for index, state in rows:
            if state in (JobState.FAILED, JobState.CANCELLED):
                ended[index] = None
            else:
                ended.pop(index, None)
        if stream_limit is not None and read >= stream_limit:
            complete = False
            break
    groups: dict[str, FailureGroup] = {}
    by_kind: dict[tuple[str, str], FailureKind] = {}
    ids = [member_id(batch_id, index) for index in ended]
    for start in range(0, len(ids), OUTCOMES_CHUNK):
        chunk = ids[start : start + OUTCOMES_CHUNK]
        for job_id, found in zip(chunk, backend.outcomes(chunk), strict=True):
            where = ended_as(found) if found is not None else unreadable(backend, job_id)
            if where is None:
                continue  # retried since its entry was read
            outcome, kind = where
            group = groups.setdefault(outcome, FailureGroup(outcome))
            _count(group, job_id, examples)
            _count(by_kind.setdefault((outcome, kind), FailureKind(kind)), job_id, examples)
    # Records gone because the batch went (forgotten) are no members to count as missing.
    if ids and backend.batch_progress(batch_id) is None:
        raise batch_not_found(backend.queue, batch_id)
    for (outcome, _), sub in by_kind.items():
        groups[outcome].kinds.append(sub)
    ordered = sorted(groups.values(), key=lambda g: (-g.count, g.outcome))
    for group in ordered:
        group.kinds = _fold(group.kinds, kinds, examples)
    return Failures(ordered, len(ids), read, complete)


def _count(into: FailureGroup | FailureKind, job_id: str, examples: int) -> None:
    into.count += 1
    if len(into.job_ids) < examples:
        into.job_ids.append(job_id)


def _fold(found: list[FailureKind], most: int, examples: int) -> list[FailureKind]:
    """``found`` by count, most first, at most ``most`` of them: past that, the fewest are
    folded into ``OTHER_KIND`` (its own examples first), so the counts still add up."""
    ordered = sorted(found, key=lambda k: (-k.count, k.kind))
    if len(ordered) <= max(1, most):
        return ordered
    named = [k for k in ordered if k.kind != OTHER_KIND]
    kept, folded = named[: max(1, most) - 1], named[max(1, most) - 1 :]
    other = next((k for k in ordered if k.kind == OTHER_KIND), FailureKind(OTHER_KIND))
    for sub in folded:
        other.count += sub.count
        other.job_ids.extend(sub.job_ids[: examples - len(other.job_ids)])
    return sorted([*kept, other], key=lambda k: (-k.count, k.kind))


def ended_as(found: JobStanding | JobInfo) -> tuple[str, str] | None:
    """The group and kind of a member that ended failed or cancelled: its outcome (its
    state when it has none), and the kind of error it raised for an outcome of ``error``
    (else the outcome again); None when it is not final that way (retried since)."""
    if found.state not in (JobState.FAILED, JobState.CANCELLED):
        return None
    outcome = found.outcome.value if found.outcome else found.state.value
    if found.outcome is not Outcome.ERROR:
        return outcome, outcome
    if isinstance(found, JobInfo):  # read whole (unreadable): the same rule, applied here
        return outcome, error_kind(found.error)
    return outcome, found.error_kind or OTHER_KIND


def unreadable(backend: Backend, job_id: str) -> tuple[str, str] | None:
    """The group and kind of a member whose outcome could not be read
    (``Backend.outcomes`` says None for a record that is gone and for one whose state is
    none alike): its whole record tells which, ``MISSING`` or ``DAMAGED`` (each its own
    kind). Rare, so read one at a time."""
    try:
        info = backend.get(job_id)
    except DamagedRecord:
        return DAMAGED, DAMAGED
    return (MISSING, MISSING) if info is None else ended_as(info)
