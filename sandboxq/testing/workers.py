"""Every worker a test starts, from one factory that always stops them.

    with BackgroundWorkers() as workers:            # or workers.stop_all() when done
        worker = workers.start(queue, "pkg.mod:fn", hard_timeout_s=1)   # on its own thread
        done = workers.burst(queue, "pkg.mod:fn")   # on this thread, until the queue is empty
        proc = workers.spawn(name, "pkg.mod:fn", "--concurrency", "1", url=url, log=path)
        ... enqueue, wait for results ...
        workers.stop(worker)          # drain one and join it (stop_all does the rest)
        workers.join(worker, 10)      # a worker expected to end by itself...
        workers.error(worker)         # ...and what its run() raised (then not re-raised)
    child_pid(queue, job_id)          # the child running a job, from the worker registry

Threads run ``SandboxWorker.run`` in this process; ``spawn`` starts the ``sandboxq worker``
command, for what only a real process shows (signals, SIGKILL, exit status, logs).
``stop_all`` interrupts every thread's running jobs (they go back to the queue uncharged,
as on a second SIGTERM) and waits for each worker to shut its pool down, so no child
outlives it; it SIGKILLs every process still running, whose children die with it. It
raises what a worker's ``run()`` raised unless the test took it with ``error()``.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from sandboxq.client import Queue
from sandboxq.errors import SandboxqError
from sandboxq.testing.redis_server import ends_with_this_process
from sandboxq.worker import SandboxWorker

#: Defaults suited to a test on a small machine; any of them can be overridden.
#: What the ``start_worker`` fixtures give a test: build and start a worker from a
#: processor path and settings.
StartWorker = Callable[..., SandboxWorker]

TEST_DEFAULTS: dict[str, Any] = {"concurrency": 2, "lease_s": 10.0, "stop_timeout_s": 5.0}

#: The ``sandboxq`` command line, run by this interpreter.
CLI = [sys.executable, "-m", "sandboxq"]


def url_of(queue: Queue) -> str:
    """The backend URL a worker needs to serve ``queue``."""
    from sandboxq.backends.memory import MemoryBackend

    if isinstance(queue.backend, MemoryBackend):
        return "memory://"
    url = getattr(queue.backend, "url", None)
    if not isinstance(url, str):
        raise SandboxqError(f"cannot tell the URL of queue {queue.name!r}'s backend")
    return url


def child_pid(queue: Queue, job_id: str) -> int | None:
    """The pid of the child that runs ``job_id``, as its worker last registered it (the
    registry is refreshed every ``lease_s / 3``); None until then."""
    for worker in queue.backend.workers():
        for job in worker.get("jobs") or []:
            if job.get("id") == job_id and job.get("pid"):
                return int(job["pid"])
    return None


#: How often ``start(wait_started=True)`` looks whether the worker's thread ended.
START_LOOK_S = 0.05


class WorkerDidNotStop(SandboxqError):
    """A background worker was still running when it had to be stopped."""


class WorkerDied(SandboxqError):
    """A worker the test needed alive to the end had already stopped by itself."""


class _Running:
    def __init__(self, worker: SandboxWorker, burst: bool) -> None:
        self.worker = worker
        self.error: BaseException | None = None
        self.error_seen = False
        self.thread = threading.Thread(
            target=self._run, args=(burst,), name=f"sandboxq-worker-{worker.id}", daemon=True
        )

    def _run(self, burst: bool) -> None:
        try:
            self.worker.run(burst=burst)
        except BaseException as exc:  # re-raised by stop_all, on the test's thread
            self.error = exc


class BackgroundWorkers:
    """Workers a test started, on threads or as processes; ``stop_all`` ends every one
    (so does leaving a ``with`` block)."""

    def __init__(self, *, join_timeout_s: float = 30.0) -> None:
        self.join_timeout_s = join_timeout_s
        self._running: list[_Running] = []
        self._processes: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> BackgroundWorkers:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop_all()

    # -- in this process ----------------------------------------------------------------

    def make(
        self, queue: Queue | str, processor: str, *, url: str | None = None, **options: Any
    ) -> SandboxWorker:
        """A worker running ``processor`` for ``queue`` (a Queue, or a name on ``url``), not
        started. ``options`` are ``SandboxWorker`` keywords, over ``TEST_DEFAULTS``."""
        if isinstance(queue, Queue):
            url, queue = url_of(queue), queue.name
        return SandboxWorker(queue, processor, url=url, **{**TEST_DEFAULTS, **options})

    def start(
        self,
        queue: Queue | str,
        processor: str,
        *,
        url: str | None = None,
        burst: bool = False,
        wait_started: bool = False,
        **options: Any,
    ) -> SandboxWorker:
        """Start a worker (see ``make``) on a thread of its own. With ``burst`` it stops by
        itself once the queue is empty (``join`` waits for that). With ``wait_started``,
        return once it claims jobs (``SandboxWorker.started``), or raise at once what its
        start raised (an unknown ``user``, an unreachable backend)."""
        running = _Running(self.make(queue, processor, url=url, **options), burst)
        self._running.append(running)
        running.thread.start()
        if wait_started:
            while not running.worker.started.wait(START_LOOK_S):
                if not running.thread.is_alive():
                    self._running.remove(running)
                    raise running.error or WorkerDied(
                        f"worker {running.worker.id} stopped before it started"
                    )
        return running.worker

    def burst(
        self, queue: Queue | str, processor: str, *, url: str | None = None, **options: Any
    ) -> SandboxWorker:
        """Run a worker (see ``make``) in burst mode on this thread: it returns, with the
        worker, once the queue is empty; what ``run()`` raises is raised here."""
        worker = self.make(queue, processor, url=url, **options)
        worker.run(burst=True)
        return worker

    def _find(self, worker: SandboxWorker) -> _Running:
        for each in self._running:
            if each.worker is worker:
                return each
        raise SandboxqError(f"worker {worker.id} was not started by these BackgroundWorkers")

    def join(self, worker: SandboxWorker, timeout_s: float) -> bool:
        """True once ``worker``'s ``run()`` has ended (returned or raised) within ``timeout_s``."""
        thread = self._find(worker).thread
        thread.join(timeout_s)
        return not thread.is_alive()

    def error(self, worker: SandboxWorker) -> BaseException | None:
        """What ``worker``'s ``run()`` raised, or None: a test that expects it takes it here,
        and ``stop_all`` does not raise it again."""
        running = self._find(worker)
        running.error_seen = True
        return running.error

    def stop(self, worker: SandboxWorker, *, now: bool = False) -> None:
        """Stop ``worker`` (a drain; with ``now``, interrupt its jobs) and join it; raise if
        it would not stop or its ``run()`` raised."""
        running = self._find(worker)
        self._running.remove(running)
        self._end([running], now=now)

    def not_running(self) -> list[SandboxWorker]:
        """Workers whose ``run()`` has already ended: a burst worker that emptied its
        queue, or one that died (``stop_all`` re-raises what it raised)."""
        return [each.worker for each in self._running if not each.thread.is_alive()]

    # -- as processes -------------------------------------------------------------------

    def spawn(
        self,
        queue: str,
        processor: str,
        *args: str,
        url: str | None = None,
        log: Path | None = None,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        new_session: bool = False,
    ) -> subprocess.Popen[bytes]:
        """Start ``sandboxq worker queue processor [--url url] args...`` as a process of its
        own, its stderr (the log) appended to ``log`` (discarded without one). With
        ``new_session`` it leads a process group, as a worker started from a shell does."""
        command = [*CLI, "worker", queue, processor, *(["--url", url] if url else []), *args]
        stderr: IO[bytes] | int = log.open("ab") if log is not None else subprocess.DEVNULL
        try:
            proc = subprocess.Popen(
                command,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                env=env,
                cwd=cwd,
                start_new_session=new_session,
                preexec_fn=ends_with_this_process(),  # a run ended by os._exit ends it too
            )
        finally:
            if not isinstance(stderr, int):
                stderr.close()  # the process has its own copy
        self._processes.append(proc)
        return proc

    # -- the end ------------------------------------------------------------------------

    def stop_all(self, *, died_of: str | None = None) -> None:
        """Stop every thread's worker now and join it, SIGKILL every process; raise if one
        would not stop or its ``run()`` raised. With ``died_of`` (what the workers had to
        survive), also raise ``WorkerDied`` if a thread's ``run()`` had already ended."""
        running, self._running = self._running, []
        dead = [each.worker.id for each in running if not each.thread.is_alive()]
        processes, self._processes = self._processes, []
        for proc in processes:
            if proc.poll() is None:
                proc.kill()
        for proc in processes:
            proc.wait(self.join_timeout_s)
        self._end(running, now=True)
        if died_of is not None and dead:
            raise WorkerDied(f"worker(s) {', '.join(dead)} died of {died_of}")

    def _end(self, running: list[_Running], *, now: bool) -> None:
        for each in running:
            each.worker.stop(now=now)
        for each in running:
            each.thread.join(self.join_timeout_s)
        stuck = [each.worker.id for each in running if each.thread.is_alive()]
        if stuck:
            raise WorkerDidNotStop(
                f"worker(s) {', '.join(stuck)} still running {self.join_timeout_s:g} s "
                f"after stop(now={now})"
            )
        for each in running:
            if each.error is not None and not each.error_seen:
                raise SandboxqError(
                    f"worker {each.worker.id} stopped with an error: {each.error!r}"
                ) from each.error
