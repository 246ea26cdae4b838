"""The memory backend's waits: for a job to finish, for new events, for cancellations.

Every wait is ``Store.cond.wait`` on the one condition every state change notifies
(``Store.emit``), re-checking its own predicate, so a wake-up is never missed; events are
handed to the consumer only after the lock is let go.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator

from sandboxq.backends import rules
from sandboxq.backends.base import Event
from sandboxq.backends.memory.store import Store
from sandboxq.errors import ConfigError
from sandboxq.models import JobState


class Waits:
    queue: str
    _store: Store

    def wait_for_finish(self, job_id: str, timeout_s: float) -> JobState | None:
        deadline = time.monotonic() + timeout_s
        store = self._store
        with store.cond:
            while True:
                job = store.jobs.get(job_id)
                if job is None:  # never enqueued, trimmed or purged: waiting would be for nothing
                    raise rules.job_not_found(self.queue, job_id)
                if job.state.finished:
                    return job.state
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                store.cond.wait(left)

    def events(self, since: str | None = None, block_s: float | None = None) -> Iterator[Event]:
        try:
            last = int(since) if since is not None else 0
        except ValueError:
            raise ConfigError(f"since {since!r} is not an event id of a memory:// queue") from None
        store = self._store
        while True:
            with store.cond:
                deadline = time.monotonic() + (block_s or 0.0)
                while store.last_event <= last and (left := deadline - time.monotonic()) > 0:
                    store.cond.wait(left)
                # Ids are consecutive, so the new events are the last ``last_event - last``
                # ones: taken from the right end, since a deque is walked from an end to an
                # offset (from the left, every read walked past every retained event).
                new = min(store.last_event - last, len(store.events))
                batch = list(itertools.islice(reversed(store.events), max(0, new)))[::-1]
            if not batch:
                return
            yield from batch  # never while holding the lock: the consumer may be slow
            last = int(batch[-1].id)
            if block_s is None:
                return

    def watch_cancellations(
        self, callback: Callable[[str, str | None], None]
    ) -> Callable[[], None]:
        store = self._store
        with store.cond:
            store.watchers.append(callback)

        def stop() -> None:
            with store.cond:
                if callback in store.watchers:
                    store.watchers.remove(callback)

        return stop
