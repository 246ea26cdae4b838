"""The dashboard's state: the backends it opened, the queues it shows, its auth, its hub.

Dashboard.queues()  ── the names given, or the queue index's (backends/index.py: kept
                       by the enqueue scripts and worker registration; read at most
                       every INDEX_FRESH_S, capped, never a SCAN): a new queue shows at
                       the page's next refresh; the first DASHBOARD_QUEUES by name
Dashboard.backend(q) ── one backend per queue, opened on first use, at most
                       MAX_BACKENDS beyond the listed queues; all share the
                       connections of the probe's (Backend.sibling)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from sandboxq.backends import open_backend, resolve_url
from sandboxq.backends.base import Backend
from sandboxq.backends.index import QUEUES_READ_CAP, QueueIndex
from sandboxq.errors import ConfigError, DamagedRecord, SandboxqError
from sandboxq.models import check_queue_name
from sandboxq.redaction import redact_url
from sandboxq.web.auth import Auth
from sandboxq.web.hub import Hub

INDEX_FRESH_S = 0.5  # the queue index is read again after this (pages refresh every 2 s)
MAX_BACKENDS = 64  # queues opened by name from a URL, beyond the listed ones
#: Queues one dashboard shows at most: each costs a few reads per render, a backend
#: (connections) and a turn of the events reader; more is said on the page, not shown.
DASHBOARD_QUEUES = 200
PROBE = "sandboxq-dashboard"  # the backend the index is read through (any queue's would do)


class Dashboard:
    """The app's state: backends by queue, the queue list, the auth rules, the hub."""

    def __init__(
        self, url: str | None, queues: Sequence[str] | None, token: str | None, read_only: bool
    ) -> None:
        self.url = resolve_url(url)
        self.where = redact_url(self.url)
        self.auth = Auth(token, read_only=read_only)
        self._fixed = [check_queue_name(q) for q in queues] if queues else None
        self._index: QueueIndex | None = None
        self._index_error: SandboxqError | None = None
        #: Why the index could not be read though the server answered (a damaged key):
        #: it costs the overview its list of queues, and no other page anything.
        self._index_damage = ""
        self._index_at = -INDEX_FRESH_S
        self._backends: dict[str, Backend] = {}
        self._lock = threading.Lock()
        self._index_lock = threading.Lock()
        self.hub = Hub(self.queues, self.backend)

    def backend(self, queue: str) -> Backend:
        """The backend of ``queue``, opened once. Any valid name can be typed into a URL,
        so past MAX_BACKENDS the oldest one opened for a queue not listed is closed. A
        dashboard given its queues (``--queue``) serves those alone: another typed into a
        URL is refused (``ConfigError``: 400), not shown."""
        self.check_shown(queue)
        with self._lock:
            backend = self._backends.get(queue)
            if backend is not None:
                return backend
            probe = self._backends.get(PROBE) or open_backend(self.url, PROBE)
            self._backends[PROBE] = probe  # its connections serve every queue, never closed
            backend = self._backends[queue] = probe if queue == PROBE else probe.sibling(queue)
            listed = set(self._fixed or (self._index.names if self._index else ()))
            spare = [q for q in self._backends if q not in listed and q not in (queue, PROBE)]
            evicted = (
                self._backends.pop(spare[0])
                if len(self._backends) > MAX_BACKENDS and spare
                else None
            )
        if evicted is not None:
            evicted.close()
        return backend

    def check_shown(self, queue: str) -> None:
        """``ConfigError`` unless ``queue`` is a valid name this dashboard may show."""
        check_queue_name(queue)
        if self._fixed is not None and queue not in self._fixed and queue != PROBE:
            raise ConfigError(f"queue {queue!r} is not one of the queues this dashboard shows")

    def index(self) -> QueueIndex | None:
        """The queue index, read at most every INDEX_FRESH_S (None when queues were
        named, or the index is damaged); raises ``BackendError`` while the server cannot
        be read, so every page says so (an outage is not "no queues yet")."""
        if self._fixed is not None:
            return None
        with self._index_lock:
            if time.monotonic() - self._index_at >= INDEX_FRESH_S:
                try:
                    # A whole look is read and the page shows the first names of it:
                    # the index is a set, so a look of DASHBOARD_QUEUES entries would
                    # be an arbitrary few, differing from refresh to refresh.
                    self._index = self.backend(PROBE).queue_index(QUEUES_READ_CAP)
                    self._index_error, self._index_damage = None, ""
                    self._close_unlisted()
                except DamagedRecord as exc:
                    self._index, self._index_error, self._index_damage = None, None, str(exc)
                except SandboxqError as exc:
                    self._index_error = exc
                self._index_at = time.monotonic()
            if self._index_error is not None:
                raise self._index_error
            return self._index

    def _close_unlisted(self) -> None:
        """Close the backends of queues the index no longer lists (deleted, or fallen out
        of the look), past MAX_BACKENDS: each holds connections, and a dashboard that had
        shown 200 queues held 407 connections after they were gone."""
        listed = set(self._index.names if self._index else ())
        with self._lock:
            spare = [q for q in self._backends if q not in listed and q != PROBE]
            closing = spare[: max(0, len(self._backends) - MAX_BACKENDS)]
            gone = [self._backends.pop(q) for q in closing]
        for backend in gone:
            backend.close()

    def queues(self) -> list[str]:
        if self._fixed is not None:
            return list(self._fixed)
        index = self.index()
        names = [n for n in index.names if n != PROBE] if index is not None else []
        return names[:DASHBOARD_QUEUES]

    def note(self) -> str:
        """What the overview leaves out, in one line ("" when nothing)."""
        index = self.index()
        if self._index_damage:
            return f"no queue can be listed: {self._index_damage}; --queue NAME shows one"
        if index is None:
            return ""
        found = len([n for n in index.names if n != PROBE])
        parts = [index.note()] if index.note() else []
        if found > DASHBOARD_QUEUES:
            shown = f"{DASHBOARD_QUEUES} of the {found} queues read are shown"
            parts.append(f"{shown}, the first by name")
        return "; ".join(parts)

    def close(self) -> None:
        self.hub.close()
        with self._lock:
            backends, self._backends = self._backends, {}
        probe = backends.pop(PROBE, None)
        for backend in [*backends.values(), probe]:  # the probe's connections last
            if backend is not None:
                backend.close()
