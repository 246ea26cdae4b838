"""sandboxq: a job queue for CPU-heavy work whose handlers run in sandboxed child processes.

The errors are imported at once; the enums, ``Queue``, ``Job``, ``Pool``,
``SandboxWorker`` and ``current_job`` only when first used, so a producer that only
enqueues never loads process machinery, and a helper process of the pool never loads
pydantic.

The design (architecture, one job's path from enqueue to ack, the invariants, the Redis
model, the containment modes, the outcomes) is in docs/design.md; a comment that says
"design invariant N" refers to invariant N there.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from sandboxq.errors import (
    AttemptFailed,
    BackendError,
    BackendUnreachable,
    CodecRefused,
    ConfigError,
    DamagedRecord,
    JobFailed,
    JobNotFound,
    PoolBroken,
    ProcessorError,
    SandboxqError,
    SerializationError,
    SoftTimeout,
    WorkerFailed,
)

if TYPE_CHECKING:
    from sandboxq.client import Job, Queue
    from sandboxq.models import Action, JobState, Outcome
    from sandboxq.pool.child import current_job
    from sandboxq.pool.pool import Pool
    from sandboxq.worker import SandboxWorker

_LAZY = {
    # The enums live with the records (pydantic): loaded on first use, so that a process
    # that needs neither (the pool's guard, a child's start) does not pay for pydantic.
    "Action": "sandboxq.models",
    "JobState": "sandboxq.models",
    "Outcome": "sandboxq.models",
    "Pool": "sandboxq.pool.pool",
    "current_job": "sandboxq.pool.child",
    "Queue": "sandboxq.client",
    "Job": "sandboxq.client",
    "SandboxWorker": "sandboxq.worker",
}

__all__ = [
    "Action",
    "AttemptFailed",
    "BackendError",
    "BackendUnreachable",
    "CodecRefused",
    "ConfigError",
    "DamagedRecord",
    "Job",
    "JobFailed",
    "JobNotFound",
    "JobState",
    "Outcome",
    "Pool",
    "PoolBroken",
    "ProcessorError",
    "Queue",
    "SandboxWorker",
    "SandboxqError",
    "SerializationError",
    "SoftTimeout",
    "WorkerFailed",
    "current_job",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'sandboxq' has no attribute {name!r}")
