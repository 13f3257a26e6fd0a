"""The meshinfer peer: serves one shard over websockets.

A peer accepts connections from clients and from other peers (either side may dial; a
connection is reused whichever side opened it, so a peer behind NAT that dialed out can
still be a later hop). It answers the handshake, gossips adverts, measures RTTs, and runs
``step`` frames of each open conversation in order on its device executor, forwarding
hidden states to the next hop or, on the last hop, sending the chosen token to the client.

:class:`Peer` owns the lifecycle and the dispatch of frames; each job is a collaborator that
owns its own fields, in a module of its own:

- :mod:`~meshinfer.peer.connections`: listening, dialing, reusing and tracking links;
- :mod:`~meshinfer.peer.handshake`: hello, welcome and auth, both sides;
- :mod:`~meshinfer.peer.gossip`: the table of adverts and the gossip rounds;
- :mod:`~meshinfer.peer.relay`: circuits for peers nobody can dial, and the reachability check;
- :mod:`~meshinfer.peer.conversations`: open conversations, their control frames and KV budget;
- :mod:`~meshinfer.peer.steps`: the step data path (queue, run, forward, reply);
- :mod:`~meshinfer.peer.audit`: the server side of the client's spot-checks.

Every task the peer starts is tracked and cancelled in :meth:`Peer.close`.
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch

from meshinfer.core.errors import InvalidInput, PeerUnavailable, ProtocolError, Unauthenticated
from meshinfer.core.logs import context
from meshinfer.engine.executor import DeviceExecutor
from meshinfer.engine.models.llama import Shard
from meshinfer.peer import limits
from meshinfer.peer.audit import Audits
from meshinfer.peer.connections import Connections
from meshinfer.peer.conversations import Conv, Conversations
from meshinfer.peer.gossip import Gossip
from meshinfer.peer.handshake import Handshake
from meshinfer.peer.limits import PRIVATE_MESH, ClientLimits, FrameBudgets, default_kv_budget
from meshinfer.peer.metrics import PeerMetrics, PeerUsage
from meshinfer.peer.relay import Relay
from meshinfer.peer.scheduler import BatchStats, StepScheduler
from meshinfer.peer.settings import PeerSettings
from meshinfer.peer.steps import ComputeCost, Steps, warmup
from meshinfer.text.bundle import bundle_sha256
from meshinfer.wire import discovery, protocol, tls
from meshinfer.wire.discovery import PeerTable, peer_id_of, sign_advert
from meshinfer.wire.protocol import PeerAdvert
from meshinfer.wire.transport import CLOSE_SHUTDOWN, Link

__all__ = ["ClientLimits", "PRIVATE_MESH", "Peer", "PeerSettings"]

log = logging.getLogger(__name__)


#: The dispatch table: a frame of each type is handled by ``on_<type>`` of the peer's collaborator
#: named here. :meth:`Peer._on_message` calls the peer's ``_on_<type>``, which forwards to it: a
#: subclass or a test may replace a handler on the peer, and ``super()._on_<type>`` still works.
HANDLERS = {
    "hello": "handshake", "auth": "handshake", "welcome": "handshake", "authed": "handshake",
    "get_tokenizer": "handshake", "get_peers": "gossip", "gossip": "gossip",
    "open": "conversations", "truncate": "conversations", "reroute": "conversations", "probe": "conversations",
    "close": "conversations", "step": "steps", "error": "steps", "get_log": "audits", "verify": "audits",
    "relay": "relay", "relay_back": "relay", "relay_close": "relay", "dial_back": "relay",
}


def _forward(msg_type: str, owner: str):
    """``_on_<msg_type>`` of the peer: await ``peer.<owner>.on_<msg_type>(link, f)``."""
    async def handler(self, link: Link, f) -> None:
        await getattr(getattr(self, owner), f"on_{msg_type}")(link, f)

    handler.__name__ = handler.__qualname__ = f"_on_{msg_type}"
    handler.__doc__ = f"Handle a ``{msg_type}`` frame: :meth:`{owner}.on_{msg_type}`."
    return handler


class _Handlers:
    """The ``_on_<type>`` methods of :data:`HANDLERS`, set below (each a :func:`_forward`)."""


for _type, _owner in HANDLERS.items():
    setattr(_Handlers, f"_on_{_type}", _forward(_type, _owner))


class Peer(_Handlers):
    """Serve ``shard`` to the mesh.

    Args:
        shard: the loaded layers.
        executor: the device thread that owns ``shard``.
        key: this peer's Ed25519 private key; its id is :func:`meshinfer.wire.discovery.peer_id_of` of it,
            and it signs the peer's adverts and handshake proofs.
        weights_hash: sha256 of the weights file (the identity of the model).
        precision: compute precision identity, e.g. ``"f32"``.
        tokenizer_bundle: what ``get_tokenizer`` returns (``Tokenizer.to_bundle()``).
        settings: :class:`PeerSettings`.
    """

    def __init__(self, shard: Shard, executor: DeviceExecutor, *, key, weights_hash: str,
                 precision: str, tokenizer_bundle: dict | None, settings: PeerSettings | None = None) -> None:
        self.shard, self.executor = shard, executor
        self.cfg = shard.cfg
        self.key, self.peer_id = key, peer_id_of(key)
        self.weights_hash, self.precision = weights_hash, precision
        self.tokenizer_bundle = tokenizer_bundle
        self.tokenizer_wire: bytes | None = None  # the bundle as msgpack, for tokenizer parts (made on first use)
        self.tokenizer_buckets: dict = {}  # client host -> its get_tokenizer budget (Handshake.tokenizer_bucket)
        self.tokenizer_sha256 = "" if tokenizer_bundle is None else bundle_sha256(tokenizer_bundle)
        self.settings = settings or PeerSettings()
        self.state = protocol.JOINING
        self.table = PeerTable(self.peer_id, capacity=limits.MAX_KNOWN_PEERS)
        self.cost = ComputeCost()  # the advertised ms per token (compute_ms_per_token)
        self.rtts_ms: dict[str, float] = {}
        self._tasks: set[asyncio.Task] = set()
        self._seq = discovery.first_seq()  # newer than any advert of this key's previous runs
        self._server = None
        self.addrs: tuple[str, ...] = ()
        self.tls_fingerprint = ""  # SHA-256 hex of the certificate served, once started with TLS
        self.kv_budget_bytes = self.settings.kv_budget_bytes or default_kv_budget(executor.device)
        self.max_frame_bytes = (self.settings.max_step_tokens * self.cfg.hidden_size * 4
                                + limits.FRAME_OVERHEAD_BYTES)
        self._closing = False
        self.stopped = asyncio.Event()  # set once close() has finished
        self.owns_executor = False
        self.metrics = PeerMetrics(self)
        self.budgets = FrameBudgets(lambda: self.settings.client_limits, self.metrics)  # see Link.admit
        #: whether others can dial this peer's addresses: None until checked (a peer that cannot
        #: check counts as reachable), False makes it advertise relays (see :meth:`relays`)
        self.reachable: bool | None = None
        self.reachability_note = ""  # why, in words
        self.conns, self.handshake, self.gossip = Connections(self), Handshake(self), Gossip(self)
        self.relay, self.conversations = Relay(self), Conversations(self)
        self.steps, self.audits = Steps(self), Audits(self)
        self.scheduler = StepScheduler(  # all looked up per call, so a subclass or test may replace them
            executor, lambda: self.shard, finish=lambda *a: self._finish_step(*a),
            logits_mode=lambda w: self.steps.logits_mode(w), spawn=self._spawn, max_batch=self.settings.max_batch,
            max_hold_s=self.settings.max_hold_s)

    @property
    def batch_stats(self) -> BatchStats:
        """Counters of the forward passes run for steps (batched and not)."""
        return self.scheduler.stats

    @property
    def convs(self) -> dict[str, Conv]:
        """Open conversations by id (:class:`meshinfer.peer.conversations.Conversations`)."""
        return self.conversations.by_id

    @property
    def links(self) -> dict[str, Link]:
        """Remote peer id -> link, whichever side dialed (:class:`meshinfer.peer.connections.Connections`)."""
        return self.conns.by_peer

    # ------------------------------------------------------------------ accounting
    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one token costs across this peer's layers: K and V, plus the float32 hidden
        state logged for replay when this peer is not the last hop."""
        return self.conversations.kv_bytes_per_token

    @property
    def param_counts(self) -> tuple[int, int]:
        """(resident, active per token) weights of this peer's layers; see ``ModelConfig.parameter_counts``."""
        return self.cfg.parameter_counts(self.shard.range)

    @property
    def capacity_tokens(self) -> int:
        """Tokens of KV the budget holds in all."""
        return self.conversations.capacity_tokens

    @property
    def free_kv_tokens(self) -> int:
        """Tokens of KV not reserved by open conversations."""
        return self.conversations.free_kv_tokens

    @property
    def kv_bytes_used(self) -> int:
        """Bytes of KV storage allocated now, all conversations."""
        return self.conversations.usage()[1]

    def usage(self) -> PeerUsage:
        """A snapshot of the conversations and KV memory, as plain values; safe to call from
        another thread (the metrics server's)."""
        conversations, used = self.conversations.usage()
        return PeerUsage(conversations=conversations, kv_used_bytes=used,
                         kv_free_bytes=self.free_kv_tokens * self.kv_bytes_per_token,
                         kv_budget_bytes=self.kv_budget_bytes)

    @property
    def compute_ms_per_token(self) -> float:
        """What a token costs on this peer's whole range now, ms: the advert's value
        (:class:`~meshinfer.peer.steps.ComputeCost`). Setting it is a measurement taken now."""
        return self.cost.value()

    @compute_ms_per_token.setter
    def compute_ms_per_token(self, ms: float) -> None:
        self.cost.set(ms)

    def advert(self) -> PeerAdvert:
        """This peer's current advert, signed by its key."""
        return sign_advert(PeerAdvert(
            peer_id=self.peer_id, addrs=self.addrs, protocol_version=protocol.PROTOCOL_VERSION,
            weights_hash=self.weights_hash, architecture=self.cfg.architecture,
            num_layers=self.cfg.num_hidden_layers, layers=self.shard.range, device=str(self.executor.device),
            precision=self.precision, state=self.state, free_kv_tokens=self.free_kv_tokens,
            compute_ms_per_token=round(self.compute_ms_per_token, 3), rtts_ms=dict(self.rtts_ms),
            seq=self._seq, ttl_s=self.settings.advert_ttl_s, tls_fingerprint=self.tls_fingerprint,
            tokenizer_sha256=self.tokenizer_sha256, relays=self.relays(),
            params=self.param_counts[0], active_params=self.param_counts[1]), self.key)

    def relays(self) -> tuple[str, ...]:
        """Peer ids this peer lists as its relays (:meth:`meshinfer.peer.relay.Relay.relays`)."""
        return self.relay.relays()

    # ------------------------------------------------------------------ lifecycle
    def _spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def warmup(self, *, prompt_tokens: int = 16) -> float:
        """Run one prefill and one decode on dummy input; return decode ms per token
        (:func:`meshinfer.peer.steps.warmup`)."""
        return await warmup(self, prompt_tokens=prompt_tokens)

    async def start(self, *, warmup: bool = True) -> None:
        """Warm up, listen, start gossip and the idle janitor; then state is ``ready``.

        Raises:
            InvalidInput: a non-loopback host without TLS or ``insecure``; unreadable TLS files;
                a public address whose scheme is not the one served; a metrics port that cannot be
                bound (the peer is closed again).
        """
        s = self.settings
        tls.check_listen(s.host, tls=s.tls_cert is not None, insecure=s.insecure)
        scheme = "wss" if s.tls_cert is not None else "ws"
        wrong = [a for a in s.public_addrs if not a.startswith(f"{scheme}://")]
        if len(s.public_addrs) > protocol.MAX_ADDRS:
            raise InvalidInput(f"{len(s.public_addrs)} public addresses given; an advert holds at most "
                               f"{protocol.MAX_ADDRS}")
        if wrong:
            raise InvalidInput(f"public address {wrong[0]} does not start with {scheme}://, the scheme this "
                               f"peer serves")
        ssl_context = None
        if s.tls_cert is not None:
            ssl_context = tls.server_context(s.tls_cert, s.tls_key or s.tls_cert)
            self.tls_fingerprint = tls.cert_fingerprint(s.tls_cert)
        if warmup:
            await self.warmup()
        if s.listen:
            await self.conns.listen(ssl_context, scheme)
        else:
            self.addrs, self.port, self.reachable = (), None, False
            self.reachability_note = "it does not listen (--listen none)"
            if not s.bootstrap:
                log.warning("--listen none without --peers: nobody can reach this peer")
        self._spawn(self.conns.keep_own_names_resolved(), "resolve own names")  # a name that hangs must not hold up start
        self.state = protocol.READY
        self._seq += 1
        self._spawn(self.gossip.loop(), "gossip")
        if s.listen and s.bootstrap and s.check_reachability:
            self._spawn(self.relay.check_reachability(), "reachability")
        self._spawn(self._janitor_loop(), "janitor")
        self.scheduler.start()
        self.metrics.set_info(peer_id=self.peer_id, layers=self.shard.range.cli(), device=self.executor.device,
                              precision=self.precision, weights=self.weights_hash[:12],
                              architecture=self.cfg.architecture)
        if s.metrics_port is not None:
            try:
                self.metrics.serve(s.metrics_host or s.host, s.metrics_port)
            except OSError as exc:
                await self.close()
                raise InvalidInput(f"cannot serve metrics on {s.metrics_host or s.host}:{s.metrics_port}: "
                                   f"{exc.strerror or exc} (pick another --metrics-port)") from exc
        log.info("peer %s ready at %s serving layers %s", self.peer_id[:12],
                 ", ".join(self.addrs) or "no address (it does not listen)", self.shard.range.cli(),
                 extra=context(peer=self.peer_id))

    async def close(self) -> None:
        """Drain: tell conversations' clients, close sockets, free caches. Safe to call twice."""
        if self._closing:
            return
        self._closing = True
        self.state = protocol.DRAINING
        for conv in list(self.convs.values()):
            conv.owner.post("error", conv=conv.conv_id, code=PeerUnavailable.code,
                            message=f"peer {self.peer_id[:12]} is shutting down")
            await self.conversations.drop(conv.conv_id)
        if self._server is not None:
            self._server.close()
        # at once: each close lets its outbox drain for up to CLOSE_FLUSH_TIMEOUT_S
        await asyncio.gather(*(link.close(CLOSE_SHUTDOWN, "peer shutting down") for link in list(self.conns.all)))
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
        if self.metrics.port is not None:  # joining the HTTP thread blocks up to 0.5 s: not on the loop
            await asyncio.to_thread(self.metrics.close)
        if self.owns_executor:
            self.executor.close()
        self.stopped.set()

    async def _janitor_loop(self) -> None:
        """Every few seconds: close idle links, forget idle hosts and old dial failures, free idle conversations."""
        while True:
            await asyncio.sleep(min(5.0, self.settings.idle_timeout_s / 2, limits.IDLE_LINK_TIMEOUT_S / 2))
            now = time.monotonic()
            self.conns.close_idle(now)
            self.budgets.forget_idle()
            self.conns.dial_failures = {p: f for p, f in self.conns.dial_failures.items()
                                        if f[0] + limits.MAX_DIAL_BACKOFF_S > now}
            await self.conversations.expire_idle(now)

    # ------------------------------------------------------------------ messages
    async def _on_message(self, link: Link, msg_type: str, f) -> None:
        if link.role is None and msg_type != "hello":
            raise ProtocolError(f"the first frame must be hello, got {msg_type}")
        if link.role == "client" or msg_type in limits.CLIENT_REQUESTS:
            self._charge(link, msg_type)
        if self.settings.mesh_key is not None and not link.info.get("authed") and msg_type not in ("hello", "auth"):
            raise Unauthenticated(limits.PRIVATE_MESH)
        handler = getattr(self, f"_on_{msg_type}", None)
        if handler is None:
            raise ProtocolError(f"a peer does not accept {msg_type} frames")
        await handler(link, f)

    def _charge(self, link: Link, msg_type: str) -> None:
        """Count a client's decoded frame against its host's :class:`ClientLimits` (:meth:`FrameBudgets.charge`)."""
        self.budgets.charge(link, msg_type)

    async def _on_ping(self, link: Link, f) -> None:
        await link.send("pong", re=f.get("id", int, None))

    async def _on_pong(self, link: Link, f) -> None:
        return None  # an unmatched (late) pong

    # ------------------------------------------------------------------ seams
    # Looked up on the peer at each use, so a subclass or a test may replace one.
    def _finish_step(self, conv: Conv, start: int, tokens: int, want: str, out: torch.Tensor, sampling=None):
        """What a step yields from its forward output (:meth:`meshinfer.peer.steps.Steps.finish_step`)."""
        return self.steps.finish_step(conv, start, tokens, want, out, sampling)

    async def _report(self, conv: Conv, seq: int, exc) -> None:
        """Tell ``conv``'s client that step ``seq`` failed (:meth:`meshinfer.peer.steps.Steps.report`)."""
        await self.steps.report(conv, seq, exc)

    async def _dial_any(self, addrs: tuple[str, ...], expect_id: str | None) -> Link:
        """Dial ``addrs`` at once (:meth:`meshinfer.peer.connections.Connections.dial_any`)."""
        return await self.conns.dial_any(addrs, expect_id)

    def _merge(self, ads: list[PeerAdvert], *, proven: bool = False) -> None:
        """Merge adverts into the table (:meth:`meshinfer.peer.gossip.Gossip.merge`)."""
        self.gossip.merge(ads, proven=proven)

    def _gossip_payload(self) -> list[dict]:
        """What a gossip round sends (:meth:`meshinfer.peer.gossip.Gossip.payload`)."""
        return self.gossip.payload()

    # the collaborators' fields, under the names they had when they were the peer's own
    _all_links = property(lambda self: self.conns.all)
    _host_connections = property(lambda self: self.conns.host_connections)
    _forwards = property(lambda self: self.relay.forwards)
    _queued_bytes = property(lambda self: self.steps.queued_bytes)
