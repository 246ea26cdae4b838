"""The producer API: ``Queue`` (enqueue, enqueue_many, options, job, counts, events) and
``Job`` (info, state, result, cancel, retry).

    Queue.enqueue ── JobMaker.new_job (codec.encode_call, options) ──► Backend.enqueue
    Job.result ── Backend.wait_for_finish ──► finished_value: the value (codec.decode_stored,
                  only with the queue's allowed codecs), or JobFailed; JobNotFound at once

Importing this module loads no process machinery: producers only need a backend. What
``sandboxq.aio`` shares with it lives here, so both APIs refuse and answer alike:
``Producer`` (the name, the codec, the codecs results are read with, the ``options``
view), ``JobMaker`` (calls and options into ``NewJob`` records) and the module functions
that do no I/O (checks of arguments, a finished record into a value or ``JobFailed``).
"""

from __future__ import annotations

import re
import time
from collections.abc import Collection, Iterable, Iterator, Sequence
from typing import Any, Self

from sandboxq import codec as codecs
from sandboxq import tracing
from sandboxq.backends import open_backend
from sandboxq.backends.base import Backend, Event, NewJob
from sandboxq.batch import Batch, batch_total, check_batch_calls, new_batch_id
from sandboxq.errors import (
    ConfigError,
    JobNotFound,
    SandboxqError,
    SerializationError,
)
from sandboxq.finished import (
    Outage,
    check_seconds,
    decode_result,
    finished_value,
    no_such_job,
    patiently,
    result_value,
)
from sandboxq.models import (
    JobInfo,
    JobOptions,
    JobState,
    check_batch_id,
    check_job_id,
    member_id,
)
from sandboxq.settings import build

Call = tuple[Sequence[Any], dict[str, Any]]


class Job:
    """A handle on one job; every call asks the backend afresh. ``created``: whether the
    enqueue that made the handle added the job (False: a job of that id existed, and
    this call's arguments and options were not used); None for ``Queue.job(id)``."""

    def __init__(self, queue: Queue, job_id: str, created: bool | None = None) -> None:
        self.queue = queue
        self.id = job_id
        self.created = created

    def __repr__(self) -> str:
        return f"Job({self.queue.name!r}, {self.id!r})"

    def info(self) -> JobInfo:
        info = self.queue.backend.get(self.id)
        if info is None:
            raise self.not_found()
        return info

    def state(self) -> JobState:
        return self.info().state

    def not_found(self) -> JobNotFound:
        """``JobNotFound`` for this job, saying what retention has removed from the queue
        (when that can be read: the error stays about the job if it cannot)."""
        try:
            trims = self.queue.backend.retention_trims()
        except SandboxqError:
            trims = None
        return no_such_job(self.queue.name, self.id, trims)

    def result(self, timeout_s: float | None = None) -> Any:
        """The job's return value once it completes.

        Raises ``JobFailed`` (with ``.outcome``, ``.attempts``, ``.error``) if it failed or
        was cancelled, ``JobNotFound`` at once if the job does not exist (or is removed by
        retention or a purge while waited for), and ``TimeoutError`` if it is not finished
        within ``timeout_s``.

        On Redis, a wait holds no connection of its own: every waiter of the process on
        this queue, in any number of threads, is woken by one finish listener on one
        connection (``backends/redis/finish_listener.py``); their reads share the queue's
        lane, at most 16 connections. The listener reconnects after a Redis restart, and
        the wait goes on until ``timeout_s`` while Redis is unreachable (a restart, a
        Sentinel failover; ``finished.Outage``: 60 s in a row without a timeout).
        """
        check_seconds("timeout_s", timeout_s)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        outage = Outage(f"job {self.id!r}", deadline)

        def one_wait() -> tuple[bool, Any]:
            left = 3600.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"job {self.id!r} did not finish within {timeout_s} s")
            return self._finished(min(left, 3600.0))

        while True:
            finished, value = patiently(outage, one_wait)
            if finished:
                return value

    def _finished(self, wait_s: float) -> tuple[bool, Any]:
        """One wait of at most ``wait_s``, then a read: (True, its value) once the job has
        finished (``JobFailed`` raised for a failed one), else (False, None)."""
        try:
            state = self.queue.backend.wait_for_finish(self.id, wait_s)
        except JobNotFound:
            raise self.not_found() from None
        if state is None:
            return False, None
        if state is JobState.COMPLETED:  # its codec and result: one light read
            (done,) = self.queue.backend.completed_results([self.id])
            if done is not None:
                return True, result_value(self.id, *done, self.queue.allowed_codecs)
        # the record and the result in one round trip: a woken waiter returns sooner
        ((info, data),) = self.queue.backend.get_many([self.id])
        if info is None:
            raise self.not_found()
        if not info.state.finished:  # woken by a finish older than the wait: wait on
            return False, None
        data = data if info.state is JobState.COMPLETED else None
        return True, finished_value(self.id, info, data, self.queue.allowed_codecs)

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
            raise self.not_found()
        return False


