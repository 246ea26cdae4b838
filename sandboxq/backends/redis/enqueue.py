"""New jobs as enqueue.lua takes them, for the sync and the asyncio client alike.

    NewJob ── frame_job (options checked: rules.job_options) ──► bytes: header + fields
    frames ── pack_enqueue (ENQUEUE_CHUNK jobs per script call) ──► packed script calls
    replies ── enqueued ──► (job id, created) per job

Framing is the only work a big batch costs in Python, so it is one ``struct`` header per
job and one argument per chunk (see lua/enqueue.lua for the layout).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from typing import Any

from sandboxq.backends import rules
from sandboxq.backends.base import NewJob
from sandboxq.backends.redis.scripts import Script
from sandboxq.errors import ConfigError

#: Jobs per enqueue script call; all chunks of one batch go in one round trip.
ENQUEUE_CHUNK = 500

#: One job inside enqueue.lua's framed argument: id, payload, codec and opts lengths,
#: priority, delay ms, max_stalls; then those four byte strings (see lua/enqueue.lua).
ENQUEUE_HEADER = struct.Struct(">HIHIhqH")


def frame_job(job_id: str, job: NewJob) -> bytes:
    """``job`` as enqueue.lua reads it. ``max_stalls`` is stored as its own field because
    Lua needs it at recovery."""
    max_stalls = rules.job_options(job_id, job).max_stalls
    id_bytes, codec, opts = job_id.encode(), job.codec.encode(), job.options_json.encode()
    if len(id_bytes) > 0xFFFF or len(job.payload) > 0xFFFFFFFF or len(opts) > 0xFFFFFFFF:
        raise ConfigError(f"job {job_id!r}: id, payload or options too large for one job")
    header = ENQUEUE_HEADER.pack(
        len(id_bytes),
        len(job.payload),
        len(codec),
        len(opts),
        job.priority,
        rules.ms(job.delay_s),
        max_stalls,
    )
    return b"".join((header, id_bytes, job.payload, codec, opts))


def frame_jobs(jobs: Sequence[NewJob]) -> tuple[list[str], list[bytes]]:
    """The ids of ``jobs`` (a new one where none was chosen) and each job framed for
    enqueue.lua; raises for a job whose options cannot be stored."""
    # 128 random bits each, like uuid4().hex, from one urandom call for the whole batch
    # (a call per job was most of the cost of framing a big batch on a loaded machine)
    rand = os.urandom(16 * len(jobs)).hex()
    ids = [job.job_id or rand[32 * i : 32 * i + 32] for i, job in enumerate(jobs)]
    return ids, [frame_job(job_id, job) for job_id, job in zip(ids, jobs, strict=True)]


def pack_enqueue(script: Script, frames: Sequence[bytes]) -> list[tuple[Script | None, bytes]]:
    """Enqueue calls for framed jobs, ``ENQUEUE_CHUNK`` jobs per call."""
    chunks = [frames[i : i + ENQUEUE_CHUNK] for i in range(0, len(frames), ENQUEUE_CHUNK)]
    return [(script, script.pack([len(chunk), b"".join(chunk)])) for chunk in chunks]


def enqueue_calls(
    script: Script, jobs: Sequence[NewJob]
) -> tuple[list[str], list[tuple[Script | None, bytes]]]:
    """The ids of ``jobs`` and the packed enqueue calls that add them (one per chunk)."""
    ids, frames = frame_jobs(jobs)
    return ids, pack_enqueue(script, frames)


def created_flags(replies: Sequence[Any]) -> list[bool]:
    """Whether each job was created, from the enqueue calls' replies, in order."""
    return [flag == 1 for reply in replies for flag in reply]


def enqueued(ids: list[str], replies: Sequence[Any]) -> list[tuple[str, bool]]:
    """(id, created) per job from the enqueue calls' replies."""
    return list(zip(ids, created_flags(replies), strict=True))
