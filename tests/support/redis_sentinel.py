"""A throwaway Redis Sentinel setup on loopback: a master, a replica, and sentinels that
promote the replica when the master dies. For tests of failover.

    RedisServer (master) ◄── replicaof ── RedisServer (replica)
          ▲  monitored as ``service`` (quorum 1, down after 1 s of silence)
    redis-server sentinel-N.conf --sentinel   x ``sentinels``

``url`` is the ``redis+sentinel://`` URL sandboxq takes. ``kill_master()`` SIGKILLs the
master and returns once the sentinels name the replica as the new master. ``close()``
stops every process and deletes their data, also when the start failed half-way.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from sandboxq.testing.redis_server import (
    RedisServer,
    ends_with_this_process,
    free_port,
    terminate,
)


class LocalSentinel:
    def __init__(self, sentinels: int = 2, service: str = "sandboxq") -> None:
        cli = shutil.which("redis-cli")
        if cli is None:
            raise FileNotFoundError(
                "redis-cli is not installed (apt-get install redis-tools, or `make test`)"
            )
        self.cli = cli
        self.service = service
        self.master = RedisServer()
        self.replica = RedisServer()  # of the master's port, known once it has started
        self.sentinel_ports = [free_port() for _ in range(sentinels)]
        self._dir = tempfile.TemporaryDirectory(prefix="sandboxq-sentinel-")
        self._sentinels: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{self.service}/0"

    def start(self, timeout_s: float = 30.0) -> LocalSentinel:
        deadline = time.monotonic() + timeout_s
        try:
            self.master.start()  # on another port if its own was taken meanwhile
            self.replica.extra_args = ["--replicaof", "127.0.0.1", str(self.master.port)]
            self.replica.start()
            for port in self.sentinel_ports:
                self._sentinels.append(self._start_sentinel(port))
            self._wait(deadline, "the replica to sync and every sentinel to see it", self._ready)
        except BaseException:
            self.close()
            raise
        return self

    def _start_sentinel(self, port: int) -> subprocess.Popen[bytes]:
        workdir = Path(self._dir.name) / str(port)
        workdir.mkdir()
        config = workdir / "sentinel.conf"  # sentinel rewrites it: it must be its own file
        config.write_text(
            f"port {port}\n"
            "bind 127.0.0.1\n"
            f"dir {workdir}\n"
            f"sentinel monitor {self.service} 127.0.0.1 {self.master.port} 1\n"
            f"sentinel down-after-milliseconds {self.service} 1000\n"
            f"sentinel failover-timeout {self.service} 5000\n"
        )
        return subprocess.Popen(
            [str(self.master.binary), str(config), "--sentinel"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            preexec_fn=ends_with_this_process(),
        )

    def _cli(self, port: int, *args: str) -> str:
        done = subprocess.run(
            [self.cli, "-p", str(port), *args],
            capture_output=True,
            text=True,
            timeout=10,
            stdin=subprocess.DEVNULL,
        )
        return done.stdout if done.returncode == 0 else ""

    def _ready(self) -> bool:
        info = self._cli(self.replica.port, "info", "replication")
        if "master_link_status:up" not in info:
            return False
        return all(
            str(self.replica.port) in self._cli(port, "sentinel", "replicas", self.service)
            for port in self.sentinel_ports
        )

    def master_port(self) -> int | None:
        """The master's port as the first sentinel that answers names it."""
        for port in self.sentinel_ports:
            lines = self._cli(port, "sentinel", "get-master-addr-by-name", self.service).split()
            if len(lines) == 2:
                return int(lines[1])
        return None

    def kill_master(self, timeout_s: float = 30.0) -> None:
        """SIGKILL the master; return once the sentinels have promoted the replica."""
        assert self.master.process is not None, "the master is not running"
        self.master.process.send_signal(signal.SIGKILL)
        self.master.stop()
        self._wait(
            time.monotonic() + timeout_s,
            "the sentinels to promote the replica",
            lambda: (
                self.master_port() == self.replica.port
                and "role:master" in self._cli(self.replica.port, "info", "replication")
            ),
        )

    @staticmethod
    def _wait(deadline: float, what: str, condition: Callable[[], bool]) -> None:
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}")
            time.sleep(0.05)

    def close(self) -> None:
        for proc in self._sentinels:
            terminate(proc, 5)
        self._sentinels.clear()
        self.replica.close()
        self.master.close()
        self._dir.cleanup()

    def __enter__(self) -> LocalSentinel:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