def read_result(backend: Backend, info: JobInfo, allowed: Collection[str]) -> Any:
    """The decoded result of the completed job ``info`` describes (the read path of
    ``sandboxq job``)."""
    return decode_result(info, backend.get_result(info.id), allowed)


#: An event id: "12" (memory://) or "1700000000000-0" (a Redis stream entry).
_EVENT_ID = re.compile(r"[0-9]{1,20}(-[0-9]{1,20})?")


def check_since(since: str | None) -> None:
    if since is not None and not (isinstance(since, str) and _EVENT_ID.fullmatch(since)):
        raise ConfigError(
            f"since must be an event id such as '12' or '1700000000000-0', got {since!r}"
        )


def call_pair(
    n: int, call: Any, what: str = "enqueue_many"
) -> tuple[tuple[Any, ...], dict[str, Any]]:
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
        f"{what}: call #{n} is {call!r:.200}, not an (args, kwargs) pair "
        "with args a list or tuple and kwargs a dict"
    )


class JobMaker:
    """What a queue (or a view of it with options) turns calls into: ``NewJob`` records."""

    def __init__(self, codec: str, options: JobOptions) -> None:
        self.codec = codecs.check_codec(codec)
        self.options = options
        # Serialized once per view, not once per enqueue.
        self.options_json = options.model_dump_json(exclude_defaults=True)

    def with_options(self, **options: Any) -> JobMaker:
        """A maker whose jobs get ``options`` over this one's (see ``JobOptions``)."""
        merged = {**self.options.model_dump(exclude_unset=True), **options}
        return JobMaker(self.codec, build(JobOptions, **merged))

    def new_job(self, args: Sequence[Any], kwargs: dict[str, Any]) -> NewJob:
        opts = self.options
        payload = codecs.encode_call(self.codec, tuple(args), kwargs)
        return NewJob(
            payload, self.codec, self.options_json, opts.job_id, opts.priority, opts.delay_s
        )

    def new_jobs(self, calls: Iterable[Call]) -> list[NewJob]:
        """``enqueue_many``'s jobs: ``calls`` are ``(args, kwargs)`` pairs."""
        return self.check_batch([self._numbered(n, call) for n, call in enumerate(calls)])

    def _numbered(self, n: int, call: Any, what: str = "enqueue_many") -> NewJob:
        """Call ``n`` of many as a job: a call that does not encode is named by its number
        (one bad call among thousands)."""
        args, kwargs = call_pair(n, call, what)
        try:
            return self.new_job(args, kwargs)
        except SerializationError as exc:
            raise SerializationError(f"{what}: call #{n}: {exc}") from None

    def batch_jobs(self, batch_id: str, calls: Iterable[Call]) -> list[NewJob]:
        """A batch's jobs, each with its member id: ``calls`` are ``(args, kwargs)`` pairs,
        checked and encoded all before anything is sent."""
        return [self.batch_job(batch_id, n, call) for n, call in enumerate(calls)]

    def batch_job(self, batch_id: str, n: int, call: Any) -> NewJob:
        """Member ``n`` of batch ``batch_id``: the call checked and encoded, its id set."""
        job = self._numbered(n, call, "batch")
        job.job_id = member_id(batch_id, n)
        return job

    def check_batch(self, jobs: list[NewJob]) -> list[NewJob]:
        """``jobs`` as one ``enqueue_many`` batch, unless a ``job_id`` option forbids it."""
        if self.options.job_id is not None and len(jobs) > 1:
            raise SandboxqError("a job_id option names one job; enqueue_many got several calls")
        return jobs


