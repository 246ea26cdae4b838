"""What the dispatcher's main thread is told, by the threads around it.

    pool's supervisor thread ── AttemptEnded(token, result) ─────┐
                             ── ProgressReported(token, ...) ───┤
    fetcher thread (burst)   ── QueueEmpty() ───────────────────┤
                   (ending)  ── FetcherEnded() ─────────────────┼─► Dispatcher.events ─► run()
    SandboxWorker.stop()     ── StopAsked() ────────────────────┘

``token`` is the lease token of the attempt the event belongs to: the main thread looks
the attempt up by it, so an event of a lease no longer held finds nothing (dispatch.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from sandboxq.pool.attempt import AttemptResult


@dataclass(frozen=True, slots=True)
class AttemptEnded:
    """The attempt of lease ``token`` ended as ``result`` says: ack it (or drop it)."""

    token: str
    result: AttemptResult


@dataclass(frozen=True, slots=True)
class ProgressReported:
    """The handler of lease ``token`` reported progress: write it to the backend."""

    token: str
    fraction: float
    message: str | None


@dataclass(frozen=True, slots=True)
class QueueEmpty:
    """The burst fetcher found nothing waiting, delayed or active and ended: stop."""


@dataclass(frozen=True, slots=True)
class StopAsked:
    """``stop()`` was called: wakes the main thread, which reads the stop itself."""


@dataclass(frozen=True, slots=True)
class FetcherEnded:
    """The fetcher's loop returned (no claim is under way any more): wakes the main
    thread, which may be waiting for just that to return."""


DispatchEvent: TypeAlias = AttemptEnded | ProgressReported | QueueEmpty | StopAsked | FetcherEnded
