"""A throwaway Prometheus server for tests: on a free loopback port, its storage in a
temporary directory, scraping targets listed in a file it watches.

    prom = PrometheusServer(scrape_interval_s=0.5).start()
    prom.set_targets(["127.0.0.1:9101", ...])   # file_sd: picked up without a restart
    prom.query('sandboxq_attempts_total{outcome="ok"}')   # -> [(labels, value), ...]
    prom.close()

The targets come from a file (``file_sd_configs``) because a worker or exporter started
on port 0 learns its port only after Prometheus is already running.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from sandboxq.testing.redis_server import ends_with_this_process, free_port, terminate


class PrometheusNotFound(FileNotFoundError):
    """The ``prometheus`` binary is not installed."""


class PrometheusServer:
    def __init__(self, *, scrape_interval_s: float = 0.5, binary: str = "prometheus") -> None:
        found = shutil.which(binary)
        if found is None:
            raise PrometheusNotFound(
                f"{binary!r} is not on PATH: apt-get install prometheus (or `make servers`)"
            )
        self.binary = found
        self.scrape_interval_s = scrape_interval_s
        self.port = free_port()
        self._dir = Path(tempfile.mkdtemp(prefix="sandboxq-prometheus-"))
        self._targets = self._dir / "targets.json"
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _config(self) -> str:
        interval = f"{max(1, round(self.scrape_interval_s * 1000))}ms"
        return (
            "global:\n"
            f"  scrape_interval: {interval}\n"
            f"  scrape_timeout: {interval}\n"
            "scrape_configs:\n"
            "  - job_name: sandboxq\n"
            "    file_sd_configs:\n"
            f"      - files: ['{self._targets}']\n"
            "        refresh_interval: 1s\n"
        )

    def start(self, timeout_s: float = 20.0) -> PrometheusServer:
        self._targets.write_text("[]")
        config = self._dir / "prometheus.yml"
        config.write_text(self._config())
        self._log = (self._dir / "prometheus.log").open("wb")
        self._proc = subprocess.Popen(
            [
                self.binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={self._dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=subprocess.DEVNULL,
            stderr=self._log,
            preexec_fn=ends_with_this_process(),
        )
        deadline = time.monotonic() + timeout_s
        while True:
            if self._proc.poll() is not None:
                log = (self._dir / "prometheus.log").read_text(errors="replace")
                raise RuntimeError(f"prometheus exited with {self._proc.returncode}: {log}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as reply:
                    if reply.status == 200:
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"prometheus was not ready within {timeout_s} s")
            time.sleep(0.1)

    def set_targets(self, targets: list[str]) -> None:
        """Scrape ``targets`` (``host:port``) from now on; written atomically."""
        tmp = self._targets.with_suffix(".tmp")
        tmp.write_text(json.dumps([{"targets": targets}]))
        tmp.replace(self._targets)

    def query(self, expr: str) -> list[tuple[dict[str, str], float]]:
        """An instant query: (labels, value) per series of the result vector."""
        query = urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{query}", timeout=5) as reply:
            body: dict[str, Any] = json.load(reply)
        if body.get("status") != "success":
            raise RuntimeError(f"query {expr!r} failed: {body}")
        return [(r["metric"], float(r["value"][1])) for r in body["data"]["result"]]

    def close(self) -> None:
        if self._proc is not None:
            terminate(self._proc, 10)
        self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
