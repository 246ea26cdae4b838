"""Handlers that reach into a sibling child's memory, and the flag that decides whether
they can. Standard library only, already imported by every child, so a copy runs under
any ``user=``.

| handler            | protected children                      | unprotected children      |
|--------------------|-----------------------------------------|---------------------------|
| hold_secret(path)  | holds ``SECRET``, says where (``path``), until ``path.done`` exists |
| read_secret(path)  | ``{"read": "Permission denied"}``       | ``{"read": "ok"}``        |
| become_dumpable()  | ``[pid, 1]``: any process may set its own flag                      |
| dumpable()         | ``[pid, 0]`` (``prctl(PR_GET_DUMPABLE)``) | ``[pid, 1]``            |
"""

from __future__ import annotations

import ctypes
import os
import time
from typing import Any

SECRET = b"another job's secret"
_PR_GET_DUMPABLE, _PR_SET_DUMPABLE = 3, 4
_libc = ctypes.CDLL(None, use_errno=True)


def _barrier(path: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.01)


def hold_secret(path: str) -> str:
    """Hold ``SECRET`` in memory and write ``"<pid> <address>"`` to ``path``; return once
    ``path + ".done"`` exists (the sibling has tried)."""
    secret = ctypes.create_string_buffer(SECRET)
    with open(path + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {ctypes.addressof(secret)}")
    os.rename(path + ".tmp", path)
    _barrier(path + ".done")
    return secret.value.decode()


def read_secret(path: str) -> dict[str, Any]:
    """Read the secret ``hold_secret`` holds in another child through ``/proc/<pid>/mem``
    (what ptrace would give), then let it return. An error is its ``strerror``."""
    try:
        _barrier(path)
        with open(path) as f:
            pid, address = (int(n) for n in f.read().split())
        try:
            with open(f"/proc/{pid}/mem", "rb", 0) as mem:
                mem.seek(address)
                got = mem.read(len(SECRET))
        except OSError as exc:
            return {"read": exc.strerror or str(exc)}
        return {"read": "ok" if got == SECRET else f"read something else: {got!r}"}
    finally:
        open(path + ".done", "w").close()


def become_dumpable() -> list[int]:
    """Set this process dumpable (any process may), as an attempt preparing its child for
    a later one would; returns its pid and the flag."""
    _libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)
    return dumpable()


def dumpable() -> list[int]:
    """This process's pid and its dumpable flag."""
    return [os.getpid(), int(_libc.prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0))]


def call(name: str, *args: Any) -> Any:
    """Run the handler ``name`` of this module (one pool, several handlers)."""
    return globals()[name](*args)
