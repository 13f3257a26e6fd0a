"""The link's reader and writer tasks, on a fake websocket."""

from __future__ import annotations

import asyncio

from websockets.protocol import State

from meshinfer.wire import transport
from meshinfer.wire.transport import Link


class EndingSocket:
    """A websocket that stays OPEN and whose reader ends while a frame is being sent."""

    def __init__(self) -> None:
        self.state = State.OPEN
        self.sending = asyncio.Event()
        self.sent: list[bytes] = []

    async def send(self, data: bytes) -> None:
        self.sending.set()
        await asyncio.sleep(0.2)
        self.sent.append(data)

    def __aiter__(self):
        return self

    async def __anext__(self) -> bytes:
        await self.sending.wait()  # the connection ends while the writer is inside send
        raise StopAsyncIteration


async def _lossy_wait_for(aw, timeout):
    """``asyncio.wait_for`` as Python 3.11 behaves when a cancel lands just as the awaited
    send completes: the result is returned and the cancel is lost."""
    try:
        return await aw
    except asyncio.CancelledError:
        return None


async def _ignore(link, msg_type, f) -> None:
    return None


async def test_a_writer_whose_cancel_is_lost_still_stops_and_the_link_counts_as_closed(monkeypatch):
    """It used to wait for more frames forever: run() never returned, the link never counted as
    closed, and a peer's close hung (an intermittent hang of the failover tests on Python 3.11)."""
    monkeypatch.setattr(transport.asyncio, "wait_for", _lossy_wait_for)
    ws = EndingSocket()
    link = Link(ws, max_bytes=1 << 20, on_message=_ignore, name="fake")
    assert link.post("ping", id=1)
    async with asyncio.timeout(10.0):
        await link.run()
    assert link.closed.is_set() and ws.sent == []  # the cancelled send never finished
