"""What a pool child keeps of the descriptors it was born with: its channel and stdio.

A child forked by the fork server (the default start method) inherits the fork server's
descriptors: the write end of its "alive" pipe (bytes written there made it exit: "Not
at EOF?"), the resource tracker's pipe (garbage there crashed the tracker), the pipe of
the launch, and whatever else the fork server held. A handler that wrote to every
descriptor it had could take down the helpers every other child needs (design invariant
11). ``isolate`` runs first thing in the child, before any of the user's code:

    every descriptor but stdio and its channel ──► dup2(/dev/null) onto its number

Why /dev/null over the number instead of closing it: Python objects in the child still
hold those numbers (multiprocess's ``resource_tracker._fd``, ``forkserver
._forkserver_alive_fd``, the parent sentinel, objects of modules preloaded in the fork
server) and may write to them or close them later. After a plain close the number would be
reused by the next file the handler opens, and such an object would write into that file,
or close it under the handler. Pointing the number at /dev/null leaves every holder a
descriptor that leads nowhere: writes vanish, reads see end of file, and a late close
closes only /dev/null. The descriptors are not inheritable, so a program the handler
starts does not get them.

A handler may also use up every descriptor the child may have, and return: the sweep after
its attempt opens a file per process it looks at, and failed, so what the attempt started
lived on beside the next job, which met "Too many open files" itself. So the child holds
one spare descriptor from its start (``keep_spare``); after each attempt ``make_room``
duplicates it and closes the copy (two system calls, under a microsecond), and when that
fails the table is full (or the handler closed the spare): the spare is closed, the sweep
has its descriptor, and the child is replaced before its next task (``spare_gone``).

What a child is given on purpose arrives with its launch (its channel; its shared page,
mapped and closed before this runs). Files a processor module opened at import, in the
fork server, are shared by every child and are replaced too: a handler opens what it
writes to itself.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from multiprocess import forkserver, reduction, resource_tracker

_STDIO = (0, 1, 2)

#: The child's spare descriptor (``keep_spare``); None before it is kept, or once given up.
_spare: int | None = None


def open_descriptors() -> list[int]:
    """This process's open descriptors (the one used to list them excluded)."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            os.fstat(fd)
        except OSError:  # the directory listing's own descriptor, closed by now
            continue
        found.append(fd)
    return found


def isolate(channel_fd: int, *given: int) -> int:
    """The child's first act: keep only ``channel_fd``, the other descriptors its launch
    ``given`` it (its stack-dump file) and stdio of what the fork server left it. A child
    started by ``spawn`` is a fresh program that received only what its
    launch passed: the resource tracker's pipe goes, and its launch pipes stay (the write
    end of one is how its parent sees it alive). Returns how many were replaced."""
    if forkserver.get_inherited_fds() is None:  # spawn
        tracker = resource_tracker._resource_tracker._fd
        return replace([tracker] if tracker is not None else [])
    return keep_only([channel_fd, *given])


def keep_only(keep: Iterable[int]) -> int:
    """Point every open descriptor but stdio and ``keep`` at /dev/null; returns how many."""
    kept = {*_STDIO, *keep}
    return replace(fd for fd in open_descriptors() if fd not in kept)


def replace(fds: Iterable[int]) -> int:
    """Point each of ``fds`` at /dev/null; returns how many."""
    devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    replaced = 0
    try:
        for fd in fds:
            if fd == devnull:
                continue
            try:
                os.dup2(devnull, fd, inheritable=False)
            except OSError:  # above a lowered RLIMIT_NOFILE: it cannot be pointed, so close
                os.close(fd)
            replaced += 1
    finally:
        os.close(devnull)
    return replaced


def keep_spare() -> None:
    """In the child, after ``isolate``: hold the descriptor ``make_room`` gives back."""
    global _spare
    _spare = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)


def make_room() -> None:
    """After an attempt, before its sweep: when the attempt left no descriptor free (or
    closed the spare), close the spare so that the sweep has one. Idempotent."""
    global _spare
    if _spare is None:
        return
    try:
        os.close(os.dup(_spare))
    except OSError:  # EMFILE: the table is full; EBADF: the handler closed the spare
        try:
            os.close(_spare)
        except OSError:
            pass
        _spare = None


def spare_gone() -> bool:
    """Whether ``make_room`` had to give the spare up: the child must be replaced."""
    return _spare is None


class ToChild:
    """A descriptor the parent holds, given to a child with its launch arguments: the
    child receives its own duplicate (multiprocess's ``DupFd``), which ``isolate`` keeps
    when it is named among the child's descriptors."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        return _received, (reduction.DupFd(self.fd),)


def _received(dup: Any) -> int:
    fd: int = dup.detach()
    return fd
