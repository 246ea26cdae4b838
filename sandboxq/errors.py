"""The exception tree. Every error of sandboxq's own (settings, a job, a worker, a pool, a
backend, a stored record) derives from ``SandboxqError``; a call made wrongly gets what
Python would raise (``current_job().progress(2)``: ValueError; ``Pool.submit`` after
``shutdown``: RuntimeError, as in ``concurrent.futures``).

    SandboxqError
    ├── ConfigError            invalid settings or job options (also a ValueError)
    ├── ProcessorError         "pkg.mod:fn" cannot be imported or is not callable, or its
    │                          import hung (also an ImportError)
    ├── SerializationError     a payload cannot be encoded/decoded, or is too large (also a
    │   │                      TypeError)
    │   └── CodecRefused       a stored record claims a codec its reader did not opt into
    ├── AttemptFailed          one attempt ended other than ``ok`` (outcome, pid, exitcode,
    │                          signal, remote traceback): what ``Pool.submit``'s future raises
    ├── JobFailed              a job ended ``failed`` or ``cancelled`` (its last attempt's cause)
    ├── JobNotFound            the job does not exist (never enqueued, trimmed, purged)
    ├── BatchNotFound          the batch does not exist (never made, forgotten, expired)
    ├── BatchIncomplete        a batch's enqueue failed part-way: ``batch_id`` and how many
    │                          of its members exist (``enqueued`` of ``total``)
    ├── WorkerFailed           a part of a worker died; it handed its jobs back and stopped
    ├── PoolBroken             the pool cannot serve: children die before they are ready, its
    │                          fork server keeps dying, or its supervisor thread crashed
    └── BackendError           the backend is unreachable or answered something unexpected
        ├── BackendUnreachable no answer: refused, timed out, the connection lost, no master
        │                      known (a failover); a wait (a result, a batch) tries again
        └── DamagedRecord      the server answered, but a key or record in it is not what
                               sandboxq writes (changed by hand, forged): only its readers fail

    SoftTimeout                raised *inside a handler* at the soft deadline; derives from
                               ``Exception`` (not from SandboxqError) so ``except Exception``
                               cleanup in user code sees it and ``finally`` blocks run.

Errors keep their fields when pickled: one raised in a child (the ``SerializationError`` of
a result too large to send) crosses the pipe to the parent whole, as the ``__cause__`` of
the attempt's ``AttemptFailed``. Job records store an attempt's cause as text, and the
producer builds ``JobFailed`` from it.
"""

from __future__ import annotations

from typing import Any


class SandboxqError(Exception):
    """Root of every sandboxq error.

    Subclasses declare their fields in ``_fields``; ``__reduce__`` rebuilds them so an
    error survives pickling with every field intact (the default Exception pickling keeps
    only ``args``).
    """

    _fields: tuple[str, ...] = ()

    def __init__(self, message: str = "", **fields: Any) -> None:
        super().__init__(message)
        self.message = message
        for name in self._fields:
            setattr(self, name, fields.pop(name, None))
        if fields:
            raise TypeError(f"{type(self).__name__} got unknown fields: {sorted(fields)}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.message, {n: getattr(self, n) for n in self._fields}))

    def __str__(self) -> str:
        return self.message


def _rebuild(cls: type[SandboxqError], message: str, fields: dict[str, Any]) -> SandboxqError:
    return cls(message, **fields)


class ConfigError(SandboxqError, ValueError):
    """Settings or job options that cannot work together (soft >= hard, unknown names...)."""


class ProcessorError(SandboxqError, ImportError):
    """A processor path that does not resolve to a callable."""

    _fields = ("processor",)


class SerializationError(SandboxqError, TypeError):
    """A value the codec cannot encode or decode, or one over the size limit."""


class CodecRefused(SerializationError):
    """A stored record claims a codec its reader did not opt into (or no codec at all):
    nothing in it was decoded. ``codec`` is what the record claimed, clipped."""

    _fields = ("job_id", "codec")
    job_id: str | None
    codec: str | None


class AttemptFailed(SandboxqError):
    """One attempt that did not end ``ok``.

    ``outcome`` is the outcome name (``"error"``, ``"hard_timeout"``, ``"crashed"``...).
    ``exitcode`` / ``signal`` / ``pid`` are set where they apply; ``error_type`` and
    ``remote_traceback`` describe an exception raised in the child (for a child killed at
    its deadline, soft-timed-out or crashed, ``remote_traceback`` is the stack it was in).
    When the child's exception could be unpickled it is also chained as ``__cause__``.
    """

    _fields = ("outcome", "pid", "exitcode", "signal", "error_type", "remote_traceback")
    outcome: str
    pid: int | None
    exitcode: int | None
    signal: int | None
    error_type: str | None
    remote_traceback: str | None


class JobFailed(SandboxqError):
    """A job whose final state is ``failed`` or ``cancelled``. ``traceback`` and ``output``
    are its last attempt's (``AttemptRecord``): where the handler raised, or the stack it
    was in when it was stopped or crashed, and the end of what it wrote."""

    _fields = ("job_id", "outcome", "attempts", "error", "traceback", "output")
    job_id: str
    outcome: str | None
    attempts: int
    error: str | None
    traceback: str | None
    output: str | None


class JobNotFound(SandboxqError):
    """The job does not exist: never enqueued, trimmed by retention, or purged."""

    _fields = ("job_id",)
    job_id: str


class BatchNotFound(SandboxqError):
    """The batch does not exist: never made, forgotten, or past its ``batch_ttl_s``
    (``expired_ms``: when it expired, when that is known; retention may still be deleting
    what is left of it)."""

    _fields = ("batch_id", "expired_ms")
    batch_id: str
    expired_ms: int | None


class BatchIncomplete(SandboxqError):
    """A batch's enqueue failed part-way: ``enqueued`` of its ``total`` members exist (they
    run as usual) and the batch is not sealed, so it is never done and sends no follow-up.
    ``Queue.get_batch(batch_id)`` reaches them (``cancel()`` stops them)."""

    _fields = ("batch_id", "enqueued", "total")
    batch_id: str
    enqueued: int
    total: int


class WorkerFailed(SandboxqError):
    """A part of a worker (a thread, the pool) died: it stopped claiming, handed back the
    jobs it held uncharged and stopped. The message names the cause, on one line."""


class PoolBroken(SandboxqError):
    """The pool cannot serve: children die before they are ready, again and again, its fork
    server keeps dying, or its supervisor thread crashed."""


class BackendError(SandboxqError):
    """The backend could not be reached or returned something it should not have."""


class BackendUnreachable(BackendError):
    """The backend did not answer: the connection was refused, timed out or was lost, or
    no master is known (a Sentinel failover in progress). A wait for a job's result or a
    batch's members tries again until its timeout (``finished.Outage``); other calls raise
    it at once."""


class DamagedRecord(BackendError):
    """The backend answered, but a key or record in it is not what sandboxq writes (a key
    of another type, a state no job has: changed by hand, or forged). The server is up:
    what reads that record fails, naming it, and everything else goes on."""


class SoftTimeout(Exception):
    """Raised inside a handler when its soft deadline passes: clean up and return or raise.

    If the handler swallows it and keeps running, the child is killed at the hard deadline.
    """
