"""Processors for the demo: good jobs, and the kinds of bad ones sandboxq exists for."""

from __future__ import annotations

import hashlib
import os
import time


def thumbnail(name: str, size: int = 256) -> dict[str, object]:
    """A stand-in for real CPU work: hash a buffer a few hundred times."""
    data = name.encode() * 4096
    for _ in range(200):
        data = hashlib.sha256(data).digest() * 1024
    return {"name": name, "size": size, "digest": hashlib.sha256(data).hexdigest()[:12]}


def misbehave(kind: str) -> str:
    """Each kind ends differently: ok, hang (GIL held in C), crash, exit code, raise."""
    if kind == "hang":
        return str(sum(range(10**13)))  # one C call holding the GIL: only a kill ends it
    if kind == "crash":
        os.kill(os.getpid(), 11)  # SIGSEGV
    if kind == "exit":
        os._exit(10)
    if kind == "raise":
        raise ValueError("bad input")
    if kind == "slow":
        time.sleep(0.2)
    return f"{kind}: done"


def route(name: str, size: int = 256) -> object:
    """One processor for the demo queue: image names are thumbnailed, anything else misbehaves."""
    if name.endswith(".png"):
        return thumbnail(name, size)
    return misbehave(name)
