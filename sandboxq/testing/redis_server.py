"""A throwaway ``redis-server`` for tests and benchmarks: on a free loopback port, or on a
Unix socket in a private directory, with its data in a temporary directory removed on
``close()`` (or, when this process is killed, by the next server's start: scratch.py).
With ``tls=TlsFiles(...)`` it speaks TLS only (``rediss://``), optionally requiring
client certificates (mutual TLS). ``free_port()``, ``terminate(proc, grace_s)`` and
``ends_with_this_process()`` serve every throwaway server of ``sandboxq.testing``."""

from __future__ import annotations

import shutil
import signal
import socket
import ssl
import subprocess
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from sandboxq.pool import linux
from sandboxq.testing.scratch import ScratchDir

#: The binary looked up on PATH when none is named.
BINARY = "redis-server"

#: Ports a server that chose its own tries before its start fails.
_PORT_TRIES = 3

#: sockaddr_un holds 108 bytes on Linux (104 on macOS), the terminating NUL included.
_MAX_SOCKET_PATH = 103


class RedisServerNotFound(FileNotFoundError):
    """The ``redis-server`` binary is not installed, or not where it was said to be."""


def find_binary(binary: str | None = None) -> str:
    """The path of ``binary`` (default: ``redis-server`` on PATH), or ``RedisServerNotFound``
    saying how to get one."""
    found = shutil.which(binary or BINARY)
    if found is None:
        where = f"{binary!r} was not found" if binary else "redis-server is not on PATH"
        raise RedisServerNotFound(
            f"{where}: install it (apt-get install redis-server, brew install redis, "
            "or `make test` in a sandboxq checkout) or point at a running server"
        )
    return found


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for a TLS ``RedisServer``: its certificate chain and key, and the CA it
    checks client certificates against (``client_auth``: clients must present one)."""

    cert_file: Path
    key_file: Path
    ca_file: Path
    client_auth: bool = False
    #: A client certificate and key the server's own readiness check presents.
    client_cert_file: Path | None = None
    client_key_file: Path | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def terminate(proc: subprocess.Popen[Any], grace_s: float) -> None:
    """End a server the way every throwaway server here ends: SIGTERM (a clean exit), then
    SIGKILL if it has not exited ``grace_s`` later; reaped either way."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(grace_s)


def ends_with_this_process() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel SIGKILL the server when this process dies
    without stopping it (pytest-timeout's thread method ends a hung run with
    ``os._exit``: no teardown runs). The signal is tied to the starting *thread*, so it
    is asked for only on the main thread, which lives as long as the process."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return _die_with_parent


def _die_with_parent() -> None:
    linux.die_with_parent(signal.SIGKILL)


#: Every RedisServer of this process (``started_pids``).
_servers: weakref.WeakSet[RedisServer] = weakref.WeakSet()


def started_pids() -> set[int]:
    """The pids of the redis-servers running that a ``RedisServer`` of this process
    started: the orphan check (testing/processes.py) counts them as the suite's own."""
    return {s.process.pid for s in list(_servers) if s.process is not None}


