"""A child blocked in ``read()`` with the pool child's signal set-up: the stack dump
armed on ``stacks.DUMP_SIGNAL`` (to the descriptor given as argv[1]) and the soft signal's
Python handler raising. It prints ``armed``, then ``soft`` once the soft signal has
ended the read, or ``returned`` if the read ever came back.

    python -m tests.support.soft_during_dump DUMP_FD
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

from sandboxq.errors import SoftTimeout
from sandboxq.pool import stacks
from sandboxq.pool.child import SIGSOFT


def _soft(signum: int, frame: FrameType | None) -> None:
    raise SoftTimeout("soft")


def main() -> None:
    stacks.arm(int(sys.argv[1]))
    signal.signal(SIGSOFT, _soft)
    blocked, _writer = os.pipe()
    print("armed", flush=True)
    try:
        os.read(blocked, 1)
    except SoftTimeout:
        print("soft", flush=True)
    else:
        print("returned", flush=True)


if __name__ == "__main__":
    main()
