"""The meshinfer peer: serves one shard over websockets.

A peer accepts connections from clients and from other peers (either side may dial; a
connection is reused whichever side opened it, so a peer behind NAT that dialed out can
still be a later hop). It answers the handshake, gossips adverts, measures RTTs, and runs
``step`` frames of each open conversation in order on its device executor, forwarding
hidden states to the next hop or, on the last hop, sending the chosen token to the client.

Every task the peer starts is tracked and cancelled in :meth:`Peer.close`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import websockets

from meshinfer.peer import verify
from meshinfer.wire import tensors
from meshinfer.wire import discovery, protocol, tls
from meshinfer.core.config import LayerRange
from meshinfer.wire.discovery import (DEFAULT_GOSSIP_INTERVAL_S, DEFAULT_TTL_S, PeerTable,
    peer_id_of, sign_advert, verify_advert)
from meshinfer.core.errors import (CacheFull, ContextOverflow, InvalidInput, LayerRangeError,
    LyingPeer, MeshError, PeerUnavailable, PositionError, ProtocolError, RateLimited,
    Unauthenticated)
from meshinfer.engine.executor import DeviceExecutor
from meshinfer.engine.kv_cache import HiddenLog, KVCache
from meshinfer.core.logs import context
from meshinfer.peer.metrics import PeerMetrics
from meshinfer.engine.models.llama import Shard
from meshinfer.wire.protocol import PeerAdvert
from meshinfer.engine.sampling import pick_token
from meshinfer.peer.scheduler import (DEFAULT_MAX_BATCH, DEFAULT_MAX_HOLD_S, BatchStats,
    StepScheduler)
from meshinfer.text.tokenizer import bundle_sha256
from meshinfer.wire.transport import (CLOSE_SHUTDOWN, RELAY_OVERHEAD_BYTES, CircuitSocket, Link,
    circuit_link, dial, first_success)

log = logging.getLogger(__name__)

#: Seconds a connection has to send its ``hello`` before it is closed.
HELLO_TIMEOUT_S = 10.0
#: Seconds a connection has for its TLS and HTTP upgrade handshake (websockets' ``open_timeout``):
#: a connection that never finishes its headers (slowloris) is dropped after it.
HANDSHAKE_TIMEOUT_S = 10.0
#: Default most connections one remote IP address may hold open on a peer at once
#: (``ClientLimits.connections``, ``join --max-connections-per-host``); more get HTTP 503 at the
#: upgrade. An honest client holds one per peer; the default leaves room for many clients behind
#: one NAT and for every peer of a machine, and keeps one host far below the 1,024 open files
#: a process often gets.
DEFAULT_CONNECTIONS_PER_HOST = 256
#: Most adverts of one gossip frame that are looked at; the rest are dropped unread. An honest
#: payload holds at most :data:`GOSSIP_BUDGET_BYTES` (32 KiB, about 80 adverts).
MAX_GOSSIP_ADVERTS = 128
#: Gossip frames one connection may send per second, sustained (token bucket, bursts of 2 s);
#: further ones are dropped unread. An honest peer sends one per gossip round (2 s by default).
GOSSIP_FRAMES_PER_S = 10.0
#: Gossiped adverts one connection may make this peer parse and check the signature of per
#: second, sustained (token bucket, bursts of 2 s). Adverts not newer than the record held, and
#: second copies of a peer in one frame, cost nothing and are skipped; past the budget the rest
#: of the frame is dropped unread. A check and a parse take about 0.1 ms, so a flood costs a peer
#: under 1% of a core per connection. An honest neighbour sends its own advert first, then its
#: table every gossip round (2 s): 64 a second covers a full table of 128 changed adverts a round.
GOSSIP_VERIFIES_PER_S = 64.0
#: Seconds a connection that holds no conversation (a client, or a peer that has not proven its
#: key) may stay silent before it is closed: idle connections cannot pile up to the open-file limit.
IDLE_LINK_TIMEOUT_S = 120.0
#: Tokenizer bundles one connection may fetch at once, then one per :data:`TOKENIZER_EVERY_S`
#: seconds (a bundle is up to 10 MB: a loop of requests would be a bandwidth amplifier).
TOKENIZER_BURST, TOKENIZER_EVERY_S = 2, 30.0
#: Steps queued per conversation before new ones are refused (flow control).
MAX_QUEUED_STEPS = 64
#: Most bytes of hidden states queued for the device over all conversations: 128 steps of
#: 512 tokens of the default model (1.8 MB each). Beyond it a step is refused (rate_limited),
#: so a previous hop that floods queues cannot grow the peer's memory without bound.
MAX_QUEUED_BYTES = 256 << 20
#: Most conversations one client connection may hold open at once.
MAX_CONVERSATIONS_PER_LINK = 64
#: Frame overhead allowed beyond the largest hidden-state payload, bytes.
FRAME_OVERHEAD_BYTES = 64 * 1024
#: Most peers one peer's table holds; adverts of further unknown peers are dropped, so a rogue
#: peer cannot grow the table (and every gossip round) without bound. A peer that proves its key
#: in a handshake still gets in, in place of an unproven record (see ``PeerTable.merge``).
MAX_KNOWN_PEERS = 256
#: Addresses learnt from others (gossip, ``open.next``) that a peer dials per second, sustained
#: (token bucket, bursts of 2 s): an attacker's adverts cannot make the mesh a request flood.
MAX_DIALS_PER_S = 8.0
#: After a failed dial of a peer id, its next dial waits this long, seconds, doubling with each
#: failure up to :data:`MAX_DIAL_BACKOFF_S`; bootstrap addresses are retried every gossip round.
DIAL_BACKOFF_S, MAX_DIAL_BACKOFF_S = 1.0, 30.0
#: Most peer ids whose dial failures a peer remembers (the oldest is forgotten first).
MAX_DIAL_FAILURES = 1024
#: Largest advert kept, bytes (an honest one is about 400 bytes plus 42 per RTT it reports).
MAX_ADVERT_BYTES = 16 * 1024
#: Largest gossip payload, bytes: below every peer's frame limit whatever its hidden size.
GOSSIP_BUDGET_BYTES = FRAME_OVERHEAD_BYTES // 2
#: Requests only clients make: charged to the sender's host whatever role its hello claimed
#: (a fresh key makes anyone a "peer" in an open mesh).
CLIENT_REQUESTS = frozenset({"open", "verify", "get_log", "truncate", "get_tokenizer", "get_peers", "relay"})
#: Circuits one connection may have a relay forward at once, and circuits a relay forwards to
#: one hidden peer, all openers together (each circuit costs a few map entries; its frames go
#: through the bounded outboxes of the two links).
MAX_CIRCUITS_PER_LINK, MAX_CIRCUITS_PER_PEER = 64, 256
#: Seconds a peer waits for the answer to its reachability check (the asked peer dials every
#: advertised address at once, each within its open timeout of 5 s).
DIAL_BACK_TIMEOUT_S = 15.0
#: What a connection that has not proven the mesh key is told, whatever it asks.
PRIVATE_MESH = "this mesh is private: pass its key with --mesh-key-file (or MESHINFER_MESH_KEY_FILE)"


@dataclass
class PeerSettings:
    """How a peer runs. Units are in the names.

    Attributes:
        host, port: where to listen (port 0: the OS picks).
        public_addrs: URLs others should dial (default: ``ws://host:port`` once bound).
        bootstrap: URLs of peers to learn the mesh from.
        max_step_tokens: most tokens in one step frame; sets the frame limit.
        kv_budget_bytes: KV-cache memory this peer may use for all conversations; None:
            :func:`default_kv_budget` of the device when the peer starts.
        idle_timeout_s: a conversation with no step for this long is freed.
        gossip_interval_s, advert_ttl_s: see :mod:`meshinfer.wire.discovery`.
        request_timeout_s: deadline of control requests (hello, ping, get_peers).
        mesh_key: shared secret of a private mesh, or None for an open one. Every connection
            must prove it (an HMAC over the handshake nonces) before anything else is accepted;
            it never crosses the wire.
        tls_cert, tls_key: PEM certificate and key to serve ``wss://`` with; None: plain ``ws://``.
        insecure: allow plain ``ws://`` on a non-loopback address, listening and dialing.
        tls_ca: PEM file of CA certificates that the certificates of the peers this one dials
            must chain to, on top of pinning; None: pinning only.
        client_limits: per-client-host limits, see :class:`ClientLimits`.
        metrics_port: serve Prometheus ``/metrics`` over HTTP on this port (0: the OS picks);
            None: no HTTP server (the metrics are still kept, in ``Peer.metrics``).
        metrics_host: address of the metrics server; None: ``host``.
        allow_ids: peer ids allowed in this peer's mesh (``--allow-keys``), or None for any.
            Hellos, adverts and gossip of other peers are refused or dropped; this peer's
            own id is always allowed. See :func:`meshinfer.wire.discovery.load_allowlist`.
        max_batch: most conversations whose decode steps run in one batched forward pass
            (see :mod:`meshinfer.peer.scheduler`); 1 runs every step alone.
        max_hold_s: the most a decode pass waits for the steps of conversations known to be
            coming, seconds (:data:`meshinfer.peer.scheduler.DEFAULT_MAX_HOLD_S`); 0 never waits.
        listen: accept connections on ``host:port``; False (``join --listen none``): no socket,
            the peer only dials out and is reached through its relays.
        check_reachability: on start, ask a bootstrap peer to dial the advertised addresses
            back; when none answers, the peer counts as unreachable and advertises relays.
    """

    host: str = "127.0.0.1"
    port: int = 0
    public_addrs: tuple[str, ...] = ()
    bootstrap: tuple[str, ...] = ()
    max_step_tokens: int = 512
    kv_budget_bytes: int | None = None
    idle_timeout_s: float = 300.0
    gossip_interval_s: float = DEFAULT_GOSSIP_INTERVAL_S
    advert_ttl_s: float = DEFAULT_TTL_S
    request_timeout_s: float = 10.0
    mesh_key: bytes | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    insecure: bool = False
    tls_ca: str | None = None
    client_limits: "ClientLimits" = field(default_factory=lambda: ClientLimits())
    metrics_port: int | None = None
    metrics_host: str | None = None
    allow_ids: frozenset[str] | None = None
    max_batch: int = DEFAULT_MAX_BATCH
    max_hold_s: float = DEFAULT_MAX_HOLD_S
    listen: bool = True
    check_reachability: bool = True


@dataclass(frozen=True)
class ClientLimits:
    """What one client host (by IP address) may use of a peer; beyond it, ``rate_limited``.

    Attributes:
        conversations: conversations open at once, all its connections together.
        connections: connections open at once (accepted by this peer); beyond it the websocket
            upgrade is answered with HTTP 503. Clients behind one NAT share it.
        steps_per_s: step frames per second, sustained (token bucket, bursts of 2 s).
        bytes_per_s: frame bytes per second, sustained (token bucket, bursts of 2 s).
        kv_share: share of the peer's KV capacity (tokens) the host's open conversations may
            reserve together, so that one host cannot reserve all of it and send nothing.
    """

    conversations: int = 64
    connections: int = DEFAULT_CONNECTIONS_PER_HOST
    steps_per_s: float = 200.0
    bytes_per_s: float = 32 * 2 ** 20
    kv_share: float = 0.5


class _Bucket:
    """A token bucket: ``rate`` per second, holding at most ``burst``."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst, self.level, self.t = rate, burst, burst, time.monotonic()

    def take(self, amount: float) -> bool:
        now = time.monotonic()
        self.level = min(self.burst, self.level + (now - self.t) * self.rate)
        self.t = now
        if amount > self.level:
            return False
        self.level -= amount
        return True


@dataclass
class _Conv:
    """One conversation on this peer."""

    conv_id: str
    run: LayerRange
    owner: Link
    prev_id: str | None
    next_id: str | None
    next_addrs: tuple[str, ...]
    reserved_tokens: int
    cache: KVCache
    sent: HiddenLog | None = None  # hidden states sent to the next hop, for replay
    received: bytearray = field(default_factory=bytearray)  # digests of received rows, tensors.DIGEST_BYTES each
    queue: asyncio.Queue = field(default_factory=lambda: asyncio.Queue(MAX_QUEUED_STEPS))
    task: asyncio.Task | None = None
    last_active: float = field(default_factory=time.monotonic)
    expected_start: int = 0
    next_relays: tuple[str, ...] | None = None  # the next hop's relays from ``open`` (None: from its advert)


class Peer:
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
        self.tokenizer_sha256 = "" if tokenizer_bundle is None else bundle_sha256(tokenizer_bundle)
        self.settings = settings or PeerSettings()
        self.state = protocol.JOINING
        self.table = PeerTable(self.peer_id, capacity=MAX_KNOWN_PEERS)
        self.compute_ms_per_token = 0.0
        self.rtts_ms: dict[str, float] = {}
        self.convs: dict[str, _Conv] = {}
        self.links: dict[str, Link] = {}  # remote peer id -> link, whichever side dialed
        self._all_links: set[Link] = set()
        self._tasks: set[asyncio.Task] = set()
        self._seq = discovery.first_seq()  # newer than any advert of this key's previous runs
        self._reserved_tokens = 0
        self._queued_bytes = 0  # hidden states of steps waiting in conversation queues
        self._server = None
        self.addrs: tuple[str, ...] = ()
        self.tls_fingerprint = ""  # SHA-256 hex of the certificate served, once started with TLS
        self.kv_budget_bytes = self.settings.kv_budget_bytes or default_kv_budget(executor.device)
        self.max_frame_bytes = (self.settings.max_step_tokens * self.cfg.hidden_size * 4
                                + FRAME_OVERHEAD_BYTES)
        self._dialing: dict[str, asyncio.Future] = {}
        self._dial_failures: dict[str, tuple[float, int]] = {}  # peer id -> (no dial before, failures in a row)
        self._dial_bucket = _Bucket(MAX_DIALS_PER_S, 2 * MAX_DIALS_PER_S)
        self._gossiping: set[str] = set()  # peer ids with a gossip exchange in flight
        self._bootstrap_errors: dict[str, str] = {}  # bootstrap URL -> the last reason it failed
        self._closing = False
        self.owns_executor = False
        self._buckets: dict[str, tuple[_Bucket, _Bucket]] = {}
        self.metrics = PeerMetrics(self)
        self._verifying: set[str] = set()  # hosts with a verify running
        #: whether others can dial this peer's addresses: None until checked (a peer that cannot
        #: check counts as reachable), False makes it advertise relays (see :meth:`relays`)
        self.reachable: bool | None = None
        self.reachability_note = ""  # why, in words
        self._forwards: dict[tuple[Link, int], tuple[Link, int]] = {}  # relay: (opener link, circ) -> (hidden peer's link, circ)
        self._backwards: dict[tuple[Link, int], tuple[Link, int]] = {}  # the reverse map
        self._host_connections: dict[str, int] = {}  # remote IP -> accepted connections open (from the upgrade on)
        self.scheduler = StepScheduler(  # all looked up per call, so a subclass or test may replace them
            executor, lambda: self.shard, finish=lambda *a: self._finish_step(*a),
            logits_mode=lambda w: self._logits_mode(w), spawn=self._spawn, max_batch=self.settings.max_batch,
            max_hold_s=self.settings.max_hold_s)

    @property
    def batch_stats(self) -> BatchStats:
        """Counters of the forward passes run for steps (batched and not)."""
        return self.scheduler.stats

    # ------------------------------------------------------------------ accounting
    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one token costs across this peer's layers: K and V, plus the float32 hidden
        state logged for replay when this peer is not the last hop."""
        elem = torch.empty((), dtype=self.shard.dtype).element_size()
        kv = 2 * len(self.shard.range) * self.cfg.num_key_value_heads * self.cfg.head_dim * elem
        return kv + (0 if self.shard.is_last else 4 * self.cfg.hidden_size)

    @property
    def param_counts(self) -> tuple[int, int]:
        """(resident, active per token) weights of this peer's layers; see ``ModelConfig.parameter_counts``."""
        return self.cfg.parameter_counts(self.shard.range)

    @property
    def capacity_tokens(self) -> int:
        """Tokens of KV the budget holds in all."""
        return self.kv_budget_bytes // self.kv_bytes_per_token

    @property
    def free_kv_tokens(self) -> int:
        """Tokens of KV not reserved by open conversations."""
        return max(0, self.capacity_tokens - self._reserved_tokens)

    @property
    def kv_bytes_used(self) -> int:
        """Bytes of KV storage allocated now, all conversations."""
        return sum(c.cache.nbytes + (c.sent.nbytes if c.sent else 0) for c in self.convs.values())

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
        """Peer ids this peer lists as its relays: empty unless it is unreachable; else the
        dialable, unrelayed peers it holds a link to that it opened itself (its NAT keeps
        those open), at most :data:`meshinfer.wire.protocol.MAX_RELAYS`, bootstrap peers first."""
        if self.reachable is not False:
            return ()
        out = []
        for peer_id, link in self.links.items():
            ad = self.table.get(peer_id)
            if link.closed.is_set() or link.relay_id is not None or not link.info.get("dialed"):
                continue
            if ad is not None and ad.addrs and not ad.relays:
                out.append((not link.info.get("bootstrap"), peer_id))
        return tuple(pid for _, pid in sorted(out)[:protocol.MAX_RELAYS])

    # ------------------------------------------------------------------ lifecycle
    def _spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def warmup(self, *, prompt_tokens: int = 16) -> float:
        """Run one prefill and one decode on dummy input; return decode ms per token.

        A cold GPU compiles kernels on its first request, so peers warm up before announcing.
        """
        def work() -> float:
            cache = KVCache(self.shard.range, self.cfg.num_key_value_heads, self.cfg.head_dim,
                            dtype=self.shard.dtype, device=self.shard.device, max_tokens=prompt_tokens + 8)
            if self.shard.is_first:
                x = torch.zeros(1, prompt_tokens, dtype=torch.int64)
                step = torch.zeros(1, 1, dtype=torch.int64)
            else:
                x = torch.zeros(1, prompt_tokens, self.cfg.hidden_size)
                step = torch.zeros(1, 1, self.cfg.hidden_size)
            self.shard(x, 0, cache)
            times = []
            for i in range(3):
                t0 = time.perf_counter()
                self.shard(step, prompt_tokens + i, cache)
                times.append(time.perf_counter() - t0)
            cache.free()
            return min(times) * 1e3

        t0 = time.perf_counter()
        self.compute_ms_per_token = await self.executor.run(work)
        log.info("warm-up done in %.2f s: decode %.1f ms/token for layers %s",
                 time.perf_counter() - t0, self.compute_ms_per_token, self.shard.range.cli())
        return self.compute_ms_per_token

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
            await self._listen(ssl_context, scheme)
        else:
            self.addrs, self.port, self.reachable = (), None, False
            self.reachability_note = "it does not listen (--listen none)"
            if not s.bootstrap:
                log.warning("--listen none without --peers: nobody can reach this peer")
        self.state = protocol.READY
        self._seq += 1
        self._spawn(self._gossip_loop(), "gossip")
        if s.listen and s.bootstrap and s.check_reachability:
            self._spawn(self._check_reachability(), "reachability")
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
        log.info("peer %s ready at %s serving layers %s", self.peer_id[:12], ", ".join(self.addrs),
                 self.shard.range.cli(), extra=context(peer=self.peer_id))

    async def _listen(self, ssl_context, scheme: str) -> None:
        """Accept connections on ``host:port``; set :attr:`addrs` (``public_addrs``, else the bound address)."""
        s = self.settings
        self._server = await websockets.serve(self._accept, s.host, s.port, max_size=self.max_frame_bytes,
                                              ssl=ssl_context, ping_interval=20, ping_timeout=20, compression=None,
                                              open_timeout=HANDSHAKE_TIMEOUT_S, process_request=self._admit)
        port = self._server.sockets[0].getsockname()[1]
        host = s.host if s.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        if host != s.host and not s.public_addrs:
            log.warning("listening on all interfaces without --public-addr: other machines cannot dial the "
                        "advertised %s; pass --public-addr %s://THIS-HOST:%d", host, scheme, port)
        self.addrs = tuple(s.public_addrs) or (f"{scheme}://{host}:{port}",)
        self.port = port

    async def close(self) -> None:
        """Drain: tell conversations' clients, close sockets, free caches. Safe to call twice."""
        if self._closing:
            return
        self._closing = True
        self.state = protocol.DRAINING
        for conv in list(self.convs.values()):
            conv.owner.post("error", conv=conv.conv_id, code=PeerUnavailable.code,
                            message=f"peer {self.peer_id[:12]} is shutting down")
            await self._drop_conv(conv.conv_id)
        if self._server is not None:
            self._server.close()
        # at once: each close lets its outbox drain for up to CLOSE_FLUSH_TIMEOUT_S
        await asyncio.gather(*(link.close(CLOSE_SHUTDOWN, "peer shutting down") for link in list(self._all_links)))
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
        if self.metrics.port is not None:  # joining the HTTP thread blocks up to 0.5 s: not on the loop
            await asyncio.to_thread(self.metrics.close)
        if self.owns_executor:
            self.executor.close()

    # ------------------------------------------------------------------ connections
    def _admit(self, ws, request):
        """Answer the upgrade with HTTP 503 when the remote host already holds
        ``client_limits.connections`` connections; else count this one until its socket closes."""
        host = str(ws.remote_address[0]) if ws.remote_address else "?"
        limit, held = self.settings.client_limits.connections, self._host_connections.get(host, 0)
        if held >= limit:
            self.metrics.error("too_many_connections")
            return ws.respond(503, f"{host} already holds {limit} connections to this peer, the most one host "
                                   f"may hold; close some and retry\n")
        self._host_connections[host] = held + 1
        ws.connection_lost_waiter.add_done_callback(lambda _f: self._release_host(host))
        return None

    def _release_host(self, host: str) -> None:
        left = self._host_connections.pop(host, 1) - 1
        if left > 0:
            self._host_connections[host] = left

    async def _accept(self, ws) -> None:
        link = Link(ws, max_bytes=self.max_frame_bytes, on_message=self._on_message,
                    name=f"{ws.remote_address}")
        await self._serve_link(link)

    async def _serve_link(self, link: Link) -> None:
        link.meter = self.metrics
        self._all_links.add(link)
        hello_timer = asyncio.get_running_loop().call_later(
            HELLO_TIMEOUT_S, lambda: link.role is None and self._spawn(link.close(1008, "no hello"), "close"))
        try:
            await link.run()
        finally:
            hello_timer.cancel()
            self._all_links.discard(link)
            self._drop_forwards(link)
            if link.remote_id and self.links.get(link.remote_id) is link:
                del self.links[link.remote_id]
            for conv in [c for c in self.convs.values() if c.owner is link]:
                log.info("client of conversation %s disconnected; freeing it", conv.conv_id,
                         extra=context(conv=conv.conv_id, peer=self.peer_id))
                await self._drop_conv(conv.conv_id)

    async def _link_to(self, peer_id: str, addrs: tuple[str, ...], relays: tuple[str, ...] | None = None) -> Link:
        """An open link to ``peer_id``: reuse any connection, else dial ``addrs``, else open a
        circuit through one of ``relays`` (None: those its advert in the table lists; ``()``: none).

        Raises:
            PeerUnavailable: no connection exists, no address answers and no relay reaches it.
        """
        link = self.links.get(peer_id)
        if link is not None and not link.closed.is_set():
            return link
        if peer_id in self._dialing:
            return await asyncio.shield(self._dialing[peer_id])
        until, failures = self._dial_failures.get(peer_id, (0.0, 0))
        if until > time.monotonic():
            raise PeerUnavailable(f"peer {peer_id[:12]} failed {failures} dial(s) in a row; next try in "
                                  f"{until - time.monotonic():.1f} s")
        if relays is None:
            known = self.table.get(peer_id)
            relays = known.relays if known is not None else ()
        fut = asyncio.get_running_loop().create_future()
        self._dialing[peer_id] = fut
        try:
            link = await self._reach(peer_id, addrs, relays)
            self._dial_failures.pop(peer_id, None)
            fut.set_result(link)
            return link
        except BaseException as exc:
            if isinstance(exc, PeerUnavailable):
                self._dial_failed(peer_id)
            fut.set_exception(exc if isinstance(exc, Exception) else PeerUnavailable("dial cancelled"))
            fut.exception()  # mark retrieved
            raise
        finally:
            del self._dialing[peer_id]

    async def _reach(self, peer_id: str, addrs: tuple[str, ...], relays: tuple[str, ...]) -> Link:
        """Dial ``addrs``; for a peer with ``relays`` (nobody can dial it), first a circuit through the
        first of them that reaches ``peer_id``, then its addresses.

        Raises:
            PeerUnavailable: naming each address's and relay's failure.
        """
        if not relays:
            return await self._dial_any(addrs, expect_id=peer_id)
        errors = []
        for relay_id in relays:  # it says nobody can dial it: its relays first, its addresses last
            relay = self.table.get(relay_id)
            try:
                if relay_id in (self.peer_id, peer_id) or relay is None:
                    raise PeerUnavailable("not a peer this one knows")
                carrier = await self._link_to(relay_id, relay.addrs, ())
                if carrier.relay_id is not None:
                    raise PeerUnavailable("it is reached through a relay itself")
                return await self._circuit_to(carrier, peer_id)
            except PeerUnavailable as exc:
                errors.append(f"through relay {relay_id[:12]}: {exc}")
        if addrs:
            try:
                return await self._dial_any(addrs, expect_id=peer_id)
            except PeerUnavailable as exc:
                errors.append(str(exc))
        raise PeerUnavailable(f"cannot reach peer {peer_id[:12]}: " + "; ".join(errors))

    async def _circuit_to(self, carrier: Link, peer_id: str) -> Link:
        """A link to ``peer_id`` over a circuit through ``carrier`` (a link to one of its relays),
        after the same handshake as a dialed link: the relay cannot answer for the peer.

        Raises:
            PeerUnavailable: the relay refused, or the handshake failed.
        """
        sock = carrier.open_circuit(peer_id, max_bytes=self.max_frame_bytes)
        link = circuit_link(sock, on_message=self._on_message, name=f"relay://{carrier.remote_id}")
        link = await self._shake(link, peer_id)
        self._merge([link.info.pop("advert")], proven=True)
        self.links.setdefault(peer_id, link)
        log.info("reached peer %s through relay %s", peer_id[:12], (carrier.remote_id or "?")[:12])
        return link

    def _dial_failed(self, peer_id: str) -> None:
        """Back off dialing ``peer_id``: :data:`DIAL_BACKOFF_S` doubled per failure in a row."""
        _, failures = self._dial_failures.pop(peer_id, (0.0, 0))
        if len(self._dial_failures) >= MAX_DIAL_FAILURES:
            del self._dial_failures[next(iter(self._dial_failures))]
        backoff_s = min(MAX_DIAL_BACKOFF_S, DIAL_BACKOFF_S * 2 ** failures)
        self._dial_failures[peer_id] = (time.monotonic() + backoff_s, failures + 1)

    async def _dial_any(self, addrs: tuple[str, ...], expect_id: str | None) -> Link:
        """Dial ``addrs`` at once and shake hands; the first link that proves ``expect_id`` (any
        peer for a bootstrap address, ``expect_id`` None). The others are closed.

        Raises:
            PeerUnavailable: no address answered, each error named.
        """
        try:
            link = await first_success([self._dial_one(url, expect_id) for url in addrs],
                                       discard=lambda lk: lk.close())
        except PeerUnavailable as exc:
            if expect_id is None:  # a bootstrap address: each error already names its URL
                raise
            raise PeerUnavailable(f"cannot reach peer {expect_id[:12]}: {exc}") from None
        self._merge([link.info.pop("advert")], proven=True)
        self.links.setdefault(link.remote_id, link)
        return link

    async def _dial_one(self, url: str, expect_id: str | None) -> Link:
        """Dial ``url`` and shake hands; the link holds the remote's advert in ``info["advert"]``.

        An address learnt from others (``expect_id`` given) takes a token of the peer's dial
        bucket (:data:`MAX_DIALS_PER_S`); bootstrap addresses do not.

        Raises:
            PeerUnavailable: not dialed (no token), unreachable, or the handshake failed.
        """
        if expect_id is not None and not self._dial_bucket.take(1):
            raise PeerUnavailable(f"{url}: not dialed; this peer dials at most {MAX_DIALS_PER_S:g} learnt "
                                  f"addresses a second")
        try:
            link = await dial(url, max_bytes=self.max_frame_bytes, on_message=self._on_message,
                              insecure=self.settings.insecure, tls_ca=self.settings.tls_ca)
        except InvalidInput as exc:
            raise PeerUnavailable(str(exc)) from exc
        link.info.update(dialed=True, bootstrap=url in self.settings.bootstrap)
        return await self._shake(link, expect_id)

    async def _shake(self, link: Link, expect_id: str | None) -> Link:
        """Track a new outgoing ``link`` (dialed, or a circuit) and shake hands on it; the link
        holds the remote's advert in ``info["advert"]``. It is closed when the handshake fails.

        Raises:
            PeerUnavailable: the handshake failed, naming the link.
        """
        link.meter = self.metrics
        self._all_links.add(link)
        link.reader.add_done_callback(lambda _t, lk=link: self._forget_link(lk))
        try:
            remote = await self._handshake(link, expect_id)
        except BaseException as exc:
            await link.close()
            if isinstance(exc, MeshError):
                raise PeerUnavailable(f"{link.name}: {exc}") from exc
            raise
        link.remote_id, link.role = remote.peer_id, "peer"
        link.info.update(authed=True, advert=remote)
        return link

    async def _handshake(self, link: Link, expect_id: str | None) -> PeerAdvert:
        """Dialer side: hello, check the welcome's proofs, answer with ``auth``; the remote's advert.

        Raises:
            Unauthenticated: the remote could not prove its key (or the mesh key), or is not
                ``expect_id``; or it refused this peer's proofs.
            ProtocolError, PeerUnavailable: a malformed welcome, a closed or silent connection.
        """
        timeout_s, mesh_key = self.settings.request_timeout_s, self.settings.mesh_key
        hello_nonce = discovery.new_nonce()
        relayed = link.relay_id is not None
        _, f = await link.request("hello", timeout_s=timeout_s, role="peer", nonce=hello_nonce,
                                  advert=self.advert().to_wire(), max_frame_bytes=self.max_frame_bytes)
        remote, welcome_nonce = discovery.check_welcome(f, hello_nonce, expect_id=expect_id, mesh_key=mesh_key,
                                                        tls_fingerprint=link.tls_fingerprint, dialed_url=link.name,
                                                        relayed=relayed)
        link.info["max_frame_bytes"] = f.int("max_frame_bytes", lo=1024, hi=1 << 40, default=None)
        if not self._allowed(remote.peer_id):
            raise Unauthenticated(discovery.not_allowed(remote.peer_id))
        auth = {"proof": discovery.prove(self.key, discovery.HELLO_LABEL, welcome_nonce, hello_nonce)}
        if mesh_key is not None:
            auth.update(discovery.auth_macs(mesh_key, welcome_nonce, hello_nonce, link.name))
        await link.request("auth", timeout_s=timeout_s, **auth)
        return remote

    def _forget_link(self, link: Link) -> None:
        self._all_links.discard(link)
        self._drop_forwards(link)
        if link.remote_id and self.links.get(link.remote_id) is link:
            del self.links[link.remote_id]

    # ------------------------------------------------------------------ messages
    async def _on_message(self, link: Link, msg_type: str, f) -> None:
        if link.role is None and msg_type != "hello":
            raise ProtocolError(f"the first frame must be hello, got {msg_type}")
        if link.role == "client" or msg_type in CLIENT_REQUESTS:
            self._charge(link, msg_type)
        if self.settings.mesh_key is not None and not link.info.get("authed") and msg_type not in ("hello", "auth"):
            raise Unauthenticated(PRIVATE_MESH)
        handler = getattr(self, f"_on_{msg_type}", None)
        if handler is None:
            raise ProtocolError(f"a peer does not accept {msg_type} frames")
        await handler(link, f)

    def _charge(self, link: Link, msg_type: str) -> None:
        """Count a client's frame against its host's :class:`ClientLimits`."""
        host = _client_host(link)
        limits = self.settings.client_limits
        steps, volume = self._buckets.setdefault(host, (_Bucket(limits.steps_per_s, 2 * limits.steps_per_s),
                                                        _Bucket(limits.bytes_per_s, 2 * limits.bytes_per_s)))
        if not volume.take(link.last_frame_bytes):
            raise RateLimited(f"client {host} sends more than {limits.bytes_per_s:.0f} bytes/s")
        if msg_type in ("step", "verify") and not steps.take(1):
            raise RateLimited(f"client {host} sends more than {limits.steps_per_s:g} steps/s")

    async def _on_hello(self, link: Link, f) -> None:
        if link.role is not None:
            raise ProtocolError("hello: this connection already said hello")
        role = f.str("role")
        if role not in ("client", "peer"):
            raise ProtocolError(f"hello: role {role!r} is not client or peer")
        claimed = PeerAdvert.from_wire(f.get("advert", dict)) if role == "peer" else None
        hello_nonce = discovery.read_nonce(f, "hello", None if role == "client" else ...) or b""
        if claimed is not None and not verify_advert(claimed):
            raise Unauthenticated(f"hello: the advert of peer {claimed.peer_id[:12]} does not verify against "
                                  f"its public key")
        if claimed is not None and not self._allowed(claimed.peer_id):
            raise Unauthenticated(discovery.not_allowed(claimed.peer_id))
        welcome_nonce = discovery.new_nonce()
        link.role = role
        link.info.update(hello_nonce=hello_nonce, welcome_nonce=welcome_nonce, claimed=claimed,
                         max_frame_bytes=f.int("max_frame_bytes", lo=1024, hi=1 << 40, default=None))
        extra = {}
        if self.settings.mesh_key is not None:
            extra["mac"] = discovery.mesh_mac(self.settings.mesh_key, discovery.MESH_WELCOME_LABEL, hello_nonce,
                                              welcome_nonce)
        await link.send("welcome", re=f.get("id", int, None), advert=self._welcome_advert().to_wire(), nonce=welcome_nonce,
                        proof=discovery.welcome_proof(self.key, hello_nonce, welcome_nonce,
                                                      "" if link.relay_id else self.tls_fingerprint),
                        private=self.settings.mesh_key is not None, max_step_tokens=self.settings.max_step_tokens,
                        max_frame_bytes=self.max_frame_bytes, **extra)

    async def _on_auth(self, link: Link, f) -> None:
        """Accepting side: check the dialer's proofs; a peer's connection counts as that peer's only now."""
        if link.info.get("authed"):
            raise ProtocolError("auth: this connection is already authenticated")
        hello_nonce, welcome_nonce = link.info["hello_nonce"], link.info["welcome_nonce"]
        if self.settings.mesh_key is not None:
            self._check_mesh_proof(link, f, hello_nonce, welcome_nonce)
        claimed = link.info["claimed"]
        if claimed is not None:
            if not discovery.check_proof(claimed.public_key, f.get("proof", bytes), discovery.HELLO_LABEL,
                                         welcome_nonce, hello_nonce):
                raise Unauthenticated(f"auth: the proof does not match the key of peer {claimed.peer_id[:12]}")
            link.remote_id = claimed.peer_id
            self._merge([claimed], proven=True)
            self.links.setdefault(claimed.peer_id, link)
        link.info["authed"] = True
        await link.send("authed", re=f.get("id", int, None))

    def _check_mesh_proof(self, link: Link, f, hello_nonce: bytes, welcome_nonce: bytes) -> None:
        """Check the mesh-key proof of an ``auth``, bound to this connection.

        With ``addr``, ``bound_mac`` must cover it and it must be an address of this peer (one
        it advertises, or the one this connection reached): a member's proof relayed by an
        outsider names the outsider's address. Without it (a peer older than the bound proof)
        the plain ``mac`` is accepted only over TLS, whose pinning already keeps relays out.

        Raises:
            Unauthenticated: a wrong MAC (:data:`PRIVATE_MESH`), a proof made for another address,
                or an unbound proof over plain ws.
        """
        key, addr = self.settings.mesh_key, f.str("addr", None)
        if addr is None:
            if not discovery.check_mac(key, f.get("mac", bytes, b""), discovery.MESH_HELLO_LABEL, welcome_nonce,
                                       hello_nonce):
                raise Unauthenticated(PRIVATE_MESH)
            if not self.tls_fingerprint or link.relay_id:
                raise Unauthenticated("auth: over ws:// a private mesh needs a proof bound to the address dialed "
                                      "(field 'addr'); update meshinfer, or serve wss://")
            return
        if not discovery.check_mac(key, f.get("bound_mac", bytes, b""), discovery.MESH_BOUND_LABEL, welcome_nonce,
                                   hello_nonce + addr.encode()):
            raise Unauthenticated(PRIVATE_MESH)
        if link.relay_id is not None:  # a circuit: the proof must name the relay it came through
            if addr != f"relay://{link.relay_id}":
                raise Unauthenticated(f"auth: the mesh-key proof was made for {addr[:100]}, not for a circuit "
                                      f"through relay {link.relay_id[:12]}")
            return
        host, port = link.ws.local_address[:2]
        scheme = "wss" if self.tls_fingerprint else "ws"
        here = {discovery.endpoint(a) for a in self.addrs} | {discovery.endpoint(f"{scheme}://{_url_host(host)}:{port}")}
        if discovery.endpoint(addr) not in here:
            raise Unauthenticated(f"auth: the mesh-key proof was made for {addr[:100]}, not for this peer "
                                  f"({', '.join(self.addrs)}): a relay is in between")

    def _welcome_advert(self) -> PeerAdvert:
        """This peer's advert for a ``welcome``. In a private mesh, where nobody has proven the
        key yet, it shows nothing about other users: no free KV tokens (their reservations) and
        no RTTs; it is one ``seq`` older than :meth:`advert`, so the full advert replaces it."""
        if self.settings.mesh_key is None:
            return self.advert()
        return sign_advert(replace(self.advert(), free_kv_tokens=0, rtts_ms={}, seq=self._seq - 1), self.key)

    async def _on_welcome(self, link: Link, f) -> None:
        raise ProtocolError("unexpected welcome")

    async def _on_authed(self, link: Link, f) -> None:
        raise ProtocolError("unexpected authed")

    async def _on_ping(self, link: Link, f) -> None:
        await link.send("pong", re=f.get("id", int, None))

    async def _on_pong(self, link: Link, f) -> None:
        return None  # an unmatched (late) pong

    async def _on_get_peers(self, link: Link, f) -> None:
        ads = [self.advert()] + self.table.adverts()
        await link.send("peers", re=f.get("id", int, None), adverts=[a.to_wire() for a in ads])

    async def _on_gossip(self, link: Link, f) -> None:
        if link.role != "peer":
            raise ProtocolError("gossip is only accepted from peers")
        if link.remote_id is None:
            raise Unauthenticated("gossip: this peer has not proven its key; send auth after welcome")
        frames = link.info.setdefault("gossips", _Bucket(GOSSIP_FRAMES_PER_S, 2 * GOSSIP_FRAMES_PER_S))
        if not frames.take(1):
            log.debug("dropping a gossip frame from %s: over %g a second", link.remote_id[:12], GOSSIP_FRAMES_PER_S)
            return
        budget = link.info.setdefault("verifies", _Bucket(GOSSIP_VERIFIES_PER_S, 2 * GOSSIP_VERIFIES_PER_S))
        known = self.table.seqs()
        ads, seen = [], set()
        for d in f.get("adverts", list)[:MAX_GOSSIP_ADVERTS]:
            peer_id = d.get("peer_id") if isinstance(d, dict) else None
            peer_id = peer_id if isinstance(peer_id, str) else None  # a malformed one fails in from_wire
            if peer_id in seen or (peer_id is not None and _not_newer(d, known)):
                continue  # a second copy, or one the table would not take: not worth parsing
            if not budget.take(1):
                log.debug("dropping gossip of %s unread: over %g adverts/s", link.remote_id[:12], GOSSIP_VERIFIES_PER_S)
                break
            if peer_id is not None:
                seen.add(peer_id)
            try:
                ads.append(PeerAdvert.from_wire(d))
            except (ProtocolError, LayerRangeError) as exc:
                log.debug("dropping a malformed advert from %s: %s", link.remote_id, exc)
        self._merge(ads)

    def _merge(self, ads: list[PeerAdvert], *, proven: bool = False) -> None:
        """Merge adverts into the table, dropping oversized or unsigned ones.

        ``proven``: their peers just proved their keys in a handshake with this peer. Once the
        table holds :data:`MAX_KNOWN_PEERS`, only such a peer gets in, in place of the unproven
        record closest to expiry that has no link and no conversation here. Adverts that could
        not get in, or are not newer than the record held, are dropped before their signature is
        checked.
        """
        known = self.table.seqs()
        full = len(known) >= MAX_KNOWN_PEERS
        keep = []
        for ad in ads:
            if full and not proven and ad.peer_id not in known:
                continue  # it could not get in: skip the signature check
            if ad.seq <= known.get(ad.peer_id, -1) and not proven:
                continue  # not newer than what is held: the table would not take it
            size = protocol.wire_size(ad.to_wire())
            if size > MAX_ADVERT_BYTES:
                log.debug("dropping the advert of %s: %d bytes, over %d", ad.peer_id[:12], size, MAX_ADVERT_BYTES)
                continue
            if not verify_advert(ad):
                log.debug("dropping an advert for %s: its signature does not verify", ad.peer_id[:12])
                continue
            if not self._allowed(ad.peer_id):
                log.debug("dropping the advert of %s: not on --allow-keys", ad.peer_id[:12])
                continue
            keep.append(ad)
        busy = {c.next_id for c in self.convs.values()} | {c.prev_id for c in self.convs.values()}
        self.table.merge(keep, proven=proven, protected=(set(self.links) | busy) - {None})

    def _allowed(self, peer_id: str) -> bool:
        """Whether ``peer_id`` may take part in this peer's mesh (``--allow-keys``)."""
        allow = self.settings.allow_ids
        return allow is None or peer_id == self.peer_id or peer_id in allow

    async def _on_get_tokenizer(self, link: Link, f) -> None:
        """The tokenizer bundle, at most :data:`TOKENIZER_BURST` per connection, then one per
        :data:`TOKENIZER_EVERY_S` seconds (``rate_limited``)."""
        if self.tokenizer_bundle is None:
            raise InvalidInput("this peer has no tokenizer")
        bucket = link.info.setdefault("tokenizers", _Bucket(1 / TOKENIZER_EVERY_S, TOKENIZER_BURST))
        if not bucket.take(1):
            raise RateLimited(f"get_tokenizer: at most {TOKENIZER_BURST} per connection, then one every "
                              f"{TOKENIZER_EVERY_S:g} s; keep the bundle you have")
        await link.send("tokenizer", re=f.get("id", int, None), weights_hash=self.weights_hash,
                        bundle=self.tokenizer_bundle)

    async def _on_open(self, link: Link, f) -> None:
        rid = f.get("id", int, None)
        conv_id = f.str("conv")
        if conv_id in self.convs and self.convs[conv_id].owner.closed.is_set():
            await self._drop_conv(conv_id)  # its client's connection (a circuit) is gone; it reopens here
        if conv_id in self.convs:
            raise ProtocolError(f"open: conversation {conv_id[:40]!r} is already open")
        if self.state != protocol.READY:
            raise PeerUnavailable(f"peer {self.peer_id[:12]} is {self.state}")
        run = f.layer_range("layers")
        if run.start < self.shard.range.start or run.stop > self.shard.range.stop:
            raise LayerRangeError(f"this peer serves layers {self.shard.range.cli()}, asked for {run.cli()}")
        tokens = f.int("max_tokens", lo=1, hi=1 << 40)
        if tokens > self.cfg.max_position_embeddings:
            raise ContextOverflow(f"conversation asks for {tokens} tokens; the model's context is "
                                  f"{self.cfg.max_position_embeddings} tokens")
        if sum(1 for c in self.convs.values() if c.owner is link) >= MAX_CONVERSATIONS_PER_LINK:
            raise CacheFull(f"this connection already holds {MAX_CONVERSATIONS_PER_LINK} conversations")
        host, limit = _client_host(link), self.settings.client_limits.conversations
        if sum(1 for c in self.convs.values() if _client_host(c.owner) == host) >= limit:
            raise RateLimited(f"client {host} already holds {limit} conversations on this peer")
        if tokens > self.free_kv_tokens:
            raise CacheFull(f"conversation needs {tokens} tokens of KV cache; this peer has "
                            f"{self.free_kv_tokens} free of {self.capacity_tokens}")
        self._check_host_reservation(host, tokens)
        prev_id, next_id, next_addrs, next_relays = self._neighbours(f, run)
        cache = KVCache(run, self.cfg.num_key_value_heads, self.cfg.head_dim, dtype=self.shard.dtype,
                        device=self.shard.device, max_tokens=tokens)
        conv = _Conv(conv_id=conv_id, run=run, owner=link, prev_id=prev_id, next_id=next_id,
                     next_addrs=next_addrs, next_relays=next_relays, reserved_tokens=tokens, cache=cache,
                     sent=HiddenLog(self.cfg.hidden_size, max_tokens=tokens) if next_id else None)
        self.convs[conv_id] = conv
        self._reserved_tokens += tokens
        conv.task = self._spawn(self._conv_worker(conv), f"conv {conv_id[:12]}")
        log.info("opened conversation %s: layers %s, %d tokens reserved", conv_id, run.cli(), tokens,
                 extra=context(conv=conv_id, peer=self.peer_id))
        await link.send("opened", re=rid, conv=conv_id, free_kv_tokens=self.free_kv_tokens)

    def _check_host_reservation(self, host: str, tokens: int) -> None:
        """Raise :class:`RateLimited` when ``host``'s open conversations plus ``tokens`` would
        reserve more than ``client_limits.kv_share`` of this peer's KV capacity."""
        limit = int(self.capacity_tokens * self.settings.client_limits.kv_share)
        held = sum(c.reserved_tokens for c in self.convs.values() if _client_host(c.owner) == host)
        if held + tokens > limit:
            raise RateLimited(f"client {host} holds {held} tokens of KV cache on this peer; {tokens} more would "
                              f"pass its limit of {limit} ({self.settings.client_limits.kv_share:.0%} of "
                              f"{self.capacity_tokens})")

    def _neighbours(self, f, run: LayerRange) -> tuple[str | None, str | None, tuple[str, ...], tuple[str, ...] | None]:
        """``prev`` and ``next`` (id, addresses, relays or None) of an open/reroute frame,
        checked against the hop's position."""
        nxt = f.get("next", dict, None)
        nf = protocol.Fields(nxt, f"{f.what}.next") if nxt else None
        next_id = nf.str("peer_id") if nf else None
        next_addrs = protocol.check_addrs(nf.str_list("addrs"), f"{f.what}.next") if nf else ()
        has_relays = nf is not None and nf.get("relays", list, None) is not None
        next_relays = protocol.check_relays(nf.str_list("relays"), f"{f.what}.next") if has_relays else None
        if (run.stop < self.cfg.num_hidden_layers) != (next_id is not None):
            raise ProtocolError(f"{f.what}: 'next' must name the next hop unless this hop runs the last layer")
        prev_id = f.str("prev", None)
        if (run.start > 0) != (prev_id is not None):
            raise ProtocolError(f"{f.what}: 'prev' must name the previous hop unless this hop runs layer 0")
        return prev_id, next_id, next_addrs, next_relays

    async def _on_step(self, link: Link, f) -> None:
        conv = self.convs.get(f.str("conv"))
        seq = f.int("seq", lo=0, hi=1 << 62)
        if conv is None:
            raise InvalidInput(f"step {seq}: conversation {f.str('conv')[:40]!r} is not open on this peer")
        allowed = link is conv.owner if conv.run.start == 0 else link.remote_id == conv.prev_id
        if not allowed:
            raise ProtocolError(f"step {seq}: this connection may not send steps for conversation {conv.conv_id}")
        if link is conv.owner and link.role != "client":  # a "peer" driving its own conversation is a client
            self._charge(link, "step")
        start = f.int("start", lo=0, hi=self.cfg.max_position_embeddings)
        if conv.run.start == 0:
            tokens = f.get("tokens", list)
            if not 0 < len(tokens) <= self.settings.max_step_tokens or not all(
                    type(t) is int and 0 <= t < self.cfg.vocab_size for t in tokens):
                raise InvalidInput(f"step {seq}: tokens must be 1-{self.settings.max_step_tokens} ids in "
                                   f"[0, {self.cfg.vocab_size})")
            x = torch.tensor([tokens], dtype=torch.int64)  # (1, T)
        elif link is conv.owner:  # no other client to tell: plain validation, errors to the sender
            x = tensors.tensor_from_wire(f.get("hidden", dict), width=self.cfg.hidden_size,
                                          max_elements=self.settings.max_step_tokens * self.cfg.hidden_size)
            if x.dim() != 3 or x.shape[0] != 1:
                raise InvalidInput(f"step {seq}: hidden states must be (1, T, {self.cfg.hidden_size})")
        else:
            x = await self._incoming_hidden(conv, f, seq)
            if x is None:
                return
        if f.get("replay", bool, False) and start + x.shape[1] <= conv.cache.length <= conv.expected_start:
            # failover replay of positions this hop kept: pass its logged output on, compute nothing
            self._enqueue(conv, (seq, start, x.shape[1], "none", [], time.perf_counter(), True, None))
            if conv.run.start > 0:  # a new previous hop's log must match what it sent now
                d = tensors.DIGEST_BYTES
                conv.received[d * start:d * (start + x.shape[1])] = tensors.row_digests(x)
            return
        rollback = f.get("rollback", bool, False)
        if start != conv.expected_start and not (rollback and start < conv.expected_start):
            raise PositionError(f"step {seq} starts at position {start}; conversation {conv.conv_id} "
                                f"expects position {conv.expected_start}")
        if rollback and conv.expected_start - start >= protocol.MAX_VERIFY_TOKENS:
            raise PositionError(f"step {seq} rolls back {conv.expected_start - start} positions; a rollback drops "
                                f"the rejected drafts of one step, fewer than {protocol.MAX_VERIFY_TOKENS}")
        if start + x.shape[1] > conv.reserved_tokens:
            raise CacheFull(f"step {seq} would grow the conversation to {start + x.shape[1]} tokens; "
                            f"it reserved {conv.reserved_tokens}")
        trace = protocol.trace_from_wire(f.get("trace", list, []), "step")
        want = f.str("want", "none")
        if want not in protocol.STEP_WANTS:
            raise ProtocolError(f"step {seq}: want {want[:40]!r} is not one of {', '.join(protocol.STEP_WANTS)}")
        if want == "tokens" and x.shape[1] > protocol.MAX_VERIFY_TOKENS:
            raise InvalidInput(f"step {seq}: want=tokens allows at most {protocol.MAX_VERIFY_TOKENS} tokens "
                               f"per step, got {x.shape[1]}")
        sampling = protocol.sampling_from_wire(f.get("sampling", dict, None), f"step {seq}")
        if want == "tokens" and sampling is not None:
            raise InvalidInput(f"step {seq}: want=tokens verifies greedy drafts; it cannot carry sampling")
        self._enqueue(conv, (seq, start, x, want, trace, time.perf_counter(), f.get("replay", bool, False),
                             sampling, rollback))
        conv.expected_start = start + x.shape[1]
        if conv.run.start > 0:  # what the previous hop sent, for spot-checks of its log
            del conv.received[tensors.DIGEST_BYTES * start:]
            conv.received += tensors.row_digests(x)

    async def _incoming_hidden(self, conv: _Conv, f, seq: int) -> torch.Tensor | None:
        """Hidden states ``(1, T, C)`` float32 of a step from the previous hop, or None when they fail
        :func:`meshinfer.peer.verify.check_hidden`: then the conversation's client is told, naming the
        sender as ``suspect``, and the step is dropped."""
        try:
            try:
                x = tensors.tensor_from_wire(f.get("hidden", dict),
                                              max_elements=self.settings.max_step_tokens * self.cfg.hidden_size)
            except ProtocolError as exc:
                raise LyingPeer(f"previous hop {(conv.prev_id or '?')[:12]} sent an unreadable tensor: {exc}",
                                suspect=conv.prev_id) from exc
            verify.check_hidden(x, width=self.cfg.hidden_size, sender=conv.prev_id)
            return x
        except LyingPeer as exc:
            log.warning("conversation %s, step %d: %s", conv.conv_id[:12], seq, exc)
            # the previous hop's read loop must not wait on this client: post, never send
            conv.owner.post("error", conv=conv.conv_id, seq=seq, code=exc.code, message=str(exc), suspect=exc.suspect)
            return None

    async def _on_get_log(self, link: Link, f) -> None:
        """Spot-check: the hidden states this hop sent for positions ``[start, stop)`` (``hidden``,
        not on the last hop) and the digests of those it received (``received``, not on hop 0)."""
        conv = self.convs.get(f.str("conv"))
        if conv is None or conv.owner is not link:
            raise InvalidInput("get_log: no such conversation on this connection")
        start = f.int("start", lo=0, hi=self.cfg.max_position_embeddings)
        stop = f.int("stop", lo=start + 1, hi=start + self.settings.max_step_tokens)
        await conv.queue.join()
        reply = {}
        if conv.sent is not None:
            reply["hidden"] = tensors.tensor_to_wire(conv.sent.slice(start, stop))
        if conv.run.start > 0:
            reply["received"] = bytes(conv.received[tensors.DIGEST_BYTES * start:tensors.DIGEST_BYTES * stop])
        await link.send("log", re=f.get("id", int, None), conv=conv.conv_id, **reply)

    async def _on_verify(self, link: Link, f) -> None:
        """Spot-check: run ``layers`` statelessly over a prefix; return positions from ``check`` on.

        At most one verify per client host runs at a time (another gets ``rate_limited``); a prefix holds at most
        ``max_step_tokens`` positions, and clients' verifies count as steps in their limits.
        """
        run = f.layer_range("layers")
        if run.start < self.shard.range.start or run.stop > self.shard.range.stop:
            raise LayerRangeError(f"verify: this peer serves layers {self.shard.range.cli()}, asked for {run.cli()}")
        n_max = self.settings.max_step_tokens
        if run.start == 0:
            tokens = f.get("tokens", list)
            if not 0 < len(tokens) <= n_max or not all(type(t) is int and 0 <= t < self.cfg.vocab_size
                                                       for t in tokens):
                raise InvalidInput(f"verify: tokens must be 1-{n_max} ids in [0, {self.cfg.vocab_size})")
            x = torch.tensor([tokens], dtype=torch.int64)  # (1, P)
        else:
            x = tensors.tensor_from_wire(f.get("hidden", dict), width=self.cfg.hidden_size,
                                          max_elements=n_max * self.cfg.hidden_size)
            if x.dim() != 3 or x.shape[0] != 1 or x.dtype != torch.float32:
                raise InvalidInput(f"verify: hidden states must be float32 (1, P, {self.cfg.hidden_size})")
        check = f.int("check", lo=0, hi=x.shape[1] - 1)
        host = _client_host(link)
        if host in self._verifying:  # one at a time per host: a flood from one cannot starve the others
            raise RateLimited(f"peer {self.peer_id[:12]} is busy with another verify from {host}; try later")
        self._verifying.add(host)
        try:
            out = await self.executor.run(verify.recompute, self.shard, x, run, check)
        finally:
            self._verifying.discard(host)
        reply = {"tokens": out} if isinstance(out, list) else {"hidden": tensors.tensor_to_wire(out)}
        await link.send("verified", re=f.get("id", int, None), **reply)

    def _enqueue(self, conv: _Conv, item: tuple) -> None:
        """Queue a step for ``conv``'s worker. Its hidden states count against
        :data:`MAX_QUEUED_BYTES` (all conversations) until the worker takes it.

        Raises:
            CacheFull: the conversation has :data:`MAX_QUEUED_STEPS` steps queued.
            RateLimited: the peer holds :data:`MAX_QUEUED_BYTES` of queued hidden states.
        """
        size = item[2].nbytes if isinstance(item[2], torch.Tensor) else 0
        if size and self._queued_bytes + size > MAX_QUEUED_BYTES:
            raise RateLimited(f"peer {self.peer_id[:12]} holds {self._queued_bytes} bytes of queued steps; "
                              f"{size} more would pass {MAX_QUEUED_BYTES}")
        try:
            conv.queue.put_nowait(item)
        except asyncio.QueueFull:
            raise CacheFull(f"conversation {conv.conv_id} has {MAX_QUEUED_STEPS} steps queued") from None
        self._queued_bytes += size
        conv.last_active = time.monotonic()

    async def _on_truncate(self, link: Link, f) -> None:
        conv = self.convs.get(f.str("conv"))
        if conv is None or conv.owner is not link:
            raise InvalidInput("truncate: no such conversation on this connection")
        length = f.int("length", lo=0, hi=self.cfg.max_position_embeddings)
        await conv.queue.join()
        await self.executor.run(conv.cache.truncate, length)
        if conv.sent is not None:
            conv.sent.truncate(length)
        del conv.received[tensors.DIGEST_BYTES * length:]
        conv.expected_start = length
        await link.send("truncated", re=f.get("id", int, None), conv=conv.conv_id, length=length)

    async def _on_reroute(self, link: Link, f) -> None:
        """Failover: the client moved this kept hop's neighbours; its cache stays."""
        conv = self.convs.get(f.str("conv"))
        if conv is None or conv.owner is not link:
            raise InvalidInput("reroute: no such conversation on this connection")
        if f.layer_range("layers") != conv.run:
            raise LayerRangeError(f"reroute: conversation {conv.conv_id} runs layers {conv.run.cli()} here")
        prev_id, next_id, next_addrs, next_relays = self._neighbours(f, conv.run)
        conv.prev_id, conv.next_id, conv.next_addrs, conv.next_relays = prev_id, next_id, next_addrs, next_relays
        log.info("conversation %s rerouted (failover): previous hop %s, next hop %s", conv.conv_id,
                 (prev_id or "client")[:12], (next_id or "client")[:12],
                 extra=context(conv=conv.conv_id, peer=self.peer_id))
        await link.send("rerouted", re=f.get("id", int, None), conv=conv.conv_id)

    async def _on_probe(self, link: Link, f) -> None:
        """How many positions this hop holds for a conversation (failover finds stuck hops)."""
        conv = self.convs.get(f.str("conv"))
        if conv is None or conv.owner is not link:
            raise InvalidInput("probe: no such conversation on this connection")
        await link.send("probed", re=f.get("id", int, None), conv=conv.conv_id, length=conv.cache.length,
                        queued=conv.queue.qsize())

    async def _on_close(self, link: Link, f) -> None:
        conv = self.convs.get(f.str("conv"))
        if conv is not None and conv.owner is link:
            log.info("closed conversation %s at %d tokens", conv.conv_id, conv.cache.length,
                     extra=context(conv=conv.conv_id, peer=self.peer_id))
            await self._drop_conv(conv.conv_id)

    async def _on_error(self, link: Link, f) -> None:
        """An error from the next hop about a conversation: relay it to the conversation's client.

        Posted, never awaited: this runs in the next hop's read loop, which a client that does
        not read must not stall (:meth:`meshinfer.wire.transport.Link.post` cuts that client off instead).
        """
        conv = self.convs.get(f.str("conv", "") or "")
        if conv is not None and link.remote_id is not None and link.remote_id == conv.next_id:
            conv.owner.post("error", conv=conv.conv_id, seq=f.get("seq", int, None),
                            code=f.str("code", "mesh_error"), message=f.str("message", ""))
        else:
            log.debug("error frame from %s: %s", link.name, f.str("message", ""))

    # ------------------------------------------------------------------ relays
    async def _on_relay(self, link: Link, f) -> None:
        """A circuit frame toward a hidden peer: forward it (this peer is its relay; the frame
        names ``to``), or, without ``to``, the first frame of a circuit to this peer."""
        circ = f.int("circ", lo=0, hi=1 << 62)
        data = f.get("data", bytes)
        to = f.str("to", None)
        if to is None:
            try:
                self._accept_circuit(link, circ, data, host=f.str("host", "?")[:64])
            except MeshError as exc:
                link.post("relay_close", circ=circ, back=True, message=str(exc)[:200], cut=False)
                raise
            return
        dest = self._forwards.get((link, circ))
        if dest is None:
            try:
                dest = self._open_forward(link, circ, to)
            except MeshError as exc:
                link.post("relay_close", circ=circ, back=True, message=str(exc), cut=False)
                raise
        if not dest[0].post("relay", circ=dest[1], data=data, host=_client_host(link), cut=False):
            self._end_forward(link, circ, f"peer {to[:12]} does not read fast enough")

    def _open_forward(self, link: Link, circ: int, to: str) -> tuple[Link, int]:
        """Start forwarding circuit ``circ`` of ``link`` to peer ``to``, a peer that lists this one as
        its relay and holds a link it opened here.

        Raises:
            Unauthenticated: ``link`` has not said hello.
            PeerUnavailable: ``to`` has no such link here, or does not list this peer as a relay.
            RateLimited: too many circuits from ``link`` or to ``to``.
        """
        target = self.links.get(to)
        advert = self.table.get(to)
        if target is None or target.closed.is_set() or target.relay_id is not None or target is link:
            raise PeerUnavailable(f"relay {self.peer_id[:12]} holds no link from peer {to[:12]}")
        if advert is None or self.peer_id not in advert.relays:
            raise PeerUnavailable(f"peer {to[:12]} does not list {self.peer_id[:12]} among its relays")
        if sum(1 for lk, _ in self._forwards if lk is link) >= MAX_CIRCUITS_PER_LINK:
            raise RateLimited(f"this connection already has {MAX_CIRCUITS_PER_LINK} circuits through this relay")
        if sum(1 for lk, _ in self._backwards if lk is target) >= MAX_CIRCUITS_PER_PEER:
            raise RateLimited(f"peer {to[:12]} already has {MAX_CIRCUITS_PER_PEER} circuits through this relay")
        dest = (target, target.next_circuit_id())
        self._forwards[(link, circ)] = dest
        self._backwards[dest] = (link, circ)
        return dest

    async def _on_relay_back(self, link: Link, f) -> None:
        """A circuit frame from a hidden peer back toward the circuit's opener: forward it."""
        circ = f.int("circ", lo=0, hi=1 << 62)
        data = f.get("data", bytes)
        src = self._backwards.get((link, circ))
        if src is None:
            return  # a circuit that ended meanwhile
        if not src[0].post("relay_back", circ=src[1], data=data, cut=False):
            self._end_forward(*src, f"the opener of circuit {src[1]} does not read fast enough")

    async def _on_relay_close(self, link: Link, f) -> None:
        """One end closed a circuit this peer forwards: tell the other end."""
        circ = f.int("circ", lo=0, hi=1 << 62)
        if f.get("back", bool, False):
            src = self._backwards.get((link, circ))
            if src is not None:
                self._end_forward(*src, f.str("message", "closed by the peer"))
        elif (link, circ) in self._forwards:
            self._end_forward(link, circ, "closed by its opener")

    def _end_forward(self, link: Link, circ: int, reason: str) -> None:
        """Stop forwarding circuit ``circ`` of opener ``link``; tell both ends (best effort)."""
        dest = self._forwards.pop((link, circ), None)
        if dest is None:
            return
        self._backwards.pop(dest, None)
        log.debug("circuit %d ends: %s", circ, reason)
        link.post("relay_close", circ=circ, back=True, message=reason[:200], cut=False)
        dest[0].post("relay_close", circ=dest[1], back=False, cut=False)

    def _drop_forwards(self, link: Link) -> None:
        """``link`` closed: end every circuit forwarded from or to it."""
        for opener, circ in [k for k, v in self._forwards.items() if k[0] is link or v[0] is link]:
            self._end_forward(opener, circ, "a link of the relay closed")

    def _accept_circuit(self, carrier: Link, circ: int, data: bytes, *, host: str) -> None:
        """The first frame of a circuit a relay opened to this peer: serve it like a connection.

        Raises:
            ProtocolError: ``carrier`` is not a link to one of this peer's relays.
            RateLimited: the relay already carries :data:`MAX_CIRCUITS_PER_PEER` circuits here.
        """
        if carrier.relay_id is not None or carrier.remote_id is None or carrier.remote_id not in self.relays():
            raise ProtocolError(f"relay: peer {(carrier.remote_id or '?')[:12]} is not a relay of this peer")
        if sum(1 for side, _ in carrier.circuits if side == "in") >= MAX_CIRCUITS_PER_PEER:
            carrier.post("relay_close", circ=circ, back=True, message="too many circuits", cut=False)
            raise RateLimited(f"relay {carrier.remote_id[:12]} already carries {MAX_CIRCUITS_PER_PEER} circuits")
        limit = carrier.info.get("max_frame_bytes")
        sock = CircuitSocket(carrier, circ, side="in", max_bytes=self.max_frame_bytes,
                             max_send_bytes=None if limit is None else limit - RELAY_OVERHEAD_BYTES,
                             remote_address=(f"{host} via {carrier.remote_id[:12]}", 0))
        carrier.circuits[("in", circ)] = sock
        link = Link(sock, max_bytes=self.max_frame_bytes, on_message=self._on_message,
                    name=f"circuit {circ} through {carrier.remote_id[:12]}")
        self._spawn(self._serve_link(link), f"circuit {circ}")
        sock.feed(data)

    # ------------------------------------------------------------------ reachability
    async def _check_reachability(self) -> None:
        """Ask a bootstrap peer to dial this peer's addresses back (Petals' reachability check):
        :attr:`reachable` becomes True or False; it stays None when no peer can be asked."""
        for _ in range(30):
            link = next((lk for lk in self.links.values() if lk.info.get("bootstrap") and not lk.closed.is_set()),
                        None)
            if link is not None:
                break
            await asyncio.sleep(self.settings.gossip_interval_s)
        else:
            log.info("reachability not checked: no bootstrap peer answered")
            return
        try:
            _, f = await link.request("dial_back", timeout_s=DIAL_BACK_TIMEOUT_S)
        except MeshError as exc:
            log.info("reachability not checked: %s", exc)
            return
        self.reachable = f.get("ok", bool)
        if self.reachable:
            self.reachability_note = f"peer {link.remote_id[:12]} dialed {f.str('addr', '?')} back"
            log.info("reachable: %s", self.reachability_note)
        else:
            self.reachability_note = f"peer {link.remote_id[:12]} could not dial it back: {f.str('reason', '?')}"
            log.warning("unreachable at %s (%s); clients will reach this peer through relays %s",
                        ", ".join(self.addrs), self.reachability_note, ", ".join(r[:12] for r in self.relays()))
        self._seq += 1

    async def _on_dial_back(self, link: Link, f) -> None:
        """Reachability check for a peer with a proven link: dial the addresses of its signed
        advert (at the rate of learnt addresses) and say whether it answered as itself."""
        if link.role != "peer" or link.remote_id is None:
            raise Unauthenticated("dial_back: only a peer that proved its key may ask")
        if link.info.get("dialing_back"):
            raise RateLimited("dial_back: one at a time")
        advert = self.table.get(link.remote_id)
        link.info["dialing_back"] = True
        self._spawn(self._dial_back(link, advert.addrs if advert else (), f.get("id", int, None)), "dial back")

    async def _dial_back(self, link: Link, addrs: tuple[str, ...], rid: int | None) -> None:
        try:
            test = await first_success([self._dial_one(url, link.remote_id) for url in addrs],
                                       discard=lambda lk: lk.close())
        except PeerUnavailable as exc:
            link.post("dialed_back", re=rid, ok=False, reason=str(exc)[:500] if addrs else "it advertises no address")
        else:
            await test.close()
            link.post("dialed_back", re=rid, ok=True, addr=test.name)
        finally:
            link.info["dialing_back"] = False

    # ------------------------------------------------------------------ compute
    async def _conv_worker(self, conv: _Conv) -> None:
        while True:
            seq, start, x, want, trace, t_recv, replay, sampling, *rest = await conv.queue.get()
            self._queued_bytes -= x.nbytes if isinstance(x, torch.Tensor) else 0
            try:
                t0 = time.perf_counter()
                if isinstance(x, int):  # a replayed step this hop holds: resend what it sent then
                    if conv.next_id is not None:
                        nxt = await self._link_to(conv.next_id, conv.next_addrs, conv.next_relays)
                        await nxt.send("step", conv=conv.conv_id, seq=seq, start=start, want=want, replay=True,
                                       hidden=tensors.tensor_to_wire(conv.sent.slice(start, start + x)), trace=[])
                    continue
                rollback = bool(rest and rest[0])
                if conv.cache.length > start:  # rejected drafts of the previous step (speculation)
                    await self.executor.run(roll_back_to, conv, start)
                out = await self.scheduler.submit(conv, x, start, want, sampling)
                self.metrics.step(x.shape[1], time.perf_counter() - t0)
                hop = {"peer": self.peer_id, "compute_ms": round((time.perf_counter() - t0) * 1e3, 3),
                       "queue_ms": round((t0 - t_recv) * 1e3, 3)}
                if conv.next_id is None:
                    if want != "none":
                        await conv.owner.send("token", conv=conv.conv_id, seq=seq, trace=trace + [hop],
                                              length=conv.cache.length, **last_hop_reply(out, want))
                else:
                    nxt = await self._link_to(conv.next_id, conv.next_addrs, conv.next_relays)
                    await nxt.send("step", conv=conv.conv_id, seq=seq, start=start, want=want, replay=replay,
                                   hidden=tensors.tensor_to_wire(out), trace=trace + [hop],
                                   **({"sampling": sampling.to_wire()} if sampling else {}),
                                   **({"rollback": True} if rollback else {}))
            except MeshError as exc:
                await self._report(conv, seq, exc)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.exception("step %d of conversation %s failed", seq, conv.conv_id,
                              extra=context(conv=conv.conv_id, peer=self.peer_id, seq=seq))
                await self._report(conv, seq, MeshError(f"internal error on peer {self.peer_id[:12]}: {exc}"))
            finally:
                conv.queue.task_done()

    @staticmethod
    def _logits_mode(want: str) -> str:
        """Which logits a step needs from the last layer (``Shard.forward``'s ``logits``):
        every position for a speculative verification step (``want="tokens"``), else the last."""
        return "all" if want == "tokens" else "last"

    def _finish_step(self, conv: _Conv, start: int, tokens: int, want: str, out: torch.Tensor, sampling=None):
        """On the device thread: what a step yields from its forward output ``out``.

        ``out`` is ``(1, T, C)`` hidden states, or ``(1, 1, V)`` float32 logits on the last hop.
        Returns the chosen token (last hop: :func:`meshinfer.engine.sampling.pick_token` of the last
        position's logits, argmax without ``sampling``, else a draw seeded by (seed, position)),
        or the float32 hidden states to send, logged for replay. Called for a step run alone
        and for each step of a batched pass alike.

        Raises:
            InvalidInput: NaN or inf in ``out``; the step's positions are dropped from the cache.
        """
        if not bool(torch.isfinite(out).all()):
            conv.cache.truncate(start)
            raise InvalidInput(f"layers {conv.run.cli()} produced NaN or inf at positions "
                               f"{start}..{start + tokens - 1}")
        if conv.run.stop == self.cfg.num_hidden_layers:
            if want == "tokens":
                return out[0].argmax(-1).tolist()  # (T,) ids: speculative verification
            return [pick_token(out[0, -1], sampling, position=start + tokens)]
        out = out.float().cpu()  # the wire form (float32), copied off the device on its own thread
        if conv.sent is not None:
            conv.sent.append(start, out)
        return out

    async def _report(self, conv: _Conv, seq: int, exc: MeshError) -> None:
        conv.expected_start = conv.cache.length
        self.metrics.error(exc.code)
        log.warning("step %d of conversation %s failed: %s: %s", seq, conv.conv_id, exc.code, exc,
                    extra=context(conv=conv.conv_id, peer=self.peer_id, seq=seq))
        try:
            await conv.owner.send("error", conv=conv.conv_id, seq=seq, code=exc.code, message=str(exc))
        except MeshError:
            pass

    async def _drop_conv(self, conv_id: str) -> None:
        conv = self.convs.pop(conv_id, None)
        if conv is None:
            return
        self._reserved_tokens -= conv.reserved_tokens
        self.scheduler.forget(conv)
        if conv.task is not None and conv.task is not asyncio.current_task():
            conv.task.cancel()
            await asyncio.gather(conv.task, return_exceptions=True)
        while not conv.queue.empty():  # steps it will never run no longer count as queued
            x = conv.queue.get_nowait()[2]
            self._queued_bytes -= x.nbytes if isinstance(x, torch.Tensor) else 0
        await self.executor.run(conv.cache.free)
        if conv.sent is not None:
            conv.sent.free()

    # ------------------------------------------------------------------ background
    async def _janitor_loop(self) -> None:
        while True:
            await asyncio.sleep(min(5.0, self.settings.idle_timeout_s / 2, IDLE_LINK_TIMEOUT_S / 2))
            now = time.monotonic()
            self._close_idle_links(now)
            self._buckets = {h: b for h, b in self._buckets.items() if b[1].level < b[1].burst}  # drop idle hosts
            self._dial_failures = {p: f for p, f in self._dial_failures.items() if f[0] + MAX_DIAL_BACKOFF_S > now}
            for conv in list(self.convs.values()):
                if now - conv.last_active > self.settings.idle_timeout_s and conv.queue.empty():
                    log.info("conversation %s idle for %.0f s; freeing it", conv.conv_id, now - conv.last_active,
                             extra=context(conv=conv.conv_id, peer=self.peer_id))
                    await self._drop_conv(conv.conv_id)

    def _close_idle_links(self, now: float) -> None:
        """Close connections silent for :data:`IDLE_LINK_TIMEOUT_S` that hold no conversation and
        are not a peer that proved its key (peers gossip every few seconds)."""
        owners = {c.owner for c in self.convs.values()}
        for link in list(self._all_links):
            proven_peer = link.role == "peer" and link.remote_id is not None
            if link.role is None or proven_peer or link in owners or now - link.last_frame_at < IDLE_LINK_TIMEOUT_S:
                continue  # before hello: HELLO_TIMEOUT_S closes it
            log.info("closing %s: no frame for %.0f s and no conversation", link.name, now - link.last_frame_at)
            link.last_frame_at = now  # one close each
            self._spawn(link.close(1000, "idle"), "close idle")

    async def _gossip_loop(self) -> None:
        while True:
            try:
                await self._gossip_round()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("gossip round failed")
            await asyncio.sleep(self.settings.gossip_interval_s)

    async def _gossip_round(self) -> None:
        self._seq += 1
        targets = {ad.peer_id: ad.addrs for ad in self.table.adverts()}
        dialed = await asyncio.gather(*(self._bootstrap(url) for url in self.settings.bootstrap
                                        if not any(url in a for a in targets.values())),
                                      return_exceptions=True)
        del dialed
        payload = self._gossip_payload()
        for peer_id, addrs in {ad.peer_id: ad.addrs for ad in self.table.adverts()}.items():
            if peer_id not in self._gossiping:  # one exchange per peer: a silent one must not pile up tasks
                self._gossiping.add(peer_id)
                self._spawn(self._gossip_to(peer_id, addrs, payload), f"gossip {peer_id[:12]}")
        for gone in set(self.rtts_ms) - {a.peer_id for a in self.table.adverts()}:
            del self.rtts_ms[gone]

    def _gossip_payload(self) -> list[dict]:
        """This peer's advert, then known ones in random order, within :data:`GOSSIP_BUDGET_BYTES`."""
        others = self.table.adverts()
        random.shuffle(others)  # a table too large for one round still spreads over several
        payload, size = [], 0
        for ad in [self.advert()] + others:
            wire = ad.to_wire()
            n = protocol.wire_size(wire)
            if size + n <= GOSSIP_BUDGET_BYTES:
                payload.append(wire)
                size += n
        return payload

    async def _bootstrap(self, url: str) -> None:
        """Dial a bootstrap address (retried every gossip round until its peer is known).

        A failure is logged as a warning when its reason is new (a wrong scheme or a host that
        is down would otherwise leave a peer that looks ready but never joins), and at debug
        level while the same reason repeats; reaching it after a failure is logged too.
        """
        try:
            await self._dial_any((url,), expect_id=None)
        except PeerUnavailable as exc:
            reason = str(exc)
            if self._bootstrap_errors.get(url) != reason:
                log.warning("cannot join the mesh through %s yet (retrying every %g s): %s", url,
                            self.settings.gossip_interval_s, reason)
            else:
                log.debug("bootstrap %s: %s", url, reason)
            self._bootstrap_errors[url] = reason
        else:
            if self._bootstrap_errors.pop(url, None) is not None:
                log.info("reached bootstrap peer %s", url)

    async def _gossip_to(self, peer_id: str, addrs: tuple[str, ...], payload: list) -> None:
        try:
            if not addrs and peer_id not in self.links:
                return  # a peer nobody can dial gossips over the links it opens; no circuit for gossip
            link = await self._link_to(peer_id, addrs, ())
            t0 = time.perf_counter()
            await link.request("ping", timeout_s=self.settings.request_timeout_s)
            self.rtts_ms[peer_id] = round((time.perf_counter() - t0) * 1e3, 3)
            await link.send("gossip", adverts=payload)
        except MeshError as exc:
            log.debug("gossip to %s failed: %s", peer_id[:12], exc)
        finally:
            self._gossiping.discard(peer_id)


def roll_back_to(conv: _Conv, start: int) -> None:
    """Implicit rollback (speculative decoding): forget cached and logged positions ``>= start``.

    ``_on_step`` lets a step start below the hop's length only with ``rollback: true``; every
    other step starts at the cache length and this does nothing. Runs on the device thread,
    in step order, so it drops exactly the rejected drafts of the previous step.
    """
    if conv.cache.length > start:
        conv.cache.truncate(start)
        if conv.sent is not None:
            conv.sent.truncate(start)


def last_hop_reply(ids: list[int], want: str) -> dict:
    """The fields of the last hop's ``token`` reply for a step computed to argmax ``ids``.

    ``token`` is the last position's choice; with ``want="tokens"`` the reply also carries
    ``tokens``, the choice at every position of the step (speculative verification).
    """
    fields = {"token": ids[-1]}
    if want == "tokens":
        fields["tokens"] = ids
    return fields


def _not_newer(d: dict, known: dict[str, int]) -> bool:
    """Whether the raw advert ``d`` names a peer in ``known`` (peer id -> seq held) with a seq
    no larger than the one held."""
    held, seq = known.get(d.get("peer_id")), d.get("seq")
    return held is not None and type(seq) is int and seq <= held


def _url_host(host: str) -> str:
    """``host`` as it stands in a URL (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host else host


def _client_host(link: Link) -> str:
    """The IP address a client connection comes from (its limits are per host)."""
    addr = getattr(link.ws, "remote_address", None)
    return str(addr[0]) if addr else "?"


def new_conversation_id() -> str:
    """A random conversation id (UUID4 hex)."""
    return uuid.uuid4().hex


#: Share of the memory free at start-up that a peer's KV budget takes by default.
DEFAULT_KV_SHARE = 0.5


def free_memory_bytes(device: torch.device) -> int:
    """Device memory free now, bytes (CUDA: ``mem_get_info``; CPU and MPS: the system's
    available RAM, ``MemAvailable`` of /proc/meminfo, else ``sysconf``); 0 when unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        import os
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        except (AttributeError, ValueError, OSError):
            return 0


def default_kv_budget(device: torch.device) -> int:
    """Default KV budget, bytes: half the device memory free now (:func:`free_memory_bytes`),
    at least 64 MiB. A peer asks after its shard is loaded, so the weights (every expert of a
    mixture of experts) are already out of it."""
    return max(64 << 20, int(free_memory_bytes(device) * DEFAULT_KV_SHARE))


async def launch_peer(model: str, layers: LayerRange | None, *, device: str = "cpu", dtype: str = "f32",
                      settings: PeerSettings | None = None, key_path: str | None = None,
                      threads: int | None = None, warmup: bool = True, home: str | None = None,
                      tls_self_signed: bool = False) -> Peer:
    """Load a shard and start a peer serving it: what ``meshinfer join`` runs.

    Args:
        model: a path or a known model name (pulled if missing).
        layers: the half-open layer range, or None for every layer.
        device: ``cpu``, ``cuda``, ``cuda:N`` or ``mps``.
        dtype: a precision name (``meshinfer.core.config.PRECISION_NAMES``: ``f32``, ``bf16``, ``f16``,
            ``q8-bf16``, ``q4-gG-bf16``); also the advertised precision. Quantized precisions
            cache their converted tensors under ``<home>/converted``.
        settings: network and budget settings.
        key_path: Ed25519 key file (created on first start); None: an ephemeral key.
        threads: torch CPU threads for the device thread.
        tls_self_signed: serve ``wss://`` with a self-signed certificate kept next to the key
            file (``KEY.tls-cert.pem``, ``KEY.tls-key.pem``; made on first start), or in a
            temporary folder with an ephemeral key. Ignored when ``settings.tls_cert`` is set.

    Raises:
        ModelNotFound, WeightsError, LayerRangeError, DeviceError: bad arguments or files.
    """
    from meshinfer.wire.discovery import load_or_create_key
    from meshinfer.engine.executor import parse_device
    from meshinfer.engine.generate import load_shard, parse_dtype
    from meshinfer.text.tokenizer import Tokenizer
    from meshinfer.engine.weights import open_weights
    from meshinfer.engine.weights.identity import weights_hash
    from meshinfer.engine.weights.registry import meshinfer_home, resolve_model

    precision = parse_dtype(dtype)
    dev = parse_device(device)
    path = resolve_model(model, home=home)
    executor = DeviceExecutor(dev, threads=threads)
    try:
        src = await executor.run(open_weights, path)
        rng = layers or LayerRange(0, src.config.num_hidden_layers)
        rng.check_within(src.config.num_hidden_layers)
        t0 = time.perf_counter()
        shard = await executor.run(load_shard, src, rng, dtype=precision, device=str(dev),
                                   cache_dir=meshinfer_home(home) / "converted")
        log.info("loaded layers %s of %s in %.1f s", rng.cli(), path.name, time.perf_counter() - t0)
        bundle = None
        if rng.start == 0:  # the first hop serves the tokenizer to clients
            bundle = (await executor.run(Tokenizer.from_gguf, src)).to_bundle() if path.is_file() \
                else (await executor.run(Tokenizer.from_hf_dir, path)).to_bundle()
        digest = await executor.run(weights_hash, path)
        if key_path:
            key = load_or_create_key(key_path)
        else:
            from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
            key = Ed25519PrivateKey.generate()
        settings = settings or PeerSettings()
        if tls_self_signed and settings.tls_cert is None:
            import tempfile
            stem = key_path or str(Path(tempfile.mkdtemp(prefix="meshinfer-tls-")) / "peer")
            cert, tls_key = tls.self_signed(stem, peer_id_of(key))
            settings = replace(settings, tls_cert=str(cert), tls_key=str(tls_key))
        peer = Peer(shard, executor, key=key, weights_hash=digest, precision=dtype,
                    tokenizer_bundle=bundle, settings=settings)
        peer.owns_executor = True
        await peer.start(warmup=warmup)
        return peer
    except BaseException:
        executor.close()
        raise
