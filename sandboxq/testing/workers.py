"""Running ``SandboxWorker``s on background threads in a test, and always stopping them.

    workers = BackgroundWorkers()
    worker = workers.start(queue, "pkg.mod:fn", hard_timeout_s=1)   # on its own thread
    ... enqueue, wait for results ...
    workers.stop_all()    # stop(now=True) every worker, join, re-raise what run() raised
    child_pid(queue, job_id)   # the child running a job, from the worker registry

``stop_all`` interrupts running jobs (they go back to the queue uncharged, as on a second
SIGTERM) and waits for every worker to shut its pool down, so no child outlives it.
"""

from __future__ import annotations

import threading
from typing import Any

from sandboxq.client import Queue
from sandboxq.errors import SandboxqError
from sandboxq.worker import SandboxWorker

#: Defaults suited to a test on a small machine; any of them can be overridden.
TEST_DEFAULTS: dict[str, Any] = {"concurrency": 2, "lease_s": 10.0, "stop_timeout_s": 5.0}


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


class WorkerDidNotStop(SandboxqError):
    """A background worker was still running when it had to be stopped."""


class _Running:
    def __init__(self, worker: SandboxWorker, burst: bool) -> None:
        self.worker = worker
        self.error: BaseException | None = None
        self.thread = threading.Thread(
            target=self._run, args=(burst,), name=f"sandboxq-worker-{worker.id}", daemon=True
        )

    def _run(self, burst: bool) -> None:
        try:
            self.worker.run(burst=burst)
        except BaseException as exc:  # re-raised by stop_all, on the test's thread
            self.error = exc


class BackgroundWorkers:
    """Workers started on background threads; ``stop_all`` ends every one."""

    def __init__(self, *, join_timeout_s: float = 30.0) -> None:
        self.join_timeout_s = join_timeout_s
        self._running: list[_Running] = []

    def start(
        self,
        queue: Queue | str,
        processor: str,
        *,
        url: str | None = None,
        burst: bool = False,
        **options: Any,
    ) -> SandboxWorker:
        """Start a worker running ``processor`` for ``queue`` (a Queue, or a name on ``url``).

        ``options`` are ``SandboxWorker`` keywords, over ``TEST_DEFAULTS``. With ``burst``
        the worker stops by itself once the queue is empty.
        """
        if isinstance(queue, Queue):
            url, queue = url_of(queue), queue.name
        worker = SandboxWorker(queue, processor, url=url, **{**TEST_DEFAULTS, **options})
        running = _Running(worker, burst)
        self._running.append(running)
        running.thread.start()
        return worker

    def not_running(self) -> list[SandboxWorker]:
        """Workers whose ``run()`` has already ended: a burst worker that drained its
        queue, or one that died (``stop_all`` re-raises what it raised)."""
        return [each.worker for each in self._running if not each.thread.is_alive()]

    def stop_all(self) -> None:
        """Stop every worker now and join it; raise if one would not stop or had crashed."""
        running, self._running = self._running, []
        for each in running:
            each.worker.stop(now=True)
        for each in running:
            each.thread.join(self.join_timeout_s)
        stuck = [each.worker.id for each in running if each.thread.is_alive()]
        if stuck:
            raise WorkerDidNotStop(
                f"worker(s) {', '.join(stuck)} still running {self.join_timeout_s:g} s "
                "after stop(now=True)"
            )
        for each in running:
            if each.error is not None:
                raise SandboxqError(
                    f"worker {each.worker.id} stopped with an error: {each.error!r}"
                ) from each.error
