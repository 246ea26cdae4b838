"""``GET /metrics`` answered with text a function writes, on a daemon thread.

    Prometheus ── GET /metrics ──► TextServer ──► render() ──► 200 text/plain; version=0.0.4

The exporter writes its few gauge families itself (exporter.py ``exposition``): with
1,000 queues, prometheus_client's formatting of 8,000 samples one by one (label
validation, escaping) cost as much as reading Redis. Any other path is 404.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class TextServer:
    """Serves ``render()`` at ``/metrics`` on ``host:port`` (0: a free port)."""

    def __init__(self, render: Callable[[], bytes], port: int, host: str) -> None:
        class Handler(BaseHTTPRequestHandler):
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

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        bound = self._server.server_address
        self.address = (str(bound[0]), int(bound[1]))
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="sandboxq-exporter-http", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
