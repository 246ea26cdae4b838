"""Linux process controls (prctl) used to tie process lifetimes together.

On other platforms these are no-ops and the no-orphan guarantee after a parent SIGKILL
does not hold; hard kills by the supervisor still work everywhere psutil does.
"""

from __future__ import annotations

import ctypes
import os
import sys

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36

_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _prctl(option: int, value: int) -> None:
    if _libc is None:
        return
    if _libc.prctl(option, value, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def die_with_parent(signum: int) -> bool:
    """Ask the kernel to send ``signum`` when our parent thread exits.

    Returns False when the parent is already gone (it died before the request took effect),
    so the caller can act at once instead of waiting for a signal that will never come.
    """
    parent = os.getppid()
    _prctl(_PR_SET_PDEATHSIG, signum)
    return os.getppid() == parent


def become_subreaper(on: bool = True) -> None:
    """Orphaned descendants are re-parented to us instead of to init, so we can find them
    (``on=False``: no longer; those already re-parented stay our children)."""
    _prctl(_PR_SET_CHILD_SUBREAPER, int(on))
