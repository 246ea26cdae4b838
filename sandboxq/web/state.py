"""The dashboard's state: the backends it opened, the queues it shows, its auth, its hub.

Dashboard.queues()  ── the names given, or those a background thread finds
                       (memory://: this process's queues; Redis: a time-boxed SCAN
                       for events streams every DISCOVER_S, never in a request)
Dashboard.backend(q) ── one backend per queue, opened on first use, at most
                       MAX_BACKENDS beyond the listed queues
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from sandboxq.backends import open_backend, resolve_url
from sandboxq.backends.base import Backend
from sandboxq.errors import SandboxqError
from sandboxq.models import check_queue_name
from sandboxq.web.auth import Auth
from sandboxq.web.hub import Hub

log = logging.getLogger("sandboxq.web")

DISCOVER_S = 60.0  # how often the list of queues is looked for again
MAX_BACKENDS = 64  # queues opened by name from a URL, beyond the listed ones
SCAN_BUDGET_S = 30.0  # longest one look for queues may take (1.4M keys: about 4 s)


class Dashboard:
    """The app's state: backends by queue, the queue list, the auth rules, the hub."""

    def __init__(
        self, url: str | None, queues: Sequence[str] | None, token: str | None, read_only: bool
    ) -> None:
        self.url = resolve_url(url)
        self.auth = Auth(token, read_only=read_only)
        self._fixed = [check_queue_name(q) for q in queues] if queues else None
        self._found: list[str] = []
        self._backends: dict[str, Backend] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._discovered = threading.Event()
        self._discovery: threading.Thread | None = None
        self.hub = Hub(self.queues, self.backend)

    def backend(self, queue: str) -> Backend:
        """The backend of ``queue``, opened once. Any valid name can be typed into a URL,
        so past MAX_BACKENDS the oldest one opened for a queue not listed is closed."""
        check_queue_name(queue)
        with self._lock:
            backend = self._backends.get(queue)
            if backend is not None:
                return backend
            backend = self._backends[queue] = open_backend(self.url, queue)
            listed = set(self._fixed or self._found)
            spare = [q for q in self._backends if q not in listed and q != queue]
            evicted = (
                self._backends.pop(spare[0])
                if len(self._backends) > MAX_BACKENDS and spare
                else None
            )
        if evicted is not None:
            evicted.close()
        return backend

    def queues(self) -> list[str]:
        if self._fixed is not None:
            return list(self._fixed)
        with self._lock:
            start = self._discovery is None
            if start:
                self._discovery = threading.Thread(
                    target=self._discover, name="sandboxq-dashboard-queues", daemon=True
                )
                self._discovery.start()
        # until the first look is done, a caller waits a moment for it
        self._discovered.wait(1.0)
        with self._lock:
            return list(self._found)

    def _discover(self) -> None:
        """The queues that exist, looked for every DISCOVER_S on this thread (a SCAN of
        a big Redis must never hold up a page)."""
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                if self.url.startswith("memory://"):
                    from sandboxq.backends.memory import MemoryBackend

                    names = sorted(MemoryBackend._registry)
                else:
                    probe: Any = self.backend("sandboxq-dashboard")
                    found = probe.queue_names(budget_s=SCAN_BUDGET_S)
                    names = [n for n in found if n != "sandboxq-dashboard"]
                with self._lock:
                    self._found = names
            except SandboxqError as exc:
                log.warning("dashboard: cannot list the queues: %s", exc)
            self._discovered.set()
            # a SCAN of a big keyspace costs Redis time too: look again less often then
            self._stop.wait(max(DISCOVER_S, 30 * (time.monotonic() - started)))

    def close(self) -> None:
        self._stop.set()
        self.hub.close()
        if self._discovery is not None:
            self._discovery.join(5.0)  # at most one time-boxed SCAN away
        with self._lock:
            backends, self._backends = list(self._backends.values()), {}
        for backend in backends:
            backend.close()
