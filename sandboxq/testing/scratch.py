"""Scratch directories for throwaway servers, swept once their owner is dead.

A directory removed at ``cleanup()`` stays behind when its process is killed (a test run
SIGKILLed by CI's timeout, ``kill -9`` of pytest): each such run left one in the temp
directory for good. So each holds a lock file, locked by its owner for as long as it
lives (the kernel lets go of the lock when the owner dies, however it dies), and making a
new one first removes those of the same prefix whose lock is free. Only the dead are
touched: a directory whose lock is held, or that holds no lock file yet, is left alone.

    ScratchDir(prefix) ─► sweep: <tmp>/<prefix>* with a free OWNER lock ─► removed
                      └─► mkdtemp ─► lock a file, then rename it to OWNER (locked before
                                     any sweep can see it)
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import threading
import weakref

#: The lock file in each directory, held by its owner for its whole life.
OWNER = "owner.lock"

_swept: set[str] = set()
_sweeping = threading.Lock()


class ScratchDir:
    """A fresh temporary directory (``name``), owned by this process until ``cleanup()``
    (or until it is garbage-collected, or this process exits, as ``TemporaryDirectory``)."""

    def __init__(self, prefix: str) -> None:
        sweep_once(prefix)
        self.name = tempfile.mkdtemp(prefix=prefix)
        fd, scratch = tempfile.mkstemp(dir=self.name)  # not inherited by what we start
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(scratch, os.path.join(self.name, OWNER))
        self._remove = weakref.finalize(self, _remove, self.name, fd)

    def cleanup(self) -> None:
        self._remove()


def _remove(name: str, lock_fd: int) -> None:
    shutil.rmtree(name, ignore_errors=True)
    os.close(lock_fd)  # after: a sweep never finds it free while it is still there


def sweep_once(prefix: str) -> None:
    """``sweep(prefix)``, the first time this process asks."""
    with _sweeping:
        if prefix in _swept:
            return
        _swept.add(prefix)
    sweep(prefix)


def sweep(prefix: str) -> list[str]:
    """Remove the directories ``<tmp>/<prefix>*`` of this user whose owner is dead (their
    lock is free); returns their paths."""
    root, removed = tempfile.gettempdir(), list[str]()
    try:
        entries = [e for e in os.scandir(root) if e.name.startswith(prefix)]
    except OSError:
        return removed
    for entry in entries:
        with contextlib.suppress(OSError):
            if not entry.is_dir(follow_symlinks=False) or entry.stat().st_uid != os.getuid():
                continue
            fd = os.open(os.path.join(entry.path, OWNER), os.O_RDONLY | os.O_NOFOLLOW)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: alive
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.path)
            finally:
                os.close(fd)
    return removed
