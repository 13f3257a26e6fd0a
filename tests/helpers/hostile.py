"""Live tiny-model peers under attack: a hand-driven connection (``Raw``), rogue adverts, and the
health check every hostile test ends with (tests/test_hostile.py; also used by test_batching,
test_hostile_api and test_speculative)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket

import msgpack
import torch
import websockets
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from helpers.convauth import authorize
from helpers.meshkit import generate_through, mesh, split
from meshinfer.core.config import LayerRange
from meshinfer.core.errors import LayerRangeError, ProtocolError
from meshinfer.engine.generate import greedy_generate, load_shard
from meshinfer.wire import protocol, tensors
from meshinfer.wire.discovery import HELLO_LABEL, NONCE_BYTES, peer_id_of, sign_advert
from meshinfer.wire.protocol import PeerAdvert

MESSAGES = [{"role": "user", "content": "a hostile world"}]
CONTEXT = 256  # tokens, the tiny model's context
VOCAB = 260  # 256 bytes + 1 merge + 3 specials
WIDTH = 32  # hidden size C
MAX_STEP = 512  # PeerSettings.max_step_tokens default
TASK_SLACK = 3  # transient tasks (gossip rounds, hello-timer closes) a peer may hold above its baseline
ROGUE_KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))  # the identity rogue peers use by default
NONCE = bytes(range(NONCE_BYTES))


@contextlib.asynccontextmanager
async def serving(tiny, bounds=(0, 4), **settings):
    """Peers over ``bounds`` with the tokenizer; yields them with their task-count baseline recorded."""
    path, digest, tok, _ = tiny
    shards = split(lambda r: load_shard(path, r), list(bounds))
    async with mesh(shards, weights_hash=digest, bundle=tok.to_bundle(), **settings) as peers:
        await asyncio.sleep(0.05)
        for p in peers:
            p.test_task_baseline = len(p._tasks)
        yield peers


def last_token(tiny, ids: list[int]) -> int:
    """The whole model's greedy next token after ``ids``."""
    _, _, _, whole = tiny
    with torch.no_grad():
        logits = whole(torch.tensor([ids]), 0, None, logits="last")
    return int(logits[0, -1].argmax())


def hidden_after(tiny, ids: list[int], stop: int) -> torch.Tensor:
    """Hidden states ``(1, T, C)`` after layers ``[0, stop)`` of the model for ``ids``."""
    path = tiny[0]
    shard = load_shard(path, LayerRange(0, stop))
    with torch.no_grad():
        return shard(torch.tensor([ids]), 0, None)


async def settle(peers, timeout_s: float = 5.0) -> None:
    """Wait until no peer holds a conversation."""
    async with asyncio.timeout(timeout_s):
        while any(p.convs for p in peers):
            await asyncio.sleep(0.02)


async def converse(tiny, peers) -> None:
    """A normal client conversation through ``peers`` matches the whole model."""
    _, _, tok, whole = tiny
    _, ids, out = await generate_through(peers, tok, MESSAGES, request_timeout_s=10.0)
    assert out.token_ids == greedy_generate(whole, ids, max_tokens=8, eos_ids=()).token_ids


async def assert_healthy(tiny, peers) -> None:
    """A normal conversation still matches the whole model, and memory and tasks are at baseline."""
    await settle(peers)
    await converse(tiny, peers)
    await settle(peers)
    assert [p.kv_bytes_used for p in peers] == [0] * len(peers)
    assert [p.free_kv_tokens for p in peers] == [p.capacity_tokens for p in peers]
    await asyncio.sleep(0.05)
    for p in peers:
        assert len(p._tasks) <= p.test_task_baseline + TASK_SLACK, sorted(t.get_name() for t in p._tasks)


def pack(msg_type: str, **fields) -> bytes:
    return msgpack.packb({"v": protocol.PROTOCOL_VERSION, "t": msg_type, **fields}, use_bin_type=True)


def signed(msg_type: str, to: str, **fields) -> bytes:
    """:func:`pack` of a frame to the peer ``to`` (its id), signed for the conversation the test
    names as its client would (:func:`helpers.convauth.authorize`)."""
    return pack(msg_type, **authorize(msg_type, fields, to))