class Producer:
    """What the sync and the asyncio ``Queue`` share: the name, how jobs are encoded, which
    codecs results are read with, and the ``options`` view."""

    def __init__(self, name: str, codec: str, allow_pickle: bool) -> None:
        self.name = name
        self._maker = JobMaker(codec, JobOptions())
        self.codec = self._maker.codec
        self.allowed_codecs = codecs.reader_codecs(self.codec, allow_pickle=allow_pickle)

    def options(self, **options: Any) -> Self:
        """A view of this queue whose jobs get ``options`` (see ``JobOptions``)."""
        view = object.__new__(type(self))
        view.__dict__.update(self.__dict__)
        view._maker = self._maker.with_options(**options)
        return view


class Queue(Producer):
    """A named queue on a backend chosen by URL (``None``: ``$SANDBOXQ_URL``, else memory://).

    Payloads are JSON by default; ``codec="pickle"`` is an explicit opt-in for trusted
    deployments (workers must opt in too). What this queue *reads* back (results) is
    decoded only with ``allowed_codecs``: json, and pickle only with ``codec="pickle"`` or
    ``allow_pickle=True``; a stored record claiming anything else is refused
    (``CodecRefused``), whatever it says.
    """

    def __init__(
        self,
        name: str,
        url: str | None = None,
        *,
        codec: str = "json",
        allow_pickle: bool = False,
        **backend_options: Any,
    ) -> None:
        super().__init__(name, codec, allow_pickle)
        self.backend: Backend = open_backend(url, name, **backend_options)

    def enqueue(self, /, *args: Any, **kwargs: Any) -> Job:
        """Enqueue ``processor(*args, **kwargs)``; returns its Job (an existing one when a
        ``job_id`` option names a job that already exists). Keyword arguments may have any
        name: options are set with ``options(...)``, never here."""
        jobs = [self._maker.new_job(args, kwargs)]
        with tracing.enqueue_span(self.name, jobs) as span:
            ((job_id, created),) = self.backend.enqueue(jobs)
            span.added([job_id])
        return Job(self, job_id, created)

    def enqueue_many(self, calls: Iterable[Call]) -> list[Job]:
        """Enqueue many calls in one round trip; ``calls`` are ``(args, kwargs)`` pairs."""
        jobs = self._maker.new_jobs(calls)
        with tracing.enqueue_span(self.name, jobs):
            added = self.backend.enqueue(jobs)
        return [Job(self, job_id, created) for job_id, created in added]

    def job(self, job_id: str) -> Job:
        """A handle on the job ``job_id`` (whether or not it exists)."""
        return Job(self, check_job_id(job_id))

    def batch(
        self, calls: Iterable[Call], then: str | None = None, *, label: str | None = None
    ) -> Batch[Job]:
        """Enqueue every ``(args, kwargs)`` call as one batch (member ``i`` is job
        ``<batch id>.<i>``), in chunks, all in one round trip; returns its ``Batch``.

        ``then``: when the last member is final, one job is enqueued on that queue, its
        single argument the batch's summary (``batch_id``, ``queue``, ``total``,
        ``completed``, ``failed``, ``cancelled``), exactly once. Nothing is sent unless
        every call encodes; ``BatchIncomplete`` names how many members exist when the
        backend failed part-way. ``label``: text kept with the batch, shown by
        ``progress().label``, ``sandboxq batch`` and the dashboard.
        """
        batch_id = new_batch_id()
        jobs = self._maker.batch_jobs(batch_id, calls)
        check_batch_calls(jobs, then, self._maker.options.job_id, label)
        with tracing.enqueue_span(self.name, jobs, batch_id):
            self.backend.enqueue_batch(batch_id, jobs, then=then, label=label)
        return Batch(self, batch_id, len(jobs))

    def get_batch(self, batch_id: str) -> Batch[Job]:
        """The batch ``batch_id`` of this queue, from any process; ``BatchNotFound`` at
        once if it does not exist."""
        progress = self.backend.batch_progress(check_batch_id(batch_id))
        return Batch(self, batch_id, batch_total(self.name, batch_id, progress))

    def counts(self) -> dict[JobState, int]:
        return self.backend.counts()

    def events(self, since: str | None = None, block_s: float | None = None) -> Iterator[Event]:
        """The retained events after event id ``since`` (all when None); then, with
        ``block_s``, new ones as they come until ``block_s`` passes without any."""
        check_seconds("block_s", block_s)
        check_since(since)
        return self.backend.events(since, block_s)

    def close(self) -> None:
        self.backend.close()

    def __enter__(self) -> Queue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
