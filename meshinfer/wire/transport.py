"""A websocket connection carrying meshinfer frames, shared by peers and clients.

:class:`Link` adds three things to a ``websockets`` connection: request/response matching
(a request carries ``id``, its reply ``re``), a reader loop that decodes every frame through
:mod:`meshinfer.wire.protocol` and hands it to a callback, and a bounded outbox written by its own
task, so that a remote that stops reading costs at most :data:`OUTBOX_BYTES` and
:data:`SEND_TIMEOUT_S` before its connection is cut, and never stalls anyone else.
Malformed frames get an ``error`` reply; a connection that keeps sending them is closed with
code 1008.

:class:`CircuitSocket` is a websocket-shaped end of a *circuit*: frames to and from a peer
that nobody can dial, carried as ``relay`` / ``relay_back`` frames over a link to one of its
relays. A :class:`Link` over it is an ordinary link (handshake, requests, outbox), so every
end-to-end check runs through the relay unchanged.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import logging
import os
import socket
import ssl
import time
from typing import Any, Awaitable, Callable, Collection, Iterable, TypeVar

import websockets
from websockets.exceptions import ConnectionClosed
from websockets.protocol import State
from websockets.uri import parse_uri

from meshinfer.wire import discovery, protocol, tls
from meshinfer.wire.circuit_seal import KX_BYTES, SEAL_OVERHEAD_BYTES, SIG_BYTES, CircuitSeal
from meshinfer.core.errors import MeshError, PeerUnavailable, ProtocolError

log = logging.getLogger(__name__)

#: Malformed frames tolerated on one connection before it is closed (code 1008).
MAX_BAD_FRAMES = 64
#: Websocket close codes (RFC 6455 section 7.4.1; 4000-4999 are private use).
CLOSE_POLICY, CLOSE_VERSION, CLOSE_SHUTDOWN = 1008, 4002, 1001
#: Bytes of frames queued for one connection before a sender waits (:meth:`Link.send`) or the
#: connection is cut (:meth:`Link.post`). A frame larger than this is still taken when the
#: outbox is empty (a tokenizer bundle, a long prefill chunk).
OUTBOX_BYTES = 4 << 20
#: Longest a frame may wait for room in an outbox, or for the socket to take it, seconds, plus
#: the time its bytes (and those queued before it) take at :data:`MIN_READ_BYTES_PER_S`: a
#: remote that reads slower is cut off (its transport aborted) as a slow reader.
SEND_TIMEOUT_S = 10.0
#: Slowest reading a remote is allowed, bytes per second (512 kbit/s: a 1.8 MB prefill chunk of
#: the default model may take 38 s to go out).
MIN_READ_BYTES_PER_S = 64 * 1024
#: Longest :meth:`Link.close` waits for queued frames (an error reply, a goodbye) to go out, seconds.
CLOSE_FLUSH_TIMEOUT_S = 2.0
#: Bytes a relay frame adds around the frame it carries (type, circuit id, target peer id).
RELAY_OVERHEAD_BYTES = 1024
#: Message types that carry circuits.
CIRCUIT_TYPES = frozenset({"relay", "relay_back", "relay_close"})

Handler = Callable[["Link", str, "protocol.Fields"], Awaitable[None]]
#: ``admit(link, nbytes)``: whether a received frame of ``nbytes`` bytes is decoded (False: dropped unread).
Admit = Callable[["Link", int], bool]


def send_patience_s(nbytes: int) -> float:
    """Seconds ``nbytes`` may take to go out before the remote counts as a slow reader."""
    return SEND_TIMEOUT_S + nbytes / MIN_READ_BYTES_PER_S


T = TypeVar("T")


class Link:
    """One websocket connection with request/response matching.

    Args:
        ws: an open ``websockets`` connection (client or server side).
        max_bytes: largest frame accepted, bytes (also enforced by ``websockets``' ``max_size``).
        on_message: ``await on_message(link, type, fields)`` for every frame that is not a reply.
        name: label for logs.

    Attributes:
        remote_id: the remote peer id once known (None for clients).
        role: ``"peer"`` or ``"client"`` once the handshake is done.
        tls_fingerprint: on a dialed ``wss://`` link, hex SHA-256 of the server's certificate.
        admit: the owner's check of a received frame's size before decoding it (:data:`Admit`, None:
            all); a frame it refuses is dropped unread (``dropped_frames``): a flood costs no decode.
    """

    def __init__(self, ws, *, max_bytes: int, on_message: Handler, name: str = "") -> None:
        self.ws = ws
        self.max_bytes = max_bytes
        self.on_message = on_message
        self.name = name
        self.remote_id: str | None = None
        self.role: str | None = None
        self.info: dict[str, Any] = {}
        self.tls_fingerprint = ""  # SHA-256 hex of the server's certificate, on a dialed wss:// link
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._bad_frames = 0
        self.last_frame_bytes = 0
        self.last_frame_at = time.monotonic()  # when the last frame (not a websocket ping) arrived
        self.closed = asyncio.Event()
        self.meter = None  # a PeerMetrics counting frame bytes and errors, when the owner sets one
        self.admit, self.dropped_frames = None, 0  # an Admit or None, and the frames it refused
        self._outbox: collections.deque[bytes] = collections.deque()
        self._outbox_bytes = 0
        self._wake = asyncio.Event()  # set when a frame is queued: the writer has work
        self._stopping = False  # set by run() as it ends: the writer stops even if its cancel was lost
        self._room = asyncio.Event()  # set when the writer took a frame off: senders may fit now
        self._drained = asyncio.Event()  # set while the outbox is empty
        self._drained.set()
        self._cut = ""  # why the connection was cut as a slow reader, once it was
        self.circuits: dict[tuple[str, int], CircuitSocket] = {}  # ("out"/"in", circuit id) -> its end here
        self._circuit_ids = itertools.count(1)

    @property
    def relay_id(self) -> str | None:
        """The peer id of the relay this link runs through, or None for a direct connection."""
        return getattr(self.ws, "relay_id", None)

    def next_circuit_id(self) -> int:
        """A circuit id not used before on this link (for circuits it opens or forwards)."""
        return next(self._circuit_ids)

    @property
    def _label(self) -> str:
        return self.name or self.remote_id or "?"

    def _usable(self) -> None:
        """Raise :class:`PeerUnavailable` when frames can no longer go out on this connection."""
        if self._cut:
            raise PeerUnavailable(f"connection to {self._label} was cut: {self._cut}")
        if self.closed.is_set() or self.ws.state is not State.OPEN:
            raise PeerUnavailable(f"connection to {self._label} is closed")

    def _check_size(self, data: bytes) -> None:
        """Raise :class:`InvalidInput` for a frame larger than a relay in between forwards."""
        limit = getattr(self.ws, "max_send_bytes", None)
        if limit is not None and len(data) > limit:
            from meshinfer.core.errors import InvalidInput
            raise InvalidInput(f"a {len(data)}-byte frame is larger than relay {(self.relay_id or '?')[:12]} "
                               f"forwards ({limit} bytes)")

    def _fits(self, n: int) -> bool:
        return not self._outbox or self._outbox_bytes + n <= OUTBOX_BYTES

    def _queue(self, data: bytes) -> None:
        self._outbox.append(data)
        self._outbox_bytes += len(data)
        self._drained.clear()
        self._wake.set()

    async def send(self, msg_type: str, **fields: Any) -> None:
        """Queue one frame for the writer, waiting while the outbox holds :data:`OUTBOX_BYTES`.

        Returns once the frame is queued, not written. Only await this on behalf of the remote
        itself or from a task of its own (a conversation's worker): a read loop that relays to
        another party uses :meth:`post`. Cancelling it while it waits queues nothing.

        Raises:
            PeerUnavailable: the connection is closed, or it made no room within
                :data:`SEND_TIMEOUT_S` seconds plus the queued bytes at :data:`MIN_READ_BYTES_PER_S`
                (then it is cut as a slow reader).
        """
        data = protocol.encode(msg_type, **fields)
        self._usable()
        self._check_size(data)
        patience_s = send_patience_s(self._outbox_bytes + len(data))
        deadline = time.monotonic() + patience_s
        while not self._fits(len(data)):
            self._room.clear()
            try:
                await asyncio.wait_for(self._room.wait(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                self._cut_off(f"{self._outbox_bytes} bytes unread for {patience_s:.0f} s")
            self._usable()
        self._queue(data)

    def post(self, msg_type: str, *, cut: bool = True, **fields: Any) -> bool:
        """Queue one frame without waiting; for a frame sent on behalf of another party.

        Returns False, queuing nothing, when the connection is closed, when the frame is larger
        than a relay in between forwards, or when it does not fit in its outbox: then the
        connection is cut as a slow reader, unless ``cut`` is False (a relay drops the circuit
        instead of the link that many circuits share).
        """
        data = protocol.encode(msg_type, **fields)
        try:
            self._usable()
            self._check_size(data)
        except MeshError:
            return False
        if not self._fits(len(data)):
            if not cut:
                return False
            self._cut_off(f"{self._outbox_bytes} bytes unread, over the outbox limit of {OUTBOX_BYTES}")
            return False
        self._queue(data)
        return True

    def _cut_off(self, reason: str) -> None:
        """Abort the connection of a remote that does not read; wake everyone waiting on it."""
        if not self._cut:
            self._cut = reason
            log.warning("cutting off %s, a slow reader: %s", self._label, reason)
            self.ws.transport.abort()
        self._room.set()

    async def _write_loop(self) -> None:
        """Write queued frames in order; cut the connection when one is not taken in time (:func:`send_patience_s`).
        On return (closed, cut, or stopped by :meth:`run`) waiting senders and :meth:`close` are released."""
        try:
            while not self._stopping:
                while not self._outbox:
                    if self._stopping:  # run() ended (the socket closed, or it was cancelled)
                        return
                    self._drained.set()
                    self._wake.clear()
                    await self._wake.wait()
                data = self._outbox.popleft()
                self._outbox_bytes -= len(data)
                self._room.set()
                try:
                    await asyncio.wait_for(self.ws.send(data), send_patience_s(len(data)))
                except asyncio.TimeoutError:
                    self._cut_off(f"a {len(data)}-byte frame was not taken within {send_patience_s(len(data)):.0f} s")
                    return
                except ConnectionClosed:
                    return
                except Exception as exc:  # a bug: the frames behind this one would never go out
                    log.exception("writing a frame to %s failed", self._label)
                    self._cut_off(f"writing a frame failed: {type(exc).__name__}")
                    return
                if self.meter is not None:
                    self.meter.frame_out(len(data))
        finally:
            self._drained.set()
            self._room.set()

    async def request(self, msg_type: str, *, timeout_s: float, **fields: Any) -> tuple[str, Any]:
        """Send a request and wait for its reply (``type``, fields).

        Raises:
            PeerUnavailable: closed connection or no reply within ``timeout_s`` seconds.
            MeshError: the reply is an ``error`` frame; its code and message are kept.
        """
        rid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        try:
            await self.send(msg_type, id=rid, **fields)
            msg_type, f = await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError as exc:
            raise PeerUnavailable(f"{self.name or self.remote_id} did not answer {msg_type} "
                                  f"within {timeout_s:.1f} s") from exc
        finally:
            self._pending.pop(rid, None)
        if msg_type == "error":
            raise remote_error(f)
        return msg_type, f

    async def run(self) -> None:
        """Read frames until the connection closes; never raises for what the remote sends.

        Runs the writer of the outbox alongside and cancels it on return; cancelling this
        stops both.
        """
        writer = asyncio.get_running_loop().create_task(self._write_loop(), name=f"writer {self._label}")
        try:
            async for frame in self.ws:
                await self._dispatch(frame)
        except ConnectionClosed:
            pass
        finally:
            for sock in list(self.circuits.values()):  # their carrier is gone
                sock.closed_by_remote()
            self._stopping = True  # Python 3.11's wait_for loses a cancel that lands as ws.send completes
            self._wake.set()
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)
            self._outbox.clear()
            self._outbox_bytes = 0
            self._drained.set()
            self.closed.set()
            self._room.set()
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(PeerUnavailable(f"connection to {self.name or self.remote_id} closed"))

    async def _dispatch(self, frame: bytes | str) -> None:
        context: dict[str, Any] = {}
        try:
            self.last_frame_bytes = len(frame)
            self.last_frame_at = time.monotonic()
            if self.meter is not None:
                self.meter.frame_in(len(frame))
            if self.admit is not None and not self.admit(self, len(frame)):
                self.dropped_frames += 1  # over the owner's budget: never decoded
                return
            msg_type, f = protocol.decode(frame, max_bytes=self.max_bytes)
            context = _reply_context(f)
            re = f.get("re", int, None)
            if re is not None and re in self._pending:
                fut = self._pending.pop(re)
                if not fut.done():
                    fut.set_result((msg_type, f))
                return
            if msg_type in CIRCUIT_TYPES and self._to_circuit(msg_type, f):
                return
            await self.on_message(self, msg_type, f)
        except MeshError as exc:
            await self._reply_error(exc, context)
        except ConnectionClosed:
            raise
        except Exception as exc:  # a bug must not kill the connection of other conversations
            log.exception("unexpected error handling a frame from %s", self.name or self.remote_id)
            await self._reply_error(MeshError(f"internal error: {type(exc).__name__}"), context)

    def _to_circuit(self, msg_type: str, f: Any) -> bool:
        """Hand a circuit frame to its end on this side; False when no circuit here has its id
        (a relay's frame to forward, a new circuit, or a late frame: the owner decides)."""
        if msg_type == "relay" and "to" in f.d:
            return False  # a request to forward, for the relay's owner
        if isinstance(self.ws, CircuitSocket):
            raise ProtocolError("a circuit does not carry circuits")
        back = msg_type == "relay_back" or (msg_type == "relay_close" and f.get("back", bool, False))
        sock = self.circuits.get(("out" if back else "in", f.int("circ", lo=0, hi=1 << 62)))
        if sock is None:
            return False
        if msg_type == "relay_close":
            sock.closed_by_remote()
        else:
            sock.feed(f.get("data", bytes))
        return True

    def open_circuit(self, to: str, *, public_key: str, max_bytes: int) -> "CircuitSocket":
        """The opener's end of a circuit through this relay to peer ``to``, sealed for its ``public_key`` (hex)."""
        limit = self.info.get("max_frame_bytes")
        sock = CircuitSocket(self, self.next_circuit_id(), side="out", seal=CircuitSeal(peer_public_key=public_key),
                             to=to, max_bytes=max_bytes, max_send_bytes=limit and limit - RELAY_OVERHEAD_BYTES)
        self.circuits[("out", sock.circ)] = sock
        return sock

    async def _reply_error(self, exc: MeshError, context: dict[str, Any]) -> None:
        if isinstance(exc, ProtocolError):
            self._bad_frames += 1
        code = getattr(exc, "code", "mesh_error")
        if self.meter is not None:
            self.meter.error(code)
        try:
            await self.send("error", code=code, message=str(exc)[:protocol.MAX_STR_LEN], **context)
        except PeerUnavailable:
            return
        if code == "version_mismatch":
            await self.close(CLOSE_VERSION, str(exc)[:120])
        elif self._bad_frames >= MAX_BAD_FRAMES:
            await self.close(CLOSE_POLICY, f"{self._bad_frames} malformed frames")

    async def close(self, code: int = 1000, reason: str = "") -> None:
        """Let queued frames go out (at most :data:`CLOSE_FLUSH_TIMEOUT_S` seconds), then close
        the connection; safe to call twice. Cancelling it may leave the close handshake undone."""
        if not self.closed.is_set() and not self._cut:
            try:
                await asyncio.wait_for(self._drained.wait(), CLOSE_FLUSH_TIMEOUT_S)
            except asyncio.TimeoutError:
                pass
        try:
            await self.ws.close(code, reason)
        except Exception:  # already closed or broken
            pass


class _Aborter:
    """The ``transport`` of a :class:`CircuitSocket`: aborting it ends the circuit."""

    def __init__(self, sock: "CircuitSocket") -> None:
        self.sock = sock

    def abort(self) -> None:
        self.sock.end()


class CircuitSocket:
    """One end of a circuit, shaped like the ``websockets`` connection a :class:`Link` wraps.

    Frames go out as ``relay`` (the opener's end, ``side="out"``, naming the target peer
    ``to``) or ``relay_back`` (the hidden peer's end, ``side="in"``) frames over ``carrier``,
    the link to the relay; frames the carrier receives for this circuit arrive through
    :meth:`feed`. At most :data:`OUTBOX_BYTES` plus one frame of ``max_bytes`` wait unread:
    beyond that, or for a frame over ``max_bytes``, the circuit ends.

    Every frame is sealed end to end (``seal``, :class:`~meshinfer.wire.circuit_seal.CircuitSeal`):
    the opener's first frame offers its key, the hidden peer's first answers it, and both are
    consumed here; a frame that does not open ends the circuit.

    Attributes:
        relay_id: the relay's peer id (the carrier's remote).
        max_send_bytes: the largest frame the relay forwards, or None when unknown.
    """

    def __init__(self, carrier: Link, circ: int, *, side: str, seal: CircuitSeal, to: str | None = None,
                 max_bytes: int, max_send_bytes: int | None = None, remote_address: tuple = ("relayed", 0)) -> None:
        self.carrier, self.circ, self.side, self.to, self.seal = carrier, circ, side, to, seal
        self.max_bytes, self.max_send_bytes = max_bytes, max_send_bytes
        self.relay_id = carrier.remote_id
        self.remote_address, self.local_address = remote_address, ("relayed", 0)
        self.transport = _Aborter(self)
        self.state = State.OPEN
        self._inbox: collections.deque[bytes | None] = collections.deque()
        self._inbox_bytes = 0
        self._ready = asyncio.Event()
        self._keyed = asyncio.Event()  # set once the seal's keys are derived (or the circuit stopped)
        self._offered = False

    def feed(self, data: bytes) -> None:
        """A frame of this circuit from the carrier; ends the circuit when too much waits unread."""
        if self.state is not State.OPEN:
            return
        limit = self.max_bytes + max(SEAL_OVERHEAD_BYTES, KX_BYTES + SIG_BYTES)
        if len(data) > limit or self._inbox_bytes + len(data) > OUTBOX_BYTES + limit:
            log.warning("circuit %d through %s: %d bytes waiting, %d more; ending it", self.circ,
                        (self.relay_id or "?")[:12], self._inbox_bytes, len(data))
            self.end()
            return
        self._inbox.append(data)
        self._inbox_bytes += len(data)
        self._ready.set()

    def closed_by_remote(self) -> None:
        """The other end, the relay or the carrier closed the circuit: stop without telling back."""
        self._stop()

    def end(self) -> None:
        """Close the circuit and tell the other end through the relay (best effort)."""
        if self.state is State.OPEN:
            self.carrier.post("relay_close", circ=self.circ, back=self.side == "in", cut=False)
        self._stop()

    def _stop(self) -> None:
        if self.state is State.OPEN:
            self.state = State.CLOSED
            self._inbox.append(None)
            self._ready.set()
        self._keyed.set()  # a sender waiting for the keys gives up
        self.carrier.circuits.pop((self.side, self.circ), None)

    async def send(self, data: bytes) -> None:
        """Seal ``data`` and queue it on the carrier (waiting while its outbox is full). The
        opener's first send offers its key first and waits for the answer (read by the link's
        reader, :meth:`__anext__`)."""
        if not self.seal.keyed:
            if self.side == "out" and not self._offered:
                self._offered = True
                await self._send_raw(self.seal.offer())
            await self._keyed.wait()
            if not self.seal.keyed:
                raise ConnectionClosed(None, None)
        await self._send_raw(self.seal.seal(data))

    async def _send_raw(self, data: bytes) -> None:
        if self.state is not State.OPEN:
            raise ConnectionClosed(None, None)
        try:
            if self.side == "out":
                await self.carrier.send("relay", to=self.to, circ=self.circ, data=data)
            else:
                await self.carrier.send("relay_back", circ=self.circ, data=data)
        except MeshError as exc:
            self._stop()
            raise ConnectionClosed(None, None) from exc

    async def close(self, code: int = 1000, reason: str = "") -> None:
        self.end()

    def __aiter__(self) -> "CircuitSocket":
        return self

    async def __anext__(self) -> bytes:
        """The next frame, opened; the first frame, the other end's key offer or answer, is
        consumed. A frame that does not open ends the circuit."""
        while True:
            while not self._inbox:
                self._ready.clear()
                await self._ready.wait()
            data = self._inbox.popleft()
            if data is None:
                self._inbox.append(None)  # stays closed for any later reader
                raise StopAsyncIteration
            self._inbox_bytes -= len(data)
            try:
                if self.seal.keyed:
                    return self.seal.open(data)
                if self.side == "in":  # the opener's key offer: answer it, then the frames are sealed
                    await self._send_raw(self.seal.answer(data))
                else:
                    self.seal.accept(data)
                self._keyed.set()
            except ProtocolError as exc:
                log.warning("circuit %d through %s: %s; ending it", self.circ, (self.relay_id or "?")[:12], exc)
                self.end()
            except ConnectionClosed:
                self._stop()


def circuit_link(sock: CircuitSocket, *, on_message: Handler, name: str) -> Link:
    """A :class:`Link` over ``sock`` with its reader task started (kept in ``link.reader``)."""
    link = Link(sock, max_bytes=sock.max_bytes, on_message=on_message, name=name)
    link.reader = asyncio.get_running_loop().create_task(link.run(), name=f"circuit {name}")
    return link


def _reply_context(f: Any) -> dict[str, Any]:
    """``re`` / ``conv`` / ``seq`` of a request, when well-formed, so an error reply can be matched."""
    out = {}
    for key, kind in (("id", int), ("conv", str), ("seq", int)):
        value = f.d.get(key)
        if isinstance(value, kind) and not isinstance(value, bool) and (kind is not str or len(value) <= 64):
            out["re" if key == "id" else key] = value
    return out


def remote_error(f: Any) -> MeshError:
    """Rebuild an exception from an ``error`` frame, keeping the remote's code and message.

    A ``lying_peer`` keeps its ``suspect``, a ``peer_unavailable`` its ``peer`` and ``relay``.
    A ``protocol_error`` naming ``want`` comes from a peer that predates ``want="tokens"``
    (:data:`~meshinfer.wire.protocol.STEP_WANTS`): it becomes :class:`~meshinfer.core.errors.DraftsRefused`.
    """
    from meshinfer.core import errors

    code = f.str("code", "mesh_error")
    message = f.str("message", "")
    if code == errors.LyingPeer.code:
        return errors.LyingPeer(message, suspect=f.str("suspect", None))
    if code == errors.PeerUnavailable.code:  # a hop's link to its next hop closed: which, through whom
        return errors.PeerUnavailable(message, peer=f.str("peer", None), relay=f.str("relay", None))
    if code == errors.ProtocolError.code and "want" in message:
        return errors.DraftsRefused(message)
    for cls in vars(errors).values():
        if isinstance(cls, type) and issubclass(cls, MeshError) and getattr(cls, "code", None) == code:
            return cls(message)
    exc = MeshError(message)
    exc.code = code
    return exc


def _dial_reason(url: str, exc: BaseException, *, hide_address: bool = False) -> str:
    """Why dialing ``url`` failed, in words, with a hint when the scheme looks wrong: a TLS
    handshake with a plain ``ws://`` peer, or a plain request to a ``wss://`` peer. With
    ``hide_address`` a connection error gives its kind only (``Connection refused``), not the
    address it names."""
    reason = str(exc) or type(exc).__name__
    if hide_address and isinstance(exc, OSError) and not isinstance(exc, ssl.SSLError):  # asyncio's names it
        reason = os.strerror(exc.errno) if exc.errno else type(exc).__name__
    if url.startswith("wss://") and isinstance(exc, (ssl.SSLError, ConnectionResetError, EOFError)):
        return f"TLS handshake failed ({reason}); if the peer serves plain websockets, use ws://"
    if url.startswith("ws://") and isinstance(exc, websockets.exceptions.InvalidMessage):
        return f"{reason}; if the peer serves TLS (join --tls), use wss://"
    if isinstance(exc, asyncio.TimeoutError):
        return f"no answer within the open timeout ({reason})"
    return reason


#: Seconds closing a dialed connection waits for the other side's close frame (websockets'
#: default is 10): a peer that completes the upgrade and then reads nothing made every failed
#: hello cost the dial timeout plus 10 s (an attack run).
DIAL_CLOSE_TIMEOUT_S = 1.0
#: Threads that resolve learnt DNS names (``getaddrinfo`` blocks; a name whose servers never
#: answer holds its thread for the resolver's own timeout). Their own pool, so that names an
#: attacker makes hang cannot take the event loop's default executor from everything else.
RESOLVER_THREADS = 8
#: Addresses of one name a dial tries, in the resolver's order (a name of 100 addresses made one
#: dial of a learnt address 100 connections and upgrade requests: an attack run).
MAX_ADDRESSES_PER_DIAL = 2
_resolver: concurrent.futures.ThreadPoolExecutor | None = None
_lookups: dict[str, concurrent.futures.Future] = {}


async def _resolve(host: str) -> list[str]:
    """The addresses ``host`` resolves to (``getaddrinfo``, TCP), in the resolver's order, on
    the :data:`RESOLVER_THREADS` threads of the resolver's own pool; one lookup of a name at a
    time (case and a trailing dot aside), whoever asks and for whichever port (a name that hangs
    holds one thread, not one per dial of it). A caller that stops waiting (its dial timed out)
    leaves the lookup to the others.

    Raises:
        OSError, UnicodeError: the name does not resolve, or is not a valid name.
    """
    global _resolver
    if _resolver is None:
        _resolver = concurrent.futures.ThreadPoolExecutor(RESOLVER_THREADS, thread_name_prefix="resolve")
    key = host.lower().rstrip(".")
    lookup = _lookups.get(key)
    if lookup is None:
        lookup = _lookups[key] = _resolver.submit(socket.getaddrinfo, key, None, type=socket.SOCK_STREAM)
        lookup.add_done_callback(lambda f, k=key: _lookups.get(k) is f and _lookups.pop(k, None))
    # shielded: cancelling one waiter (its dial's timeout) must not cancel the lookup under the others
    infos = await asyncio.shield(asyncio.wrap_future(lookup))
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


async def dial_targets(url: str, scopes: Collection[str] | None) -> tuple[list[str], int]:
    """The hosts, in the order to try them (at most :data:`MAX_ADDRESSES_PER_DIAL`), and the port
    to open a TCP connection to for ``url`` (ws:// or wss://).

    With ``scopes`` None the URL's own host (the system resolver resolves it when connecting).
    Else an IP address (any spelling ``discovery.host_scope`` reads) must be in ``scopes``, and
    a name is resolved here (:func:`_resolve`) to those of its addresses that are, so that the
    connection goes to an address that was checked: a DNS name of an advert that resolves to
    loopback or a private network (DNS rebinding, an /etc/hosts entry) is not dialed by a node
    without an address of its own there (``discovery.dialable_scopes``). What a name resolved to
    is logged here, never put in the error, which may reach the peer that named the address.

    Raises:
        PeerUnavailable: not in ``scopes``, or a name that does not resolve to an address in them.
        websockets.exceptions.InvalidURI: ``url`` is not a ws:// or wss:// URL.
    """
    uri = parse_uri(url)
    if scopes is None:
        return [uri.host], uri.port
    literal = discovery.ip_literal(uri.host)
    if literal is not None:
        if discovery.host_scope(literal) not in scopes:
            raise PeerUnavailable(f"{url}: not dialed; a {discovery.host_scope(literal)} address, and this node has "
                                  f"no address of its own in that scope")
        return [literal], uri.port
    try:
        found = await _resolve(uri.host)
    except (OSError, ValueError) as exc:  # UnicodeError: a label over 63 characters
        log.info("%s: %s does not resolve (%s)", url, uri.host, exc)
        found = []
    allowed = [a for a in found if discovery.host_scope(a) in scopes][:MAX_ADDRESSES_PER_DIAL]
    if not allowed:
        log.info("%s: not dialed; %s resolves to %s", url, uri.host,
                 ", ".join(f"{a} ({discovery.host_scope(a)})" for a in found[:4]) or "nothing")
        raise PeerUnavailable(f"{url}: not dialed; {uri.host} resolves to no address this node dials (a name "
                              f"that points to loopback or a private network counts as that address)")
    return allowed, uri.port


async def name_scopes(urls: Iterable[str], timeout_s: float = 5.0) -> set[str]:
    """``{"private"}`` when a host name among ``urls`` (a node's own addresses) resolves to
    private addresses only, else the empty set: a mesh whose members are named by DNS on a LAN
    or VPN (names such as ``node1.corp.example`` for 10.0.0.5) dials the names it learns there.
    A name never gives loopback or link-local scope (a machine's own name often resolves to
    127.0.1.1 in /etc/hosts, and a name with one loopback address among public ones would open
    the node's own services: an attack run), nor private scope when one of its addresses is
    public. Names that do not resolve within ``timeout_s`` seconds, or are malformed, add nothing."""
    async def scopes(url: str) -> set[str]:
        try:
            host = parse_uri(url).host
            if discovery.ip_literal(host) is not None:
                return set()
            found = {discovery.host_scope(a) for a in await asyncio.wait_for(_resolve(host), timeout_s)}
        except (OSError, ValueError, asyncio.TimeoutError, websockets.exceptions.WebSocketException) as exc:
            log.info("own address %s does not resolve (%s)", url, exc)
            return set()
        return found if found == {"private"} else set()

    return set().union(*await asyncio.gather(*(scopes(u) for u in urls)))


async def dial(url: str, *, max_bytes: int, on_message: Handler, open_timeout_s: float = 5.0,
               insecure: bool = False, tls_ca: str | None = None, scopes: Collection[str] | None = None) -> Link:
    """Open a websocket to ``url`` and start its reader task (kept in ``link.reader``).

    The connection goes to the host of ``url`` itself (:func:`dial_targets`; with ``scopes``, to
    the first address of it in one of those scopes that answers), never through a proxy from the
    environment, and a redirect to another host or port is refused (websockets follows none
    when the host is given): a server that answers the upgrade with ``302 Location:
    ws://127.0.0.1:8080/admin`` cannot point the node at a service the scopes keep it from.

    ``wss://`` checks no CA: ``link.tls_fingerprint`` holds the SHA-256 of the certificate the
    server presented, for the handshake to pin against the peer's signed advert. Plain ``ws://``
    to a non-loopback host is refused unless ``insecure`` (see :mod:`meshinfer.wire.tls`). With
    ``tls_ca`` (a PEM file of CA certificates) the server's certificate must also chain to one
    of them and name the host in ``url``.

    Raises:
        InvalidInput: plain ``ws://`` to another machine without ``insecure``; an unreadable ``tls_ca``.
        PeerUnavailable: the address cannot be reached within ``open_timeout_s`` seconds (name
            resolution included), or resolves to no address in ``scopes``.
    """
    tls.check_plain_url(url, insecure=insecure)
    ssl_context = tls.client_context(tls_ca) if url.startswith("wss://") else None
    deadline = time.monotonic() + open_timeout_s
    reasons = []
    # what a learnt name resolved to stays out of the error, which may reach whoever named it
    named = discovery.endpoint(url)[1]
    hide = scopes is not None and named != "loopback" and discovery.ip_literal(named) is None
    try:
        hosts, port = await asyncio.wait_for(dial_targets(url, scopes), open_timeout_s)
        for host in hosts:
            try:
                ws = await websockets.connect(url, max_size=max_bytes, open_timeout=max(0.1, deadline - time.monotonic()),
                                              ssl=ssl_context, ping_interval=20, ping_timeout=20, compression=None,
                                              proxy=None, host=host, port=port, close_timeout=DIAL_CLOSE_TIMEOUT_S)
                break
            except OSError as exc:  # nothing answers there: the name's next address (a server that answers ends it)
                reasons.append(_dial_reason(url, exc, hide_address=hide))
                if time.monotonic() >= deadline or host == hosts[-1]:
                    raise
    except (OSError, asyncio.TimeoutError, websockets.exceptions.WebSocketException, ValueError) as exc:
        raise PeerUnavailable(f"cannot reach {url}: "
                              f"{'; '.join(reasons) or _dial_reason(url, exc, hide_address=hide)}") from exc
    link = Link(ws, max_bytes=max_bytes, on_message=on_message, name=url)
    link.tls_fingerprint = tls.peer_fingerprint(ws)
    link.reader = asyncio.get_running_loop().create_task(link.run(), name=f"link {url}")
    return link


async def first_success(attempts: Iterable[Awaitable[T]], *, discard: Callable[[T], Awaitable[Any]]) -> T:
    """Run ``attempts`` (dials of one peer's addresses) at once; the first that succeeds.

    The others are cancelled; one that succeeded anyway is passed to ``discard`` (to close
    it). Cancelling this cancels every attempt.

    Raises:
        PeerUnavailable: every attempt failed; the message joins their errors (``MeshError``s,
            in the order they failed), or says "no address" when there was none.
    """
    tasks = [asyncio.ensure_future(a) for a in attempts]
    pending, winner, errors = set(tasks), None, []
    try:
        while pending and winner is None:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=tasks.index):
                exc = task.exception()
                if exc is None:
                    winner = winner or task
                elif isinstance(exc, MeshError):
                    errors.append(str(exc))
                else:
                    raise exc
        if winner is None:
            raise PeerUnavailable("; ".join(errors or ["no address"]))
        return winner.result()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for task in tasks:
            if task is not winner and not task.cancelled() and task.exception() is None:
                await discard(task.result())
