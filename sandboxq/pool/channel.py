"""A child's pipe: one socketpair end carrying length-prefixed pickled messages.

Why not ``multiprocess.connection.Connection``: it spends two reads per message (header,
then body). Here one ``recv`` takes everything the peer has sent so far and every complete
frame in it is returned, so a burst of results costs one syscall. Several messages sent
together travel as one frame holding their tuple: one pickle call instead of one per
message (messages are never tuples themselves, so a tuple is always such a batch).
"""

from __future__ import annotations

import io
import pickle
import socket
import struct
from collections import deque
from typing import Any

from sandboxq.pool import messages

_HEADER = struct.Struct("!I")
_CHUNK = 256 * 1024
_ACCEPTED = {
    cls.__name__: cls
    for cls in (
        messages.Ready,
        messages.Progress,
        messages.Finished,
        messages.Failed,
        messages.RemoteError,
    )
}


class BadMessage(Exception):
    """A frame from a child that the parent cannot or will not decode."""


class _MessageUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == messages.__name__ and name in _ACCEPTED:
            return _ACCEPTED[name]
        raise pickle.UnpicklingError(f"{module}.{name} is not a message a child may send")


def _text(value: Any) -> bool:
    """A str UTF-8 can carry: one with a lone surrogate could not be stored (Redis keeps
    UTF-8), and the worker died writing it. The child's own sends are made storable
    (``text.storable``); a handler that writes to the channel itself is refused here."""
    if type(value) is not str:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _remote_error(e: Any) -> bool:
    return (
        type(e) is messages.RemoteError
        and _text(e.type_name)
        and _text(e.message)
        and _text(e.traceback)
        and (e.pickled is None or type(e.pickled) is bytes)
    )


def _peak(peak: Any) -> bool:
    return peak is None or (type(peak) is int and 0 <= peak < 1 << 62)


#: What each message's fields must be: a well-formed pickle of the wrong shape is refused
#: here rather than failing later inside a callback.
_WELL_FORMED = {
    messages.Finished: lambda m: (
        type(m.task_id) is int and type(m.result) is bytes and _peak(m.peak_rss)
    ),
    messages.Failed: lambda m: (
        type(m.task_id) is int and _remote_error(m.error) and _peak(m.peak_rss)
    ),
    messages.Progress: lambda m: (
        type(m.task_id) is int
        and type(m.fraction) is float
        and (m.message is None or _text(m.message))
    ),
    messages.Ready: lambda m: type(m.pid) is int,
}


def _guarded_loads(data: memoryview) -> Any:
    try:
        message = _MessageUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # anything at all: the bytes are the child's
        raise BadMessage(f"{type(exc).__name__}: {exc}") from None
    for one in message if type(message) is tuple else (message,):
        check = _WELL_FORMED.get(type(one))
        if check is None or not check(one):
            raise BadMessage(f"a malformed {type(one).__name__}")
    return message


class Channel:
    __slots__ = ("_batch", "_buffer", "_chunk", "_loads", "_start", "max_frame", "sock")

    def __init__(self, sock: socket.socket, *, max_frame: int | None = None) -> None:
        self.sock = sock
        #: The parent's end sets this: frames are then capped, never waited for, and
        #: decoded by the restricted unpickler.
        self.max_frame = max_frame
        self._loads: Any = pickle.loads if max_frame is None else _guarded_loads
        self._batch: deque[Any] = deque()  # the rest of a received batch, not yet returned
        self._buffer = bytearray()
        self._start = 0  # where the unread part of _buffer begins
        # One reusable read buffer: a fresh 256 KiB bytes object per recv costs an
        # mmap/munmap pair and dominated the per-message cost.
        self._chunk = memoryview(bytearray(_CHUNK))

    @classmethod
    def pair(cls, max_frame: int | None = None) -> tuple[Channel, socket.socket]:
        """Our end as a Channel (guarded when ``max_frame`` is given), and the raw socket
        to hand to the child."""
        ours, theirs = socket.socketpair()
        return cls(ours, max_frame=max_frame), theirs

    def fileno(self) -> int:
        return self.sock.fileno()

    @property
    def closed(self) -> bool:
        return self.sock.fileno() < 0

    def close(self) -> None:
        self.sock.close()

    def send(self, *messages: Any) -> None:
        """Send ``messages`` in one frame and one write."""
        data = pickle.dumps(
            messages[0] if len(messages) == 1 else messages, protocol=pickle.HIGHEST_PROTOCOL
        )
        self.sock.sendall(_HEADER.pack(len(data)) + data)

    def receive_available(self) -> list[Any]:
        """Messages that are complete after one read, and after reading on while more is
        already there (never waiting: not for the rest of a frame, nor for a first byte
        when a readiness was stale). May be empty.

        Raises EOFError when the peer has closed its end, ``BadMessage`` (guarded end) for
        a frame it cannot decode.
        """
        if not self._batch and not self._fill(wait=False):
            # Readable when the select looked, read since: a kill earlier in the same
            # select batch collects what its child sent before it acts.
            return []
        found = []
        while (message := self._pop()) is not None:
            found.append(message)
        while len(self._buffer) > self._start and not found:  # a frame larger than one read
            if not self._fill(wait=False):
                break  # the rest is not there yet: the next readiness brings it
            if (message := self._pop()) is not None:
                found.append(message)
        return found

    def receive(self) -> Any:
        """The next message, blocking. Raises EOFError when the peer has closed its end."""
        while (message := self._pop()) is None:
            self._fill()
        return message

    def _fill(self, wait: bool = True) -> bool:
        try:
            size = self.sock.recv_into(self._chunk, 0, 0 if wait else socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        if not size:
            raise EOFError("the other end of the channel is closed")
        if self._start:  # drop what was read, once per recv (not once per frame)
            del self._buffer[: self._start]
            self._start = 0
        self._buffer += self._chunk[:size]
        return True

    def _pop(self) -> Any:
        if self._batch:
            return self._batch.popleft()
        buf, start = self._buffer, self._start
        if len(buf) - start < _HEADER.size:
            return None
        (size,) = _HEADER.unpack_from(buf, start)
        if self.max_frame is not None and size > self.max_frame:
            raise BadMessage(f"a frame of {size} bytes, over the limit of {self.max_frame}")
        end = start + _HEADER.size + size
        if len(buf) < end:
            return None
        with memoryview(buf) as view:
            message = self._loads(view[start + _HEADER.size : end])
        self._start = end
        if type(message) is tuple:
            self._batch.extend(message[1:])
            return message[0]
        return message
