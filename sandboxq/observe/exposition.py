"""``GET /metrics`` answered with text a function writes, on a daemon thread.

    Prometheus ── connect ──► the loop thread: accept, then wait for the request ──┐
                              (one selector: the listening socket, every connection  │
                              still silent, a wake-up socket for close)             │
               ◄── 200 text/plain; version=0.0.4 ── a handler thread ◄── readable ──┘
                                                    (at most MAX_HANDLERS at once)

The exporter writes its few gauge families itself (exporter.py ``exposition``): with
1,000 queues, prometheus_client's formatting of 8,000 samples one by one (label
validation, escaping) cost as much as reading Redis. A worker's metrics port is served
here too, with prometheus_client's text of its registry (metrics.py). Any other path is
404.

A connection gets a thread only once its request has started to arrive: on
``ThreadingHTTPServer`` a client that opened connections and sent nothing (slowloris) had
a thread per connection, without bound, for as long as it kept them open. Now a silent
connection costs a descriptor in the loop's selector, for at most ``READ_S``, and at most
``MAX_WAITING`` of them are kept (past it the one waiting longest is closed: a scrape
sends its request at once, so it is never that one). A connection whose request arrives
while ``MAX_HANDLERS`` are being answered is closed at once, not queued. The whole request
must have arrived ``READ_S`` after the accept, or its handler's connection is shut: a
client sending a byte at a time, each within a read's timeout, held a slot for good, and
``MAX_HANDLERS`` of them every slot. (One that reconnects as often can still crowd out a
scrape: the port is for Prometheus, bound to 127.0.0.1 unless asked otherwise.)
Prometheus sends one request per connection (HTTP/1.0 here: the server closes after the
answer), so none of this slows a scrape.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, HTTPServer

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
READ_S = 5.0  # a connection's request must arrive within this, and each read of it
MAX_WAITING = 256  # connections accepted whose request has not arrived yet
MAX_HANDLERS = 8  # requests answered at once, a thread each
BACKLOG = 128  # connections the kernel holds before they are accepted (socketserver: 5)


class _Server(HTTPServer):
    request_queue_size = BACKLOG


class TextServer:
    """Serves ``render()`` at ``/metrics`` on ``host:port`` (0: a free port)."""

    def __init__(self, render: Callable[[], bytes], port: int, host: str) -> None:
        server = self

        class Handler(BaseHTTPRequestHandler):
            timeout = READ_S  # each read of the request, once it has started to arrive

            def parse_request(self) -> bool:
                parsed = super().parse_request()
                server._request_read(self.connection)  # the request's deadline is met
                return parsed

            def do_GET(self) -> None:
                if self.path.split("?", 1)[0] not in ("/metrics", "/"):
                    self.send_error(404, "only /metrics is served here")
                    return
                body = render()
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass  # a scrape every few seconds is not news

        self._server = _Server((host, port), Handler)
        self._server.socket.setblocking(False)  # accept only what the selector said is there
        bound = self._server.server_address
        self.address = (str(bound[0]), int(bound[1]))
        self._slots = threading.BoundedSemaphore(MAX_HANDLERS)
        # each silent connection: (when it is dropped, monotonic; its peer)
        self._waiting: dict[socket.socket, tuple[float, tuple[str, int]]] = {}
        # each connection answered: (its thread, when its request must have arrived, or
        # None once it has: a client sending a byte at a time held a slot for good)
        self._answering: dict[socket.socket, tuple[threading.Thread, float | None]] = {}
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(
            target=self._loop, name="sandboxq-exporter-http", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._wake_w.send(b"x")  # the loop ends and closes every silent connection
        self._thread.join()
        with self._lock:
            answering = dict(self._answering)
        for conn in answering:  # a handler blocked in a read ends now, not after READ_S
            _shut(conn)
        for thread, _ in answering.values():
            thread.join(READ_S)
        self._server.server_close()
        self._wake_r.close()
        self._wake_w.close()

    # -- the loop thread ------------------------------------------------------------------

    def _loop(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self._server.socket, selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            try:
                while self._step(selector):
                    pass
            finally:
                for conn in self._waiting:
                    conn.close()
                self._waiting.clear()

    def _step(self, selector: selectors.BaseSelector) -> bool:
        """Wait for a connection, a request or the nearest deadline; False on close."""
        now = time.monotonic()
        with self._lock:
            reading = [d for _, d in self._answering.values() if d is not None]
        deadline = min([d for d, _ in self._waiting.values()] + reading, default=None)
        for key, _ in selector.select(None if deadline is None else max(0.0, deadline - now)):
            if key.fileobj is self._wake_r:
                return False
            if key.fileobj is self._server.socket:
                self._accept(selector)
            elif key.fileobj in self._waiting:  # not dropped by an accept of this round
                conn = key.fileobj
                assert isinstance(conn, socket.socket)
                selector.unregister(conn)
                due, address = self._waiting.pop(conn)
                self._answer(conn, address, due)
        now = time.monotonic()
        for conn in [c for c, (d, _) in self._waiting.items() if d <= now]:
            self._drop(selector, conn)  # silent for READ_S: not a scrape
        with self._lock:  # as it is now: a request may have come in during the select
            late = [c for c, (_, d) in self._answering.items() if d is not None and d <= now]
            for conn in late:
                self._answering[conn] = (self._answering[conn][0], None)
        for conn in late:  # its request still not in after READ_S: its handler ends
            _shut(conn)
        return True

    def _accept(self, selector: selectors.BaseSelector) -> None:
        try:
            conn, address = self._server.socket.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # out of descriptors: the connection stays in the backlog
            log.debug("exporter: accept failed: %s", exc)
            return
        if len(self._waiting) >= MAX_WAITING:
            oldest = min(self._waiting, key=lambda c: self._waiting[c][0])
            self._drop(selector, oldest)
        conn.settimeout(READ_S)  # a read (the deadline below bounds the whole request)
        self._waiting[conn] = (time.monotonic() + READ_S, address)
        selector.register(conn, selectors.EVENT_READ)

    def _drop(self, selector: selectors.BaseSelector, conn: socket.socket) -> None:
        selector.unregister(conn)
        del self._waiting[conn]
        conn.close()

    def _answer(self, conn: socket.socket, address: tuple[str, int], due: float) -> None:
        """Answer on a thread of its own, or close at once when every slot is taken.
        ``due``: when the whole request must have arrived (READ_S after the accept)."""
        if not self._slots.acquire(blocking=False):
            conn.close()
            return
        thread = threading.Thread(
            target=self._handle, args=(conn, address), name="sandboxq-exporter-request", daemon=True
        )
        with self._lock:
            self._answering[conn] = (thread, due)
        thread.start()

    def _request_read(self, conn: socket.socket) -> None:
        with self._lock:
            if conn in self._answering:
                self._answering[conn] = (self._answering[conn][0], None)

    def _handle(self, conn: socket.socket, address: tuple[str, int]) -> None:
        try:
            self._server.finish_request(conn, address)
        except OSError as exc:  # the client went away, or its reads timed out
            log.debug("exporter: request from %s failed: %s", address[0], exc)
        finally:
            self._server.shutdown_request(conn)
            with self._lock:
                self._answering.pop(conn, None)
            self._slots.release()


def _shut(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed by its handler