class RedisServer:
    """Start with ``start()`` (or use as a context manager); ``url`` points at it.

    ``unix_socket=True`` listens on a Unix socket in its own directory instead of a TCP
    port (no port to collide with, nothing reachable from the network). ``appendonly=True``
    runs it with AOF and ``appendfsync always``, so a restart loses nothing that was
    acknowledged. ``stop()`` then ``start()`` restarts at the same address with the same
    data directory. ``binary`` names the executable (default: ``redis-server`` on PATH).
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        unix_socket: bool = False,
        appendonly: bool = False,
        binary: str | None = None,
        extra_args: Sequence[str] = (),
        tls: TlsFiles | None = None,
    ) -> None:
        if unix_socket and (port is not None or tls is not None):
            raise ValueError("a RedisServer on a Unix socket has no port and no TLS")
        self.binary = find_binary(binary)
        self.extra_args = list(extra_args)  # more redis-server options, e.g. for a Cluster node
        # swept by a later start once this process is dead, however it died
        self._dir = ScratchDir("sandboxq-redis-")
        #: What the server writes (its log): the last line says why it could not start.
        self._log = Path(self._dir.name) / "redis-server.log"
        self.socket_path: Path | None = None
        self.port = 0
        if unix_socket:
            self.socket_path = Path(self._dir.name) / "redis.sock"
            if len(str(self.socket_path)) > _MAX_SOCKET_PATH:
                self._dir.cleanup()
                raise ValueError(
                    f"the socket path {self.socket_path} is too long for a Unix socket; "
                    "set TMPDIR to a shorter directory"
                )
        else:
            self.port = port or free_port()
        #: Whether start() may move to another port: one it chose, before the first start
        #: (a restart keeps its address).
        self._may_move = port is None and not unix_socket
        self.appendonly = appendonly
        self.tls = tls
        self.process: subprocess.Popen[bytes] | None = None
        _servers.add(self)

    @property
    def url(self) -> str:
        if self.socket_path is not None:
            return f"unix://{self.socket_path}?db=0"
        if self.tls is not None:  # the certificates name localhost
            return f"rediss://localhost:{self.port}/0"
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def address(self) -> str:
        """Where it listens, for messages: a socket path or host:port."""
        return str(self.socket_path) if self.socket_path else f"127.0.0.1:{self.port}"

    def _args(self) -> list[str]:
        if self.socket_path is not None:
            where = [
                "--port",
                "0",
                "--unixsocket",
                str(self.socket_path),
                "--unixsocketperm",
                "700",
            ]
        elif self.tls is not None:
            tls = self.tls
            where = ["--port", "0", "--tls-port", str(self.port), "--bind", "127.0.0.1"]
            where += ["--tls-cert-file", str(tls.cert_file), "--tls-key-file", str(tls.key_file)]
            where += ["--tls-ca-cert-file", str(tls.ca_file)]
            where += ["--tls-auth-clients", "yes" if tls.client_auth else "no"]
        else:
            where = ["--port", str(self.port), "--bind", "127.0.0.1"]
        args = [self.binary, *where, "--dir", self._dir.name, "--save", "", "--daemonize", "no"]
        args += ["--appendonly", "yes" if self.appendonly else "no"]
        if self.appendonly:
            args += ["--appendfsync", "always"]
        args += self.extra_args
        return args

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        """Start the server and wait until it answers. A free port can be taken between
        ``free_port()`` and the server's bind (test suites running side by side, each
        starting servers): a server that then exits is started again on another port,
        and another process's server answering on ours is not taken for it."""
        deadline = time.monotonic() + timeout_s
        tries = _PORT_TRIES if self._may_move else 1
        for tried in range(1, tries + 1):
            if (code := self._exit_before_ready(deadline)) is None:
                self._may_move = False
                return self
            why = f"redis-server exited with code {code} ({self.address}): {self._last_said()}"
            if tried < tries:
                self.port = free_port()
        ports = f"; it tried {tries} free ports" if tries > 1 else ""
        raise RuntimeError(f"{why} [{self.binary}]{ports}")

    def _last_said(self) -> str:
        """Why the server exited: its last two warnings ("pid:role date time # message",
        the message alone; a bind that failed is two), else its last line."""
        try:
            lines = self._log.read_text(errors="replace").strip().splitlines()
        except OSError:
            lines = []
        warnings = [line.split(" # ", 1)[1] for line in lines if " # " in line]
        return "; ".join(warnings[-2:])[:400] or (lines[-1][:400] if lines else "no log")

    def _exit_before_ready(self, deadline: float) -> int | None:
        """Start the process and wait until it answers (None), or until it exits (its
        exit status); ``TimeoutError`` past ``deadline``."""
        with open(self._log, "wb") as log:  # this start's; the child keeps its own copy
            self.process = subprocess.Popen(
                self._args(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=ends_with_this_process(),
                # Out of the terminal's process group: a Ctrl-C meant for pytest killed the
                # server first, and every teardown then logged Redis errors.
                start_new_session=True,
            )
        while not (self.ping() and self._listening()):
            if (code := self.process.poll()) is not None:
                self.process = None
                return code
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"redis-server did not answer at {self.address} [{self.binary}]")
            time.sleep(0.01)
        return None

    def _listening(self) -> bool:
        """Whether the process we started is the one listening at our address."""
        if self.process is None:
            return False
        if self.socket_path is not None:  # in a directory of our own
            return True
        try:
            sockets = psutil.Process(self.process.pid).net_connections(kind="tcp")
        except psutil.AccessDenied:
            return True  # where its sockets cannot be read, the answer is all there is
        except psutil.Error:
            return False
        return any(c.status == psutil.CONN_LISTEN and c.laddr.port == self.port for c in sockets)

    def _connect(self) -> socket.socket:
        if self.socket_path is not None:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.settimeout(0.5)
                s.connect(str(self.socket_path))
            except OSError:
                s.close()
                raise
            return s
        plain = socket.create_connection(("127.0.0.1", self.port), timeout=0.5)
        if self.tls is None:
            return plain
        # Readiness only: the certificate may be made to fail verification on purpose.
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        if self.tls.client_cert_file is not None:
            context.load_cert_chain(self.tls.client_cert_file, self.tls.client_key_file)
        try:
            return context.wrap_socket(plain, server_hostname="localhost")
        except (OSError, ssl.SSLError):
            plain.close()
            raise

    def ping(self) -> bool:
        try:
            with self._connect() as s:
                s.sendall(b"PING\r\n")
                # NOAUTH: it answers, and wants a password (--requirepass): ready too
                return s.recv(16).startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False

    def stop(self) -> None:
        if self.process is not None:
            terminate(self.process, 5)
        self.process = None

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()

    def __enter__(self) -> RedisServer:
        try:
            return self.start()
        except BaseException:
            self._dir.cleanup()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def data_dir(self) -> Path:
        return Path(self._dir.name)
