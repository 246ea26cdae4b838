"""A pool's hold on its control groups for its whole life: an ``flock`` on the pool group's
own directory (one per v1 hierarchy), which the kernel releases when the holder dies,
however it dies.

    pool start: make(path) ── mkdir ─► open ─► flock(LOCK_EX) ─► still the same directory?
                                                                  (a cleaner may have
                                                                  removed it meanwhile:
                                                                  make it again)
                stale(parent) ── each sandboxq.*.locked group whose flock can be taken now
                                 ──► its owner is dead: the caller removes it, lock in hand
                                 (a group of a version without locks: only once empty)
    pool close: the groups removed, then release()

Why a lock, not a pid: a group named after its owner's pid (and start time) was taken
for stale when no such process could be seen, and an owner in another PID namespace (a
container sharing the host's groups) or hidden by ``/proc``'s ``hidepid`` cannot be: one
pool killed another live pool's running jobs. The lock lives on the group directory
itself, so every process that can see the group sees its lock, whatever its namespaces.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os

from sandboxq.pool.cgroups import LOCKED_SUFFIX, PREFIX


class PoolLock:
    """The open, locked directories of one pool group (closing them releases it)."""

    def __init__(self) -> None:
        self._fds: list[int] = []

    def make(self, path: str) -> None:
        """Create the group directory ``path`` (if need be) and lock it for this pool's
        life. A cleaner that found it unlocked between the two steps has removed it
        while we waited for the lock: then it is made again."""
        while True:
            with contextlib.suppress(FileExistsError):
                os.mkdir(path)
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                if _same(fd, path):
                    self._fds.append(fd)
                    return
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)

    def release(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()


def _same(fd: int, path: str) -> bool:
    try:
        there = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (there.st_dev, there.st_ino) == (held.st_dev, held.st_ino)


class Stale:
    """A dead pool's group, locked by us while it is removed (``release`` after)."""

    def __init__(self, name: str, fd: int) -> None:
        self.name = name
        self._fd = fd

    def release(self) -> None:
        os.close(self._fd)


def stale(parent: str) -> list[Stale]:
    """The pool groups below ``parent`` whose owner is gone (their lock was free, and is
    ours now: no pool can take them back while we remove them)."""
    try:
        names = [n for n in os.listdir(parent) if n.startswith(PREFIX)]
    except OSError:
        return []
    found = []
    for name in names:
        try:
            fd = os.open(os.path.join(parent, name), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            continue  # removed meanwhile, or not a directory
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            continue  # held: its pool is alive
        if name.endswith(LOCKED_SUFFIX) or not _holds_processes(os.path.join(parent, name)):
            found.append(Stale(name, fd))
        else:
            # Made by a version that held no lock: whether its pool lives cannot be told,
            # so it is removed only once it holds no process (removing kills nothing).
            os.close(fd)
    return found


def _holds_processes(group: str) -> bool:
    for path, _, files in os.walk(group):
        if "cgroup.procs" in files:
            with contextlib.suppress(OSError), open(os.path.join(path, "cgroup.procs")) as f:
                if f.read().strip():
                    return True
    return False
