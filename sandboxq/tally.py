"""What a batch of acks came to, once the backend answered: counted, logged, and the
attempts that ended without an ack named for ``confirm_dead``.

    finish_many ─► (acks, accepted) ─► count_acks ─┬─► stats[completed|failed|retried|requeued]
                                                   ├─► one INFO record, a line per job
                                                   └─► rejected: Unacked ─► confirm_dead

A rejected ack means the lease was lost (or, when the acks were sent again after a call
that got no answer, that it may have been applied already): either way the attempt's
child has ended, which ``confirm_dead`` tells the backend.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Final, NamedTuple

from sandboxq.backends.base import Ack, Claimed, FinishAction

log = logging.getLogger("sandboxq.worker")

#: The ``stats`` entry an accepted ack counts in.
STAT_OF: Final[Mapping[FinishAction, str]] = {
    "complete": "completed",
    "fail": "failed",
    "retry": "retried",
    "requeue": "requeued",
}


class Unacked(NamedTuple):
    """An attempt that ended without an ack (lease lost, cancelled, ack rejected): its
    job's fence lifts once the backend is told (``Backend.confirm_dead``)."""

    job_id: str
    token: str  # the lease token


def count_acks(
    acks: list[tuple[Claimed, Ack]],
    accepted: list[bool],
    stats: dict[str, int],
    maybe_applied: bool = False,
) -> list[Unacked]:
    """Count and log what the backend answered; returns the attempts it did not ack
    (``maybe_applied``: the acks were sent again after a call without an answer, so a
    rejection may be of an applied ack).

    The lines of one batch go out as one record: under load a batch holds many jobs,
    and a record per job (format, write, flush) was a third of this thread's time.
    The command line's formatter puts its prefix in front of every line.
    """
    unacked: list[Unacked] = []
    lines: list[str] | None = [] if log.isEnabledFor(logging.INFO) else None
    for (job, ack), ok in zip(acks, accepted, strict=True):
        if not ok and maybe_applied:
            log.warning("job %s: ack rejected when sent again: it may have been applied", job.id)
            unacked.append(Unacked(job.id, job.token))
            continue
        if not ok:
            stats["rejected_acks"] += 1
            log.warning("job %s: ack rejected, the lease was lost; result discarded", job.id)
            unacked.append(Unacked(job.id, job.token))  # its child has ended all the same
            continue
        stats[STAT_OF[ack.action]] += 1
        if lines is not None:
            cause = f" ({ack.error})" if ack.error else ""
            outcome = ack.attempt.outcome.value
            lines.append(f"job {job.id} attempt {job.attempt}: {outcome} -> {ack.action}{cause}")
    if lines:
        log.info("%s", "\n".join(lines))
    return unacked
