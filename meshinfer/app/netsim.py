"""A latency- and bandwidth-shaping TCP proxy, to rehearse an Internet route on one machine.

Kernel netem is often unavailable (containers, CI, macOS), so meshinfer ships this: put it
between two peers (or a client and a peer) and point the dialing side at the proxy.

    meshinfer netsim --listen 127.0.0.1:7800 --target 127.0.0.1:7700 --rtt-ms 100

Each direction delays every chunk by ``rtt_ms / 2`` and, when ``bandwidth_bytes_per_s`` is
set, serialises it at that rate (a chunk of n bytes occupies the link for n / rate seconds),
preserving byte order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

log = logging.getLogger(__name__)

#: Bytes read per chunk: small enough that delay applies to frames, not megabytes.
CHUNK_BYTES = 64 * 1024


class NetSim:
    """Proxy ``listen`` to ``target`` with added delay and an optional bandwidth cap.

    Args:
        target_host, target_port: where connections are forwarded.
        rtt_ms: round-trip time added, milliseconds (half in each direction).
        bandwidth_bytes_per_s: per-direction rate limit per connection, or None for unlimited.
        host, port: where to listen (port 0: the OS picks; see :attr:`port`).

    :meth:`close` is safe to call twice; every task the proxy starts is cancelled there.
    """

    def __init__(self, target_host: str, target_port: int, *, rtt_ms: float = 0.0,
                 bandwidth_bytes_per_s: float | None = None, host: str = "127.0.0.1", port: int = 0) -> None:
        if rtt_ms < 0 or (bandwidth_bytes_per_s is not None and bandwidth_bytes_per_s <= 0):
            raise ValueError(f"rtt_ms must be >= 0 and bandwidth positive, got {rtt_ms}, {bandwidth_bytes_per_s}")
        self.target = (target_host, target_port)
        self.one_way_s = rtt_ms / 2e3
        self.rate = bandwidth_bytes_per_s
        self.host, self.port = host, port
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> "NetSim":
        """Start listening; :attr:`port` then holds the bound port."""
        self._server = await asyncio.start_server(self._accept, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        """Stop listening and drop every proxied connection."""
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError as exc:
            log.info("netsim: cannot reach %s:%d: %s", *self.target, exc)
            writer.close()
            return
        pumps = [self._spawn(self._pump(reader, up_writer)), self._spawn(self._pump(up_reader, writer))]
        await asyncio.gather(*pumps, return_exceptions=True)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Copy one direction, each chunk delivered at its arrival time + delay (+ transmission)."""
        queue: asyncio.Queue = asyncio.Queue()
        deliver = self._spawn(self._deliver(queue, writer))
        link_free = 0.0
        try:
            while chunk := await reader.read(CHUNK_BYTES):
                now = time.monotonic()
                if self.rate:
                    link_free = max(now, link_free) + len(chunk) / self.rate
                    due = link_free + self.one_way_s
                else:
                    due = now + self.one_way_s
                queue.put_nowait((due, chunk))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            queue.put_nowait((0.0, None))
            with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                await deliver

    @staticmethod
    async def _deliver(queue: asyncio.Queue, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                due, chunk = await queue.get()
                if chunk is None:
                    break
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(chunk)
                await writer.drain()
        finally:
            writer.close()
