"""sandboxq: a job queue for CPU-heavy work whose handlers run in sandboxed child processes.

The errors and the enums are imported at once; ``Queue``, ``Job``, ``Pool``,
``SandboxWorker`` and ``current_job`` only when first used, so a producer that only
enqueues never loads process machinery.

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
    CodecRefused,
    ConfigError,
    JobFailed,
    JobNotFound,
    PoolBroken,
    ProcessorError,
    SandboxqError,
    SerializationError,
    SoftTimeout,
    WorkerFailed,
)
from sandboxq.models import Action, JobState, Outcome

if TYPE_CHECKING:
    from sandboxq.client import Job, Queue
    from sandboxq.pool.child import current_job
    from sandboxq.pool.pool import Pool
    from sandboxq.worker import SandboxWorker

_LAZY = {
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
    "CodecRefused",
    "ConfigError",
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
