"""A throwaway ``redis-server`` on a free loopback port, for tests and benchmarks."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """Start with ``start()`` (or use as a context manager); ``url`` points at it.

    ``appendonly=True`` runs it with AOF and ``appendfsync always``, so a restart loses
    nothing that was acknowledged. ``stop()`` then ``start()`` restarts on the same port
    with the same data directory.
    """

    def __init__(
        self, *, port: int | None = None, appendonly: bool = False, extra_args: Sequence[str] = ()
    ) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise FileNotFoundError(
                "redis-server is not installed (apt-get install redis-server, or `make test`)"
            )
        self.port = port or free_port()
        self.appendonly = appendonly
        self.extra_args = list(extra_args)  # more redis-server options, e.g. for a Cluster node
        self._dir = tempfile.TemporaryDirectory(prefix="sandboxq-redis-")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        args = [
            str(self.binary),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            self._dir.name,
            "--save",
            "",
            "--daemonize",
            "no",
            "--appendonly",
            "yes" if self.appendonly else "no",
        ]
        if self.appendonly:
            args += ["--appendfsync", "always"]
        args += self.extra_args
        self.process = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL
        )
        deadline = time.monotonic() + timeout_s
        while not self.ping():
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with code {self.process.returncode}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"redis-server did not answer on port {self.port}")
            time.sleep(0.01)
        return self

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self.process = None

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def data_dir(self) -> Path:
        return Path(self._dir.name)
