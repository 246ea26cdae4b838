"""The memory one pool child shares with its parent, and with nothing else.

    parent: ChildMemory() ── memfd_create + mmap: the raw ctypes values the parent uses
                 │           (.soft, .shared), one page of its own per child
                 │ for_child(): picklable views of the same page, in the Process args;
                 ▼ the memfd crosses with the launch (multiprocess's DupFd), then closed
    child:  the page is mapped again from that fd (libc mmap, no Python mmap object) and
            the fd closed at once: the child holds a mapping of its own values and no
            descriptor of it

Layout of the page: [0] the soft-signal target (int64), [8:] the ``shared`` array of
child.py (``SHARED_SIZE`` int64).

Why not multiprocess's ``RawValue``/``RawArray``: they are carved from a shared heap
*arena*, one file mapped by every child of the process, so each child held a descriptor
of it and a mapping that also held the other children's values: a handler writing to its
descriptors, or a little past its own values, could move another child's soft-signal
target or started mark. Here a child can reach only its own page: one job's blast
radius is its own attempt (design invariant 11).
"""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import Any

from multiprocess import reduction

from sandboxq.pool.child import SHARED_SIZE

_SOFT, _SHARED = 0, 8
_SIZE = max(mmap.PAGESIZE, _SHARED + 8 * SHARED_SIZE)
_TYPES: dict[int, Any] = {
    _SOFT: ctypes.c_int64,
    _SHARED: ctypes.c_int64 * SHARED_SIZE,
}


class ChildMemory:
    """One child's page, as its parent holds it. ``soft`` and ``shared`` are ctypes
    objects on the page (``.value``, indexing), as multiprocess's raw values were."""

    __slots__ = ("_fd", "_map", "shared", "soft")

    def __init__(self) -> None:
        self._fd = os.memfd_create("sandboxq-child", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, _SIZE)
            self._map = mmap.mmap(self._fd, _SIZE)
        except BaseException:
            os.close(self._fd)
            raise
        self.soft = ctypes.c_int64.from_buffer(self._map, _SOFT)
        self.shared = (ctypes.c_int64 * SHARED_SIZE).from_buffer(self._map, _SHARED)

    def for_child(self) -> tuple[Any, Any]:
        """Picklable views of ``soft`` and ``shared`` for the child's arguments (the two
        share one page: pickled in one launch, it is mapped once)."""
        page = _Page(self._fd)
        return _View(page, _SOFT), _View(page, _SHARED)

    def launched(self) -> None:
        """The child has the page (or never will): close the memfd, keep the mapping."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class _Page:
    """The memfd on its way to the child (once per launch, whatever the number of views)."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        return _map_in_child, (reduction.DupFd(self.fd),)


class _View:
    __slots__ = ("offset", "page")

    def __init__(self, page: _Page, offset: int) -> None:
        self.page, self.offset = page, offset

    def __reduce__(self) -> tuple[Any, ...]:
        return _view_in_child, (self.page, self.offset)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
)
_MAP_FAILED = ctypes.c_void_p(-1).value


def _map_in_child(dup: Any) -> int:
    """In the child: map the page and close its descriptor (a Python ``mmap`` would keep a
    duplicate of it open for as long as it lives). Returns the page's address."""
    fd = dup.detach()
    try:
        address = _libc.mmap(None, _SIZE, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        if address in (None, _MAP_FAILED):
            errno = ctypes.get_errno()
            raise OSError(errno, f"mapping the child's shared page: {os.strerror(errno)}")
    finally:
        os.close(fd)
    return int(address)


def _view_in_child(address: int, offset: int) -> Any:
    """In the child: the ctypes value at ``offset`` of its page (mapped for its life)."""
    return _TYPES[offset].from_address(address + offset)
