"""A TCP proxy on loopback that delays, stalls or cuts traffic, for network fault tests.

    client ──► 127.0.0.1:proxy.port ──► [each chunk held delay_s; all held while stalled] ──► target
           ◄──────────────────────────── the same, in the other direction ◄───────────────

Point a worker at ``proxy.url`` instead of Redis and its renewals arrive late (``delay_s``),
slowly (``rate_bytes_s``: a slow link), not at all until ``resume()`` (``stall()``: a
partition that heals, with every byte then delivered in order, late), or never (``cut()``:
every open connection is dropped).
Bytes keep their order per direction. The proxy runs an asyncio loop on its own daemon
thread; every control method is safe from any thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any

#: The pieces a slow link (``rate_bytes_s``) carries one after another.
RATE_PIECE = 16384


class TcpProxy:
    """Forwards ``127.0.0.1:port`` to ``target_host:target_port``; ``start()`` or ``with``."""

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        delay_s: float = 0.0,
        rate_bytes_s: float | None = None,
    ) -> None:
        self.target = (target_host, target_port)
        #: Added to every chunk, each direction; may be changed at any time.
        self.delay_s = delay_s
        #: A slow link: each direction carries at most this many bytes a second, in pieces
        #: of RATE_PIECE bytes (None: as fast as loopback).
        self.rate_bytes_s = rate_bytes_s
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._flowing = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.connections = 0  # accepted so far

    @property
    def url(self) -> str:
        """A ``redis://`` URL through the proxy (db 0)."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> TcpProxy:
        self._thread.start()
        self._call(self._listen())
        return self

    def stall(self) -> None:
        """Hold every byte, both ways, until ``resume()``; connections stay open."""
        self._loop.call_soon_threadsafe(self._flowing.clear)

    def resume(self) -> None:
        """Deliver what was held (late, in order) and let traffic flow again."""
        self._loop.call_soon_threadsafe(self._flowing.set)

    def cut(self) -> None:
        """Drop every open connection (held bytes are lost); new ones are accepted."""
        self._call(self._close_connections())

    def close(self) -> None:
        if not self._thread.is_alive():
            self._loop.close()
            return
        self._call(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the loop thread ----------------------------------------------------------------

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _listen(self) -> None:
        self._flowing.set()
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(writer)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            await self._close(writer)
            return
        self._writers.add(up_writer)
        pumps = [
            asyncio.ensure_future(self._pump(reader, up_writer)),
            asyncio.ensure_future(self._pump(up_reader, writer)),
        ]
        self._tasks.update(pumps)
        try:
            # Either side closing ends the connection: close both.
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            self._tasks.difference_update(pumps)
            await self._close(writer)
            await self._close(up_writer)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Copy ``reader`` to ``writer``, each chunk ``delay_s`` late and never while stalled."""
        held: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def receive() -> None:
            free_at = 0.0  # a slow link: when it has carried what it holds
            try:
                while chunk := await reader.read(65536):
                    rate = self.rate_bytes_s
                    if rate is None:
                        held.put_nowait((self._loop.time() + self.delay_s, chunk))
                        continue
                    for at in range(0, len(chunk), RATE_PIECE):
                        piece = chunk[at : at + RATE_PIECE]
                        free_at = max(free_at, self._loop.time() + self.delay_s)
                        free_at += len(piece) / rate
                        held.put_nowait((free_at, piece))
            except (ConnectionError, OSError):
                pass
            finally:  # end of stream, reset or cancel: the copy ends after what it holds
                held.put_nowait((self._loop.time() + self.delay_s, b""))

        receiver = asyncio.ensure_future(receive())
        try:
            while True:
                due, chunk = await held.get()
                if (wait := due - self._loop.time()) > 0:
                    await asyncio.sleep(wait)
                await self._flowing.wait()
                if not chunk:
                    return
                writer.write(chunk)
                await writer.drain()
        except (ConnectionError, OSError):
            return
        finally:
            receiver.cancel()
            await asyncio.gather(receiver, return_exceptions=True)

    async def _close(self, writer: asyncio.StreamWriter) -> None:
        self._writers.discard(writer)
        writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()

    async def _close_connections(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for writer in list(self._writers):
            await self._close(writer)

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._close_connections()
        # Let the connection handlers see their pumps end and finish closing.
        pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if pending:
            await asyncio.wait(pending, timeout=5)
        if self._server is not None:
            await self._server.wait_closed()
