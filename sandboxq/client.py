"""The producer API: ``Queue`` (enqueue, counts, events) and ``Job`` (state, result, cancel).

Importing this module loads no process machinery: producers only need a backend.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from sandboxq import codec as codecs
from sandboxq.backends import open_backend
from sandboxq.backends.base import Backend, Event, NewJob
from sandboxq.errors import ConfigError, JobFailed, JobNotFound, SandboxqError, SerializationError
from sandboxq.models import JobInfo, JobOptions, JobState, check_job_id
from sandboxq.settings import build

Call = tuple[Sequence[Any], dict[str, Any]]


class Job:
    """A handle on one job; every call asks the backend afresh."""

    def __init__(self, queue: Queue, job_id: str) -> None:
        self.queue = queue
        self.id = job_id

    def __repr__(self) -> str:
        return f"Job({self.queue.name!r}, {self.id!r})"

    def info(self) -> JobInfo:
        info = self.queue.backend.get(self.id)
        if info is None:
            raise self._not_found()
        return info

    def _not_found(self) -> JobNotFound:
        return JobNotFound(
            f"job {self.id!r} of queue {self.queue.name!r} does not exist "
            "(never enqueued, removed by retention, or purged)",
            job_id=self.id,
        )

    def state(self) -> JobState:
        return self.info().state

    def result(self, timeout_s: float | None = None) -> Any:
        """The job's return value once it completes.

        Raises ``JobFailed`` (with ``.outcome``, ``.attempts``, ``.error``) if it failed or
        was cancelled, ``JobNotFound`` at once if the job does not exist (or is removed by
        retention or a purge while waited for), and ``TimeoutError`` if it is not finished
        within ``timeout_s``.
        """
        _check_seconds("timeout_s", timeout_s)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = 3600.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"job {self.id!r} did not finish within {timeout_s} s")
            try:
                state = self.queue.backend.wait_for_finish(self.id, min(left, 3600.0))
            except JobNotFound:
                raise self._not_found() from None
            if state is not None:
                break
        info = self.info()
        if info.state is JobState.COMPLETED:
            data = self.queue.backend.get_result(self.id)
            if data is None:
                return None
            return codecs.decode(codecs.check_codec(info.codec), data, what="result")
        raise JobFailed(
            f"job {self.id!r} {info.state}: {info.error or info.outcome or 'no cause recorded'}",
            job_id=self.id,
            outcome=str(info.outcome) if info.outcome else None,
            attempts=info.attempts,
            error=info.error,
        )

    def cancel(self) -> bool:
        """Cancel the job; a running job's child is killed. False if it had already finished."""
        return self.queue.backend.cancel(self.id)

    def retry(self) -> bool:
        """Run a failed or cancelled job again, its attempts reset and its history kept.

        False if it is neither failed nor cancelled; ``JobNotFound`` if it does not exist.
        A job cancelled while running becomes ``delayed`` until its old worker confirms
        the cancelled child dead (milliseconds) or the old lease runs out: it never runs
        twice at once (the CLI's ``sandboxq retry`` does the same).
        """
        if self.queue.backend.retry_failed(self.id):
            return True
        if self.queue.backend.get(self.id) is None:
            raise self._not_found()
        return False


def _check_seconds(name: str, value: float | None) -> None:
    """A wait in seconds, or None. NaN compares false with everything: it would never end."""
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value)
    ):
        raise ConfigError(f"{name} must be a number of seconds or None, got {value!r}")


#: An event id: "12" (memory://) or "1700000000000-0" (a Redis stream entry).
_EVENT_ID = re.compile(r"[0-9]{1,20}(-[0-9]{1,20})?")


def _call_pair(n: int, call: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``call`` as an ``(args, kwargs)`` pair, or a SerializationError naming it: a string
    is a sequence too, and ``("ab", {})`` must not quietly become ``f("a", "b")``."""
    if (
        isinstance(call, list | tuple)
        and len(call) == 2
        and isinstance(call[0], list | tuple)
        and isinstance(call[1], dict)
    ):
        return tuple(call[0]), call[1]
    raise SerializationError(
        f"enqueue_many: call #{n} is {call!r:.200}, not an (args, kwargs) pair "
        "with args a list or tuple and kwargs a dict"
    )


class Queue:
    """A named queue on a backend chosen by URL (``None``: ``$SANDBOXQ_URL``, else memory://).

    Payloads are JSON by default; ``codec="pickle"`` is an explicit opt-in for trusted
    deployments (workers must opt in too).
    """

    def __init__(
        self, name: str, url: str | None = None, *, codec: str = "json", **backend_options: Any
    ) -> None:
        self.name = name
        self.codec = codecs.check_codec(codec)
        self.backend: Backend = open_backend(url, name, **backend_options)
        self._set_options(JobOptions())

    def _set_options(self, options: JobOptions) -> None:
        self._options = options
        # Serialized once per view, not once per enqueue.
        self._options_json = options.model_dump_json(exclude_defaults=True)

    def options(self, **options: Any) -> Queue:
        """A view of this queue whose jobs get ``options`` (see ``JobOptions``)."""
        view = object.__new__(Queue)
        view.__dict__.update(self.__dict__)
        view._set_options(
            build(JobOptions, **{**self._options.model_dump(exclude_unset=True), **options})
        )
        return view

    def enqueue(self, /, *args: Any, **kwargs: Any) -> Job:
        """Enqueue ``processor(*args, **kwargs)``; returns its Job (an existing one when a
        ``job_id`` option names a job that already exists). Keyword arguments may have any
        name: options are set with ``options(...)``, never here."""
        ((job_id, _created),) = self.backend.enqueue([self._new_job(args, kwargs)])
        return Job(self, job_id)

    def enqueue_many(self, calls: Iterable[Call]) -> list[Job]:
        """Enqueue many calls in one round trip; ``calls`` are ``(args, kwargs)`` pairs."""
        jobs = [self._new_job(*_call_pair(n, call)) for n, call in enumerate(calls)]
        if self._options.job_id is not None and len(jobs) > 1:
            raise SandboxqError("a job_id option names one job; enqueue_many got several calls")
        return [Job(self, job_id) for job_id, _created in self.backend.enqueue(jobs)]

    def _new_job(self, args: Sequence[Any], kwargs: dict[str, Any]) -> NewJob:
        opts = self._options
        payload = codecs.encode_call(self.codec, tuple(args), kwargs)
        return NewJob(
            payload, self.codec, self._options_json, opts.job_id, opts.priority, opts.delay_s
        )

    def job(self, job_id: str) -> Job:
        """A handle on the job ``job_id`` (whether or not it exists)."""
        return Job(self, check_job_id(job_id))

    def counts(self) -> dict[JobState, int]:
        return self.backend.counts()

    def events(self, since: str | None = None, block_s: float | None = None) -> Iterator[Event]:
        """The retained events after event id ``since`` (all when None); then, with
        ``block_s``, new ones as they come until ``block_s`` passes without any."""
        _check_seconds("block_s", block_s)
        if since is not None and not (isinstance(since, str) and _EVENT_ID.fullmatch(since)):
            raise ConfigError(
                f"since must be an event id such as '12' or '1700000000000-0', got {since!r}"
            )
        return self.backend.events(since, block_s)

    def close(self) -> None:
        self.backend.close()

    def __enter__(self) -> Queue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
