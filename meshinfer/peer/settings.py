"""How a peer runs: :class:`PeerSettings`, what ``meshinfer join``'s flags set."""

from __future__ import annotations

from dataclasses import dataclass, field

from meshinfer.peer.limits import ClientLimits
from meshinfer.peer.scheduler import DEFAULT_MAX_BATCH, DEFAULT_MAX_HOLD_S
from meshinfer.wire.discovery import DEFAULT_GOSSIP_INTERVAL_S, DEFAULT_TTL_S


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
    client_limits: ClientLimits = field(default_factory=ClientLimits)
    metrics_port: int | None = None
    metrics_host: str | None = None
    allow_ids: frozenset[str] | None = None
    max_batch: int = DEFAULT_MAX_BATCH
    max_hold_s: float = DEFAULT_MAX_HOLD_S
    listen: bool = True
    check_reachability: bool = True