class Raw:
    """A hand-driven connection: sends any frame, queues every reply, answers pings like a peer."""

    def __init__(self, ws, to: str | None = None) -> None:
        self.ws = ws
        self.to = to  # the peer's id: opens are signed for it (helpers.convauth)
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.ids = itertools.count(1)
        self.reader = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def connect(cls, peer, *, role: str | None = "client", advert: dict | None = None, key=ROGUE_KEY,
                      **kw) -> "Raw":
        """Connect and say hello as ``role``; a peer also proves ``key`` (the key of ``advert``)."""
        ws = await websockets.connect(peer.addrs[0], max_size=None, compression=None, ping_interval=None, **kw)
        raw = cls(ws, getattr(peer, "peer_id", None))
        if role is not None:
            reply = await raw.request("hello", role=role, nonce=NONCE, **({"advert": advert} if advert else {}))
            assert reply["t"] == "welcome", reply
            if role == "peer":
                reply = await raw.request("auth", proof=key.sign(HELLO_LABEL + reply["nonce"] + NONCE))
                assert reply["t"] == "authed", reply
        return raw

    async def _read(self) -> None:
        with contextlib.suppress(websockets.ConnectionClosed):
            async for frame in self.ws:
                msg = msgpack.unpackb(frame)
                if msg.get("t") == "ping":
                    await self.ws.send(pack("pong", re=msg.get("id")))
                elif msg.get("t") != "gossip":
                    self.inbox.put_nowait(msg)

    async def send(self, msg_type: str, **fields) -> None:
        """Send a frame; a conversation the test names is signed for as its client would
        (:func:`helpers.convauth.authorize`)."""
        await self.ws.send(pack(msg_type, **authorize(msg_type, fields, self.to)))

    async def recv(self, timeout_s: float = 5.0) -> dict:
        return await asyncio.wait_for(self.inbox.get(), timeout_s)

    async def request(self, msg_type: str, **fields) -> dict:
        """Send with a fresh ``id``; the reply whose ``re`` matches (other frames are dropped)."""
        rid = next(self.ids)
        await self.send(msg_type, id=rid, **fields)
        while True:
            msg = await self.recv()
            if msg.get("re") == rid:
                return msg

    async def error(self, msg_type: str, **fields) -> tuple[str, str]:
        """(code, message) of the error a request is answered with."""
        reply = await self.request(msg_type, **fields)
        assert reply["t"] == "error", reply
        return reply["code"], reply["message"]

    async def frame_error(self, frame) -> tuple[str, str]:
        """(code, message) of the error a raw frame is answered with."""
        await self.ws.send(frame)
        reply = await self.recv()
        assert reply["t"] == "error", reply
        return reply["code"], reply["message"]

    async def closed_code(self, timeout_s: float = 5.0) -> int | None:
        """The close code once the peer has closed the connection."""
        await asyncio.wait_for(asyncio.shield(self.reader), timeout_s)
        return self.ws.close_code

    async def close(self) -> None:
        await self.ws.close()
        await asyncio.gather(self.reader, return_exceptions=True)


def small_socket(port: int) -> socket.socket:
    """A TCP connection to ``port`` with a 4 KiB receive buffer: a client that stops reading stalls fast."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    return sock


def shrink_send_buffer(peer, port: int) -> None:
    """Give ``peer``'s socket to the client at local ``port`` a 4 KiB send buffer (no autotuning):
    a few KB left unread fill it, as megabytes would on a long path."""
    link = next(lk for lk in peer._all_links if lk.ws.remote_address[1] == port)
    link.ws.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)


def rogue_advert(digest: str, *, key=ROGUE_KEY, **changes) -> dict:
    """An advert of a peer that does not exist (no address, short TTL) with ``changes``, signed by ``key``.

    The id is ``key``'s unless ``changes`` names another (then the signature is valid but the
    advert is not). Changes that make it malformed leave it unsigned.
    """
    ad = PeerAdvert(peer_id=peer_id_of(key), addrs=(), protocol_version=protocol.PROTOCOL_VERSION,
                    weights_hash=digest, architecture="qwen2", num_layers=4, layers=LayerRange(0, 2), device="cpu",
                    precision="f32", ttl_s=1.0).to_wire() | changes
    try:
        return sign_advert(PeerAdvert.from_wire(ad), key).to_wire()
    except (ProtocolError, LayerRangeError):
        return ad


def new_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def f32(t: torch.Tensor, **changes) -> dict:
    return tensors.tensor_to_wire(t) | changes


async def plant(peer, adverts: list[dict]) -> Raw:
    """A rogue peer connection (its own advert lives 60 s) that has gossiped ``adverts`` to ``peer``."""
    raw = await Raw.connect(peer, role="peer", advert=rogue_advert(peer.weights_hash, ttl_s=60.0))
    await raw.send("gossip", adverts=adverts)
    await raw.request("ping")
    return raw


@contextlib.asynccontextmanager
async def raw_conversation(tiny, bounds=(0, 4), *, role: str | None = "client", advert: dict | None = None,
                           **settings):
    """The setup most hostile tests share: peers over ``bounds`` (``serving``) and a ``Raw``
    connection to the first, saying hello as ``role`` (with ``advert`` as a peer); yields
    ``(peers, raw)``.

    On leaving, the connection is closed and then ``assert_healthy`` checks the peers. When the
    body raises, the connection is closed and the error propagates without the health check
    (as the ``try``/``finally`` it replaces did)."""
    async with serving(tiny, bounds, **settings) as peers:
        raw = await Raw.connect(peers[0], role=role, advert=advert)
        try:
            yield peers, raw
        finally:
            await raw.close()
        await assert_healthy(tiny, peers)
