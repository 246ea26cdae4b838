"""A handler whose grandchild, not itself, goes over the attempt's memory limit."""

from __future__ import annotations

import os
import time


def grandchild_grows(mb: int, then: str = "return", hold_s: float = 5.0) -> int:
    """Forks a process that touches ``mb`` MB and holds them ``hold_s`` (long enough for
    a memory sample to see it), waits for it, then returns its wait status
    (``then="raise"``: raises with it): the handler itself stays small and answers."""
    pid = os.fork()
    if pid == 0:
        block = bytearray(mb * 1024 * 1024)
        for i in range(0, len(block), 4096):
            block[i] = 1
        time.sleep(hold_s)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if then == "raise":
        raise RuntimeError(f"the grandchild ended with status {status}")
    return status
