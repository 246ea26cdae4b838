"""The messages that cross a child's pipe. Each child has its own duplex pipe:

    parent ── Run ──────────────────────────►  child
    parent ◄── Ready | Progress | Finished | Failed ──  child

``Ready`` is sent once, after the child has imported its processor. The parent may send
several ``Run`` ahead (queued in the channel while jobs are short); the child runs one at
a time and answers each with exactly one ``Finished`` or ``Failed`` (or by dying), except
one the parent withdrew before it started, which it skips without a word. Every message
about an attempt (all but ``Ready``) carries its ``task_id``, so the parent can drop a
stale message instead of crediting it to the wrong attempt.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import Any

from sandboxq.codec import CodecName


class _Message:
    """Pickles as (class, field values): several times faster than the default for slotted
    dataclasses, which walks ``dataclasses.fields()`` on every message."""

    __slots__ = ()
    __match_args__: tuple[str, ...]

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), _values[type(self)](self))


_values: dict[type, Any] = {}


def _message(cls: type) -> type:
    fields: tuple[str, ...] = cls.__match_args__  # type: ignore[attr-defined]
    get = attrgetter(*fields)
    _values[cls] = (lambda m: (get(m),)) if len(fields) == 1 else get
    return cls


@_message
@dataclass(frozen=True, slots=True)
class Run(_Message):
    task_id: int
    payload: bytes  # encoded [args, kwargs]
    codec: CodecName
    max_result_bytes: int
    job_id: str | None = None
    attempt: int = 1
    trace: str | None = None  # the attempt span's traceparent (tracing.enter_attempt)


@_message
@dataclass(frozen=True, slots=True)
class Ready(_Message):
    pid: int


@_message
@dataclass(frozen=True, slots=True)
class Progress(_Message):
    task_id: int
    fraction: float
    message: str | None


@_message
@dataclass(frozen=True, slots=True)
class Finished(_Message):
    task_id: int
    result: bytes  # encoded with the Run's codec
    #: A traced (sampled) attempt's peak resident memory, bytes, read by the child as it
    #: ended (tracing.attempt_peak): the parent reads too late when the child went
    #: straight on to a task queued in its channel, which reset the peak.
    peak_rss: int | None = None


@_message
@dataclass(frozen=True, slots=True)
class RemoteError(_Message):
    """An exception raised in the child, described so it always crosses the pipe."""

    type_name: str
    message: str
    traceback: str
    pickled: bytes | None  # the exception itself, when it pickles and unpickles


@_message
@dataclass(frozen=True, slots=True)
class Failed(_Message):
    task_id: int
    error: RemoteError
    peak_rss: int | None = None  # as Finished's


ChildMessage = Ready | Progress | Finished | Failed
