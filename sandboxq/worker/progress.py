"""Progress reports, written to the backend from a thread of their own.

    main thread ── report(job id, token, fraction, message) ──► latest per lease ──► writer
                                                                                     │
                                            backend.record_progress (owner-checked) ◄┘

The main thread acks and claims; a progress write that hangs in a slow or hung backend
must not hold it (a stop would wait behind it). Reports of one lease are coalesced: a
writer that falls behind sends only the latest. A report must reach the backend before
its lease's ack (after it, the owner check rejects it): ``flush(tokens)`` writes what is
still pending for the leases about to be acked, on the caller's thread, and waits for a
write of theirs under way. Once the worker stops, ``drop(tokens)`` forgets them instead.
"""

from __future__ import annotations

import threading

from sandboxq.backends.base import Backend
from sandboxq.errors import BackendError
from sandboxq.text import guarded_logger
from sandboxq.worker.threads import BackgroundThread

log = guarded_logger("sandboxq.worker")


class ProgressWriter(BackgroundThread):
    def __init__(self, backend: Backend, worker_id: str) -> None:
        super().__init__("progress")
        self._backend = backend
        self._worker_id = worker_id
        self._pending: dict[str, tuple[str, float, str | None]] = {}  # token → report
        self._writing: set[str] = set()  # tokens the writer thread is sending now
        self._cond = threading.Condition()
        self.start()

    def report(self, job_id: str, token: str, fraction: float, message: str | None) -> None:
        with self._cond:
            self._pending[token] = (job_id, fraction, message)
            self._cond.notify()

    def flush(self, tokens: list[str]) -> None:
        """Write what is pending for these leases now, before their acks go out."""
        if not self._pending and not self._writing:  # the common case: nothing reported
            return
        wanted = set(tokens)
        with self._cond:
            while self._writing & wanted:
                self._cond.wait()
            batch = {t: self._pending.pop(t) for t in wanted if t in self._pending}
        self._write(batch)

    def drop(self, tokens: list[str]) -> None:
        """Forget what is pending for these leases (the worker is stopping)."""
        if self._pending:
            with self._cond:
                for token in tokens:
                    self._pending.pop(token, None)

    def stop(self, timeout_s: float | None = None) -> None:
        """Stop writing; reports not yet written are dropped (the worker is stopping)."""
        with self._cond:
            self.stopped.set()
            self._cond.notify()
        self.join(timeout_s)

    def loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self.stopped.is_set():
                    self._cond.wait()
                if self.stopped.is_set():
                    return
                batch, self._pending = self._pending, {}
                self._writing = set(batch)
            try:
                self._write(batch)
            finally:
                with self._cond:
                    self._writing = set()
                    self._cond.notify_all()

    def _write(self, batch: dict[str, tuple[str, float, str | None]]) -> None:
        for token, (job_id, fraction, message) in batch.items():
            try:
                self._backend.record_progress(self._worker_id, job_id, token, fraction, message)
            except BackendError as exc:
                log.warning("could not record progress of job %s: %s", job_id, exc)
            except Exception:
                log.exception("recording progress of job %s failed", job_id)
