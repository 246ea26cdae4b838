"""A child's pipe: one socketpair end carrying length-prefixed pickled messages.

Why not ``multiprocess.connection.Connection``: it spends two reads per message (header,
then body). Here one ``recv`` takes everything the peer has sent so far and every complete
frame in it is returned, so a burst of results costs one syscall. Several messages sent
together travel as one frame holding their tuple: one pickle call instead of one per
message (messages are never tuples themselves, so a tuple is always such a batch).
"""

from __future__ import annotations

import pickle
import socket
import struct
from collections import deque
from typing import Any

_HEADER = struct.Struct("!I")
_CHUNK = 256 * 1024


class Channel:
    __slots__ = ("_batch", "_buffer", "_chunk", "_start", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._batch: deque[Any] = deque()  # the rest of a received batch, not yet returned
        self._buffer = bytearray()
        self._start = 0  # where the unread part of _buffer begins
        # One reusable read buffer: a fresh 256 KiB bytes object per recv costs an
        # mmap/munmap pair and dominated the per-message cost.
        self._chunk = memoryview(bytearray(_CHUNK))

    @classmethod
    def pair(cls) -> tuple[Channel, socket.socket]:
        """Our end as a Channel, and the raw socket to hand to the child."""
        ours, theirs = socket.socketpair()
        return cls(ours), theirs

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
        """Messages that are complete after one read (blocks only to finish a started frame).

        Raises EOFError when the peer has closed its end.
        """
        if not self._batch:
            self._fill()
        messages = []
        while (message := self._pop()) is not None:
            messages.append(message)
        while len(self._buffer) > self._start and not messages:  # a frame larger than one read
            self._fill()
            if (message := self._pop()) is not None:
                messages.append(message)
        return messages

    def receive(self) -> Any:
        """The next message, blocking. Raises EOFError when the peer has closed its end."""
        while (message := self._pop()) is None:
            self._fill()
        return message

    def _fill(self) -> None:
        size = self.sock.recv_into(self._chunk)
        if not size:
            raise EOFError("the other end of the channel is closed")
        if self._start:  # drop what was read, once per recv (not once per frame)
            del self._buffer[: self._start]
            self._start = 0
        self._buffer += self._chunk[:size]

    def _pop(self) -> Any:
        if self._batch:
            return self._batch.popleft()
        buf, start = self._buffer, self._start
        if len(buf) - start < _HEADER.size:
            return None
        (size,) = _HEADER.unpack_from(buf, start)
        end = start + _HEADER.size + size
        if len(buf) < end:
            return None
        with memoryview(buf) as view:
            message = pickle.loads(view[start + _HEADER.size : end])
        self._start = end
        if type(message) is tuple:
            self._batch.extend(message[1:])
            return message[0]
        return message
