"""A throwaway Redis Cluster on loopback: three masters, no replicas, for tests and benchmarks.

    RedisServer x3  (--cluster-enabled yes, each with its own port, bus port and data dir)
        └─ redis-cli --cluster create 127.0.0.1:p1 ... --cluster-replicas 0 --cluster-yes
             └─ ready once every node reports cluster_state:ok

``url`` is the ``redis+cluster://`` URL sandboxq takes; ``move_slot()`` moves one hash
slot (a queue's) with its keys to another node, as a resharding would. ``close()`` (or
leaving the ``with`` block) stops every node and deletes its data, also when the start
failed half-way.
Needs ``redis-server`` and ``redis-cli`` (Debian: the redis-server package pulls in
redis-tools, which holds redis-cli).
"""

from __future__ import annotations

import shutil
import subprocess
import time

from sandboxq.testing.redis_server import RedisServer, free_port


class LocalCluster:
    """``masters`` redis-server processes joined into one Cluster covering all 16384 slots."""

    def __init__(self, masters: int = 3) -> None:
        if masters < 3:
            raise ValueError("redis-cli --cluster create needs at least 3 masters")
        cli = shutil.which("redis-cli")
        if cli is None:
            raise FileNotFoundError(
                "redis-cli is not installed (apt-get install redis-tools, or `make test`)"
            )
        self.cli = cli
        self.nodes = [
            RedisServer(
                extra_args=[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",  # inside the node's own --dir
                    # The bus port defaults to port + 10000, which may be taken or > 65535.
                    "--cluster-port",
                    str(free_port()),
                    "--cluster-node-timeout",
                    "2000",
                ]
            )
            for _ in range(masters)
        ]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    @property
    def ports(self) -> list[int]:
        return [n.port for n in self.nodes]

    def start(self, timeout_s: float = 30.0) -> LocalCluster:
        deadline = time.monotonic() + timeout_s
        try:
            for node in self.nodes:
                node.start()
            self._cli(
                "--cluster",
                "create",
                *(f"127.0.0.1:{port}" for port in self.ports),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
                timeout_s=max(1.0, deadline - time.monotonic()),
            )
            while not all(self._state(port) == "ok" for port in self.ports):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the cluster on ports {self.ports} did not become ready")
                time.sleep(0.05)
        except BaseException:
            self.close()
            raise
        return self

    def _cli(self, *args: str, timeout_s: float = 10.0) -> str:
        done = subprocess.run(
            [self.cli, *args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli {' '.join(args)} failed: {done.stdout}{done.stderr}")
        return done.stdout

    def _state(self, port: int) -> str:
        """The node's ``cluster_state`` (``ok`` once it serves every slot)."""
        for line in self._cli("-p", str(port), "cluster", "info").splitlines():
            if line.startswith("cluster_state:"):
                return line.split(":", 1)[1].strip()
        return "unknown"

    def owner(self, slot: int) -> int:
        """The port of the node that serves ``slot``."""
        for port in self.ports:
            for line in self._cli("-p", str(port), "cluster", "nodes").splitlines():
                fields = line.split()
                if "myself" not in fields[2]:
                    continue
                for span in fields[8:]:
                    first, _, last = span.partition("-")
                    if first.isdigit() and int(first) <= slot <= int(last or first):
                        return port
        raise LookupError(f"no node serves slot {slot}")

    def move_slot(self, slot: int, to_port: int) -> None:
        """Migrate ``slot`` and its keys to the node on ``to_port`` (CLUSTER SETSLOT, MIGRATE)."""
        from_port = self.owner(slot)
        if from_port == to_port:
            return
        src, dst = str(from_port), str(to_port)
        src_id = self._cli("-p", src, "cluster", "myid").strip()
        dst_id = self._cli("-p", dst, "cluster", "myid").strip()
        self._cli("-p", dst, "cluster", "setslot", str(slot), "importing", src_id)
        self._cli("-p", src, "cluster", "setslot", str(slot), "migrating", dst_id)
        while keys := self._cli("-p", src, "cluster", "getkeysinslot", str(slot), "100").split():
            self._cli("-p", src, "migrate", "127.0.0.1", dst, "", "0", "5000", "keys", *keys)
        for port in self.ports:
            self._cli("-p", str(port), "cluster", "setslot", str(slot), "node", dst_id)

    def close(self) -> None:
        for node in self.nodes:
            node.close()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
