"""A batch's failed and cancelled members grouped by outcome: what ``sandboxq batch`` and
the dashboard's batch page show.

    the batch's stream of finished members, from its start (a member's last entry says
    where it is) ──► the state and outcome of those that ended failed or cancelled
    (Backend.outcomes), a chunk a round trip ──► groups by outcome, the most first,
    with a few job ids each

A member whose record is gone (deleted by hand: a kept batch's members are never
removed) or damaged (a state that is none) is counted in a group of its own, ``MISSING``
or ``DAMAGED``, so the groups always add up to the batch's failed and cancelled counts:
left out, ``failed 4`` stood above groups adding up to 3, and nothing said why.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sandboxq.backends.base import Backend, JobStanding
from sandboxq.batch import batch_not_found
from sandboxq.errors import DamagedRecord
from sandboxq.models import JobInfo, JobState, member_id

__all__ = ["DAMAGED", "MISSING", "FailureGroup", "Failures", "failures"]

#: Job ids shown per outcome.
EXAMPLES = 5
#: Members whose outcome one round trip reads (two fields each).
OUTCOMES_CHUNK = 2000
#: The groups of members whose record cannot say how they ended.
MISSING = "record missing"
DAMAGED = "record damaged"


@dataclass(slots=True)
class FailureGroup:
    """The members of a batch that ended with one ``outcome`` (failed or cancelled): how
    many, and the first few ids."""

    outcome: str
    count: int = 0
    job_ids: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Failures:
    """``groups`` by count, most first; ``examined``: failed or cancelled members looked at,
    ``read``: finished-stream entries read (``complete``: all of them)."""

    groups: list[FailureGroup]
    examined: int
    read: int
    complete: bool


def failures(
    backend: Backend, batch_id: str, *, stream_limit: int | None = None, examples: int = EXAMPLES
) -> Failures:
    """A batch's failed and cancelled members grouped by their outcome: its stream of
    finished members read from the start (a member's last entry says where it is; up to
    ``stream_limit`` entries: bounded work for a page), then the state and outcome of
    those that ended failed or cancelled, ``OUTCOMES_CHUNK`` a round trip."""
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
    ids = [member_id(batch_id, index) for index in ended]
    for start in range(0, len(ids), OUTCOMES_CHUNK):
        chunk = ids[start : start + OUTCOMES_CHUNK]
        for job_id, found in zip(chunk, backend.outcomes(chunk), strict=True):
            outcome = ended_as(found) if found is not None else unreadable(backend, job_id)
            if outcome is None:
                continue  # retried since its entry was read
            group = groups.setdefault(outcome, FailureGroup(outcome))
            group.count += 1
            if len(group.job_ids) < examples:
                group.job_ids.append(job_id)
    # Records gone because the batch went (forgotten) are no members to count as missing.
    if ids and backend.batch_progress(batch_id) is None:
        raise batch_not_found(backend.queue, batch_id)
    ordered = sorted(groups.values(), key=lambda g: (-g.count, g.outcome))
    return Failures(ordered, len(ids), read, complete)


def ended_as(found: JobStanding | JobInfo) -> str | None:
    """The group of a member that ended failed or cancelled: its outcome (its state when
    it has none); None when it is not final that way (retried since)."""
    if found.state not in (JobState.FAILED, JobState.CANCELLED):
        return None
    return found.outcome.value if found.outcome else found.state.value


def unreadable(backend: Backend, job_id: str) -> str | None:
    """The group of a member whose outcome could not be read (``Backend.outcomes`` says
    None for a record that is gone and for one whose state is none alike): its whole
    record tells which, ``MISSING`` or ``DAMAGED``. Rare, so read one at a time."""
    try:
        info = backend.get(job_id)
    except DamagedRecord:
        return DAMAGED
    return MISSING if info is None else ended_as(info)
