"""Stalled-job recovery (design invariant 3): any live worker re-queues jobs whose lease expired.

A worker that died (SIGKILL, lost machine) stops renewing; once its leases expire on the
backend's clock, the next check puts those jobs back in the queue (or fails them after
too many stalls). Recovery therefore takes about ``lease_s`` plus ``interval_s``.
Delayed jobs are promoted by ``claim`` itself, so there is nothing else to sweep. The
same round reads what retention removed (retention.py's ``TrimWatch``), to log and count it.
"""

from __future__ import annotations

from sandboxq.backends.base import Backend
from sandboxq.errors import BackendError
from sandboxq.text import guarded_logger
from sandboxq.worker.retention import TrimWatch
from sandboxq.worker.threads import BackgroundThread

log = guarded_logger("sandboxq.reaper")


class Reaper(BackgroundThread):
    def __init__(
        self,
        backend: Backend,
        interval_s: float,
        max_infra_deaths: int,
        trims: TrimWatch | None = None,
    ) -> None:
        super().__init__("reaper")
        self.trims = trims
        self._backend = backend
        self._interval_s = interval_s
        self._max_infra_deaths = max_infra_deaths  # a worker's death counts against its jobs
        self.recovered = 0

    def loop(self) -> None:
        while not self.stopped.wait(self._interval_s):
            try:
                recovered = self._backend.recover_stalled(self._max_infra_deaths)
            except BackendError as exc:
                log.warning("stalled-job check failed: %s", exc)
                continue
            for job_id, state in recovered:
                log.warning("job %s stalled (its lease expired): now %s", job_id, state)
            self.recovered += len(recovered)
            if self.trims is not None:
                self.trims.check()
