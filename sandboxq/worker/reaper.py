"""Stalled-job recovery (design invariant 3): any live worker re-queues jobs whose lease expired.

A worker that died (SIGKILL, lost machine) stops renewing; once its leases expire on the
backend's clock, the next check puts those jobs back in the queue (or fails them after
too many stalls). Recovery therefore takes about ``lease_s`` plus ``interval_s``.
Delayed jobs are promoted by ``claim`` itself, so there is nothing else to sweep.
"""

from __future__ import annotations

import logging
import threading

from sandboxq.backends.base import Backend
from sandboxq.errors import BackendError

log = logging.getLogger("sandboxq.worker.reaper")


class Reaper:
    def __init__(self, backend: Backend, interval_s: float) -> None:
        self._backend = backend
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sandboxq-reaper", daemon=True)
        self.recovered = 0
        self.died: str | None = None  # why the thread died, for the worker's watch

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float | None = None) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def dead_thread(self) -> str | None:
        """The cause, if the thread was started and is no longer running before ``stop``."""
        if self._stop.is_set() or self._thread.ident is None or self._thread.is_alive():
            return None
        return f"the reaper thread died: {self.died or 'it returned'}"

    def _run(self) -> None:
        try:
            self._recover_forever()
        except BaseException as exc:
            log.exception("the reaper thread crashed")
            self.died = repr(exc)

    def _recover_forever(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                recovered = self._backend.recover_stalled()
            except BackendError as exc:
                log.warning("stalled-job check failed: %s", exc)
                continue
            for job_id, state in recovered:
                log.warning("job %s stalled (its lease expired): now %s", job_id, state)
            self.recovered += len(recovered)
