"""Route planner: choose a chain of peers that runs every decoder layer exactly once.

Pure code: no I/O, no asyncio, no logging. The input is a peer table
(:class:`~meshinfer.wire.protocol.PeerAdvert`), the client's measured round-trip times and
the RTTs peers advertise to each other. The output is a :class:`Route`: hops in data-path
order, each running a half-open sub-range of its peer's advertised layers, so that
together they run ``[0, L)`` exactly once.

Cost model, milliseconds per decoded token. It follows the data path: the client sends
token ids to hop 1, each hop sends hidden states to the next, and the last hop sends the
chosen token straight back to the client::

    RTT(client, hop 1)/2 + sum of RTT(hop i, hop i+1)/2 + RTT(hop n, client)/2
    + sum of compute_ms_per_token_i * k_i / n_i    (hop i runs k_i of its n_i layers)
    + HOP_OVERHEAD_MS * n                          (n hops)

Relayed peers. A peer nobody can dial (``join --listen none``, or a failed reachability
check) lists relays in its signed advert, and frames to it go through one of them. An RTT
measured over such a circuit (the client's pings, a peer's gossip pings) already includes the
relay's detour, so measured values are used as they are. When the link ``a -> b`` into a
relayed peer ``b`` (no address, relays listed) has no measurement, the planner does not assume
:data:`DEFAULT_UNKNOWN_RTT_MS`: it estimates the detour through the cheapest listed relay ``r``
it knows, ``RTT(a, r) + RTT(r, b) + RELAY_FORWARD_MS`` (each leg as reported, or the default).
A relayed hop therefore costs its relay's extra RTT, and a direct peer wins over a relayed one
of equal compute.

Search. Dijkstra over states ``(a, i)``: layers ``[0, a)`` are done, and peer ``i`` ran
layer ``a - 1``. The state has to hold the last peer because the next link's cost depends
on it. Each edge runs one layer. It either *continues* on peer ``i``, or *switches* to a
peer ``j`` that holds layer ``a``, paying the link ``i -> j``. This is the same as allowing
every hop ``(peer, a, b)`` with ``start <= a < b <= stop``, but it needs O(L * P^2) edges
instead of O(L^2 * P^2). Split points are not limited to the peers' range boundaries.
That limit would lose optima: a hop must run at least one layer, and a one-layer hop can
be the best choice. For example, if the only peer near the client is slow, the best route
may run layer 0 on it (a cheap client link) and layers 1..L-1 on a fast, distant peer.
Dijkstra on these states may enter one peer twice. When revisits are not allowed (the
default) and the best chain has one, a branch and bound over narrowed layer windows finds
the best chain without one (see ``_search_without_revisits``).

Rules:

* Every hop has the same ``compat_key``: weights hash, precision, protocol version, L and, for
  a precision other than f32, the device type (``protocol.numerics_backend``).
  Each key group is planned separately, and the cheapest complete route wins.
* Only ``"ready"`` peers are used. ``"joining"`` peers have nothing loaded yet. A
  ``"draining"`` peer is about to leave: a new session on it would be cut short and
  failover would replan anyway, so it is not kept as a last resort either.
* A peer is not used when it is in ``exclude`` (a failed hop), when it has fewer than
  ``min_free_kv_tokens`` free KV tokens, when it advertises layers beyond the model, or
  when its compute time is not a finite number >= 0.
* Unknown RTTs count as :data:`DEFAULT_UNKNOWN_RTT_MS`. The link RTT between peers ``a``
  and ``b`` is ``a.rtts_ms[b]`` or ``b.rtts_ms[a]``, or the mean of the two when both exist.
* By default a peer serves at most one hop, so that peers and sessions can key
  per-conversation state by peer. With ``allow_revisit=True``, a slow peer holding every
  layer may wrap a fast peer holding the middle ones, e.g. ``A[0-5] -> B[6-17] -> A[18-23]``.
* Ties are broken in this order, so that every client picks the same route: lower cost,
  then fewer hops, then, hop by hop from the first, more free KV tokens, a lower
  ``peer_id`` and an earlier start layer. The order is lexicographic and survives
  appending an edge, so Dijkstra finds the minimum under it. Costs are compared at a
  1e-9 ms resolution, so that float rounding does not break ties.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, replace

from meshinfer.core.config import PRECISION_NAMES, LayerRange
from meshinfer.core.errors import NoRoute
from meshinfer.wire.protocol import PORTABLE_PRECISIONS, READY, PeerAdvert

#: ``(weights_hash, precision, protocol_version, num_layers, backend)``, see ``PeerAdvert.compat_key``.
CompatKey = tuple[str, str, int, int, str]

#: RTT assumed for a link nobody has measured, in milliseconds. 100 ms is a conservative
#: round trip between distant sites on the public Internet (same-continent paths take
#: 20-60 ms). It is high enough that a measured nearby peer wins, and low enough that an
#: unmeasured peer is still used when nothing else covers its layers.
DEFAULT_UNKNOWN_RTT_MS = 100.0

#: Fixed cost of one hop, in milliseconds, beyond its link and its compute. It covers
#: encoding and decoding a step message, a websocket frame and an event-loop wakeup on
#: each side, about 1 ms on a CPU peer. It also stops the planner from adding a hop to
#: save a fraction of a millisecond: every extra hop is one more peer that can fail
#: mid-conversation and one more KV cache to replay.
HOP_OVERHEAD_MS = 1.0

#: Extra time a relay adds to a frame beyond the RTTs of its two legs, in milliseconds: it
#: decodes the envelope and queues the frame on a second connection, one more event-loop
#: wakeup on the relay's CPU, like :data:`HOP_OVERHEAD_MS`.
RELAY_FORWARD_MS = 1.0

#: Hex digits of the weights hash shown in messages. 12 digits (48 bits) tell any
#: realistic set of models apart and still fit on one line.
HASH_PREFIX_CHARS = 12

#: Hex digits of a peer id shown in messages and :meth:`Route.describe`.
PEER_ID_PREFIX_CHARS = 12

#: Most relaxed searches that planning without revisits may run before it settles for the
#: best chain without revisits found so far. Real tables need a few: at most 16 over 30
#: random meshes of 10-30 peers and 24-80 layers, about 10 ms each. The cap bounds what a
#: crafted peer table can cost a client, to about 2 s.
MAX_REVISIT_BRANCHES = 200

#: Decimal digits of milliseconds at which costs are compared. The search adds costs one
#: layer at a time, so two routes that cost the same on paper can differ in the last bits
#: of a float. Comparing at 1e-9 ms makes them tie, and the documented tie-break decides
#: between them. 1e-9 ms is far below any difference that matters.
_COST_DIGITS = 9


@dataclass(frozen=True)
class Hop:
    """One link of a route: ``peer`` runs ``layers``, a sub-range of ``peer.layers``."""

    peer: PeerAdvert
    layers: LayerRange

    @property
    def peer_id(self) -> str:
        return self.peer.peer_id

    @property
    def compute_ms(self) -> float:
        """The peer's advertised per-token compute, scaled to this hop's share of its layers, ms."""
        return self.peer.compute_ms_per_token * len(self.layers) / len(self.peer.layers)


@dataclass(frozen=True)
class Route:
    """A chain of hops that runs layers ``[0, num_layers)`` exactly once, in order.

    Attributes:
        hops: the hops in data-path order. The first starts at layer 0 on a peer that holds
            the embedding; the last ends at ``num_layers`` on a peer that holds the output head.
        estimated_ms_per_token: the planner's cost (see the module docstring), milliseconds.
        compat_key: ``(weights_hash, precision, protocol_version, num_layers, backend)`` of every hop.
    """

    hops: tuple[Hop, ...]
    estimated_ms_per_token: float
    compat_key: CompatKey

    @property
    def num_layers(self) -> int:
        return self.compat_key[3]

    @property
    def peer_ids(self) -> tuple[str, ...]:
        return tuple(hop.peer_id for hop in self.hops)

    def describe(self) -> str:
        """One line for the CLI, e.g. ``"1f2e3d4c5b6a[0-11] -> 99aa...[12-23] (~41.5 ms/token)"``."""
        chain = " -> ".join(f"{h.peer_id[:PEER_ID_PREFIX_CHARS]}[{h.layers.cli()}]" for h in self.hops)
        return f"{chain} (~{self.estimated_ms_per_token:.1f} ms/token)"


@dataclass(frozen=True)
class GroupStatus:
    """Whether one compat-key group of the peer table can serve a whole model.

    Attributes:
        compat_key: the group's ``(weights_hash, precision, protocol_version, num_layers, backend)``.
        identity: the same key for people, e.g. ``"weights 1d9614638d18 f32"``.
        num_peers: adverts in the group, any state.
        num_usable: peers the planner may use (ready, not excluded, enough free KV).
        route: the best complete route, or None.
        missing: layer ranges no usable peer holds; empty when ``route`` is set.
    """

    compat_key: CompatKey
    identity: str
    num_peers: int
    num_usable: int
    route: Route | None
    missing: tuple[LayerRange, ...]


def plan_route(
    peers: Iterable[PeerAdvert],
    *,
    client_rtts_ms: Mapping[str, float],
    num_layers: int | None = None,
    compat_key: CompatKey | None = None,
    exclude: Set[str] = frozenset(),
    min_free_kv_tokens: int = 0,
    allow_revisit: bool = False,
    checkable: bool = False,
    trusted: Set[str] = frozenset(),
) -> Route:
    """Return the lowest-latency chain of compatible ready peers covering ``[0, L)``.

    Args:
        peers: the peer table. When a ``peer_id`` appears twice, the larger ``seq`` wins.
        client_rtts_ms: the client's RTT to each peer, milliseconds. Missing peers count
            as :data:`DEFAULT_UNKNOWN_RTT_MS`.
        num_layers: L when known. Groups with a different L are ignored.
        compat_key: plan only within this group (e.g. the one a session started on).
        exclude: peer ids never to use (hops that failed, for failover).
        min_free_kv_tokens: skip peers whose ``free_kv_tokens`` is below this; 0 skips none.
        allow_revisit: let one peer serve two non-adjacent hops (see the module docstring).
        checkable: prefer a route whose every hop can be spot-checked: each hop runs layers
            that another usable peer of the group also serves whole (:func:`_checkable_windows`),
            unless its peer is in ``trusted``. The fastest such route wins over any faster
            route with a hop nobody can check; when no such route exists, the preference is
            dropped (see docs/security.md).
        trusted: peer ids whose hops need no check (``--allow-keys``).

    Raises:
        NoRoute: no group's usable peers cover every layer. The message names the missing
            layers of the best group and, when several identities exist, what each serves.
        ValueError: ``min_free_kv_tokens < 0``, ``num_layers < 1``, or ``num_layers``
            disagrees with ``compat_key``.
    """
    _check_args(num_layers, compat_key, min_free_kv_tokens)
    peers = list(peers)
    table = _newest(peers)
    groups = _groups(peers, num_layers, compat_key)
    if not groups:
        raise NoRoute(_empty_table_message(num_layers, compat_key))
    statuses = [
        _plan_group(key, members, client_rtts_ms, exclude, min_free_kv_tokens, allow_revisit, groups,
                    trusted=trusted if checkable else None, table=table)
        for key, members in groups.items()
    ]
    routes = [s.route for s in statuses if s.route is not None]
    if routes:
        return min(routes, key=_route_order)
    raise NoRoute(_no_route_message(statuses, groups, exclude, min_free_kv_tokens))


def complete_routes_summary(
    peers: Iterable[PeerAdvert],
    *,
    client_rtts_ms: Mapping[str, float] | None = None,
    exclude: Set[str] = frozenset(),
    min_free_kv_tokens: int = 0,
    allow_revisit: bool = False,
) -> list[GroupStatus]:
    """Per compat-key group: can a complete chain be built, and which is the best one?

    For ``meshinfer status``. Groups that have a route come first, cheapest first. The
    rest follow, the group missing the fewest layers first. Without ``client_rtts_ms``,
    every client RTT counts as :data:`DEFAULT_UNKNOWN_RTT_MS`.

    Raises:
        ValueError: ``min_free_kv_tokens < 0``.
    """
    _check_args(None, None, min_free_kv_tokens)
    peers = list(peers)
    groups = _groups(peers, None, None)
    rtts = client_rtts_ms or {}
    statuses = [
        _plan_group(key, members, rtts, exclude, min_free_kv_tokens, allow_revisit, groups, table=_newest(peers))
        for key, members in groups.items()
    ]

    def order(s: GroupStatus) -> tuple:
        if s.route is not None:
            return (0, _route_order(s.route))
        return (1, sum(len(r) for r in s.missing), s.compat_key)

    return sorted(statuses, key=order)


def estimate_ms_per_token(hops: Sequence[Hop], *, client_rtts_ms: Mapping[str, float],
                          table: Mapping[str, PeerAdvert] | None = None) -> float:
    """Cost of a given chain of hops under the module's model, milliseconds per token.
    ``table`` (peer id -> advert) holds the relays of relayed hops (see :func:`hop_rtt_ms`).

    Raises:
        ValueError: ``hops`` is empty.
    """
    if not hops:
        raise ValueError("a route needs at least one hop")
    total = client_rtt_ms(hops[0].peer, client_rtts_ms) / 2 + client_rtt_ms(hops[-1].peer, client_rtts_ms) / 2
    for prev, nxt in zip(hops, hops[1:]):
        total += hop_rtt_ms(prev.peer, nxt.peer, table or {}) / 2
    return total + sum(hop.compute_ms for hop in hops) + HOP_OVERHEAD_MS * len(hops)


def client_rtt_ms(peer: PeerAdvert, client_rtts_ms: Mapping[str, float]) -> float:
    """The client's RTT to ``peer``, ms. If it is unknown or invalid, :data:`DEFAULT_UNKNOWN_RTT_MS`."""
    rtt = client_rtts_ms.get(peer.peer_id)
    return rtt if _valid_ms(rtt) else DEFAULT_UNKNOWN_RTT_MS


def link_rtt_ms(a: PeerAdvert, b: PeerAdvert) -> float:
    """RTT between two peers, ms: the mean of the valid values each side reports for the other.

    If neither side reports a valid value, :data:`DEFAULT_UNKNOWN_RTT_MS`.
    """
    seen = [r for r in (a.rtts_ms.get(b.peer_id), b.rtts_ms.get(a.peer_id)) if _valid_ms(r)]
    return sum(seen) / len(seen) if seen else DEFAULT_UNKNOWN_RTT_MS


def is_relayed(peer: PeerAdvert) -> bool:
    """Whether frames reach ``peer`` only through its relays (no address, relays listed)."""
    return bool(peer.relays) and not peer.addrs


def hop_rtt_ms(a: PeerAdvert, b: PeerAdvert, table: Mapping[str, PeerAdvert]) -> float:
    """RTT of the link from hop ``a`` to hop ``b``, ms: :func:`link_rtt_ms` when either side
    measured it (through a relay or not); for a relayed ``b`` with no measurement, the detour
    through its cheapest relay in ``table``: ``RTT(a, r) + RTT(r, b) + RELAY_FORWARD_MS``."""
    if not is_relayed(b) or any(_valid_ms(r) for r in (a.rtts_ms.get(b.peer_id), b.rtts_ms.get(a.peer_id))):
        return link_rtt_ms(a, b)
    detours = [link_rtt_ms(a, table[r]) + link_rtt_ms(table[r], b) + RELAY_FORWARD_MS
               for r in b.relays if r in table and r != a.peer_id]
    if a.peer_id in b.relays:  # a is b's relay: b's own link to it
        detours.append(link_rtt_ms(a, b))
    return min(detours, default=DEFAULT_UNKNOWN_RTT_MS)


def compat_label(key: CompatKey, others: Iterable[CompatKey] = ()) -> str:
    """Name a compat key for people: ``"weights 1d9614638d18 f32"``, ``"weights 1d9614638d18
    q8-bf16 on cuda"`` (the device type only for a precision tied to one, see
    :func:`~meshinfer.wire.protocol.numerics_backend`).

    The protocol version and the layer count are added only when ``others`` differ in them.
    """
    weights_hash, precision, protocol, num_layers, backend = key
    text = f"weights {weights_hash[:HASH_PREFIX_CHARS]} {precision}"
    if backend != "any":
        text += f" on {backend}"
    others = list(others)
    if any(k[2] != protocol for k in others):
        text += f" protocol {protocol}"
    if any(k[3] != num_layers for k in others):
        text += f" ({num_layers} layers)"
    return text


# ---------------------------------------------------------------------------- peer table


def _valid_ms(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value >= 0


def _check_args(num_layers: int | None, compat_key: CompatKey | None, min_free_kv_tokens: int) -> None:
    if min_free_kv_tokens < 0:
        raise ValueError(f"min_free_kv_tokens must be >= 0, got {min_free_kv_tokens}")
    if num_layers is not None and num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if num_layers is not None and compat_key is not None and compat_key[3] != num_layers:
        raise ValueError(f"num_layers {num_layers} disagrees with compat_key, which says {compat_key[3]} layers")


def _newest(peers: Iterable[PeerAdvert]) -> dict[str, PeerAdvert]:
    """The newest advert (largest ``seq``) per peer id."""
    newest: dict[str, PeerAdvert] = {}
    for p in peers:
        if p.num_layers < 1:
            continue  # malformed; the protocol layer rejects such adverts
        if p.peer_id not in newest or p.seq > newest[p.peer_id].seq:
            newest[p.peer_id] = p
    return newest


def _groups(
    peers: Iterable[PeerAdvert], num_layers: int | None, compat_key: CompatKey | None
) -> dict[CompatKey, list[PeerAdvert]]:
    """Keep the newest advert per peer id and group them by compat key, each sorted by peer id."""
    newest = _newest(peers)
    groups: dict[CompatKey, list[PeerAdvert]] = {}
    for p in sorted(newest.values(), key=lambda p: p.peer_id):
        key = p.compat_key
        if (compat_key is None or key == compat_key) and (num_layers is None or key[3] == num_layers):
            groups.setdefault(key, []).append(p)
    return dict(sorted(groups.items()))


def _unusable_reason(p: PeerAdvert, exclude: Set[str], min_free_kv_tokens: int) -> str | None:
    """Why the planner skips ``p`` (a phrase after "peer X"), or None when it may use it."""
    if p.peer_id in exclude:
        return "is excluded"
    if p.state != READY:
        return f"is {p.state}"
    if p.layers.stop > p.num_layers:
        return f"advertises layers {p.layers.cli()} of a {p.num_layers}-layer model"
    if not _valid_ms(p.compute_ms_per_token):
        return f"advertises an invalid compute time {p.compute_ms_per_token!r} ms"
    if min_free_kv_tokens and p.free_kv_tokens < min_free_kv_tokens:
        return f"has {p.free_kv_tokens} free KV tokens, {min_free_kv_tokens} needed"
    return None


def _missing_layers(usable: Sequence[PeerAdvert], num_layers: int) -> tuple[LayerRange, ...]:
    """Maximal runs of layers in ``[0, num_layers)`` that no peer in ``usable`` holds."""
    covered = [False] * num_layers
    for p in usable:
        for layer in range(p.layers.start, min(p.layers.stop, num_layers)):
            covered[layer] = True
    runs, start = [], None
    for layer, ok in enumerate(covered + [True]):
        if not ok and start is None:
            start = layer
        elif ok and start is not None:
            runs.append(LayerRange(start, layer))
            start = None
    return tuple(runs)


def _plan_group(
    key: CompatKey,
    members: Sequence[PeerAdvert],
    client_rtts_ms: Mapping[str, float],
    exclude: Set[str],
    min_free_kv_tokens: int,
    allow_revisit: bool,
    groups: Mapping[CompatKey, object],
    *,
    trusted: Set[str] | None = None,
    table: Mapping[str, PeerAdvert] | None = None,
) -> GroupStatus:
    """Plan within one compat-key group. ``members`` are sorted by peer id. With ``trusted``
    (not None), plan over checkable windows first (see :func:`plan_route`)."""
    usable = [p for p in members if _unusable_reason(p, exclude, min_free_kv_tokens) is None]
    missing = _missing_layers(usable, key[3])
    route = None
    if not missing:
        graph = _build_graph(usable, key[3], client_rtts_ms, table or {})
        windows = tuple((p.layers,) for p in usable)
        found = None
        if trusted is not None:
            checkable = _checkable_windows(usable, trusted)
            found = _search(graph.with_windows(checkable))
            if found is not None:
                graph, windows = graph.with_windows(checkable), checkable
        if found is None:
            found = _search(graph)
        assert found is not None, "every layer is covered, so a chain exists"
        seq = found[1] if allow_revisit else _search_without_revisits(graph, found, windows)
        route = _to_route(graph, seq, key, client_rtts_ms, table or {})
    return GroupStatus(key, compat_label(key, groups), len(members), len(usable), route, missing)


def _checkable_windows(usable: Sequence[PeerAdvert], trusted: Set[str]) -> _Windows:
    """Per peer, the widest windows of its layers that another usable peer serves whole (the
    overlaps of its range with each other peer's, none inside another), so that a hop within
    one can be spot-checked there; a trusted peer keeps its whole range."""
    out = []
    for p in usable:
        if p.peer_id in trusted:
            out.append((p.layers,))
            continue
        overlaps = {LayerRange(max(p.layers.start, q.layers.start), min(p.layers.stop, q.layers.stop))
                    for q in usable if q.peer_id != p.peer_id
                    and max(p.layers.start, q.layers.start) < min(p.layers.stop, q.layers.stop)}
        widest = [w for w in overlaps if not any(o != w and o.start <= w.start and w.stop <= o.stop
                                                  for o in overlaps)]
        out.append(tuple(sorted(widest, key=lambda w: (w.start, w.stop))))
    return tuple(out)


def _route_order(route: Route) -> tuple:
    """The documented tie-break order, applied across groups."""
    per_hop = tuple((-h.peer.free_kv_tokens, h.peer_id, h.layers.start) for h in route.hops)
    return (round(route.estimated_ms_per_token, _COST_DIGITS), len(route.hops), per_hop, route.compat_key)


# ---------------------------------------------------------------------------- search

# A hop as the search records it: (-free_kv_tokens, peer_id, start layer, peer index).
# Tuples of these compare in the documented tie-break order.
_HopKey = tuple[int, str, int, int]

# A complete chain as the search returns it: (cost_ms, hop keys).
_Found = tuple[float, tuple[_HopKey, ...]]

# For each peer index, the windows of layers the search may run on it.
_Windows = tuple[tuple[LayerRange, ...], ...]


@dataclass(frozen=True)
class _Graph:
    """One group's usable peers (sorted by peer id) and the costs between them.

    The search runs over *nodes*: a node is a peer limited to one window of its layers. At
    first each peer is one node whose window is its advertised range. The search without
    revisits narrows the windows (see :func:`_search_without_revisits`).
    """

    peers: tuple[PeerAdvert, ...]
    num_layers: int
    client_half_ms: tuple[float, ...]              # client <-> peer p, one way
    layer_ms: tuple[float, ...]                    # one layer's compute on peer p
    link_half_ms: tuple[tuple[float, ...], ...]    # peer p -> peer q, one way
    node_peer: tuple[int, ...] = ()                # node -> peer index
    node_layers: tuple[LayerRange, ...] = ()       # node -> the layers it may run
    cover: tuple[tuple[int, ...], ...] = ()        # cover[a]: nodes that may run layer a

    def with_windows(self, windows: _Windows) -> _Graph:
        """The same peers and costs, with one node per window."""
        nodes = [(p, w) for p, ws in enumerate(windows) for w in ws]
        cover = tuple(tuple(k for k, (_, w) in enumerate(nodes) if a in w) for a in range(self.num_layers))
        return replace(self, node_peer=tuple(p for p, _ in nodes), node_layers=tuple(w for _, w in nodes),
                       cover=cover)


def _build_graph(peers: Sequence[PeerAdvert], num_layers: int, client_rtts_ms: Mapping[str, float],
                 table: Mapping[str, PeerAdvert]) -> _Graph:
    n = len(peers)
    graph = _Graph(
        peers=tuple(peers),
        num_layers=num_layers,
        client_half_ms=tuple(client_rtt_ms(p, client_rtts_ms) / 2 for p in peers),
        layer_ms=tuple(p.compute_ms_per_token / len(p.layers) for p in peers),
        link_half_ms=tuple(tuple(hop_rtt_ms(peers[i], peers[j], table) / 2 for j in range(n)) for i in range(n)),
    )
    return graph.with_windows(tuple((p.layers,) for p in peers))


def _search(g: _Graph) -> _Found | None:
    """Dijkstra from "no layer run" to "all layers run and the token back at the client".

    A state is ``(a, k)``: layers ``[0, a)`` are done and node ``k`` ran layer ``a - 1``;
    ``a == L + 1`` (with ``k == -1``) is the goal. A label is ``(cost_ms, hops, hop keys)``.
    A peer may serve several hops here. Returns the goal's cost and hop keys, or None when
    the nodes leave a layer uncovered.
    """
    L = g.num_layers
    heap: list[tuple] = []
    best: dict[tuple[int, int], tuple] = {}

    def push(cost: float, hops: int, seq: tuple[_HopKey, ...], a: int, k: int) -> None:
        # Compare rounded costs but carry the exact sum, so that rounding does not add up.
        label = (round(cost, _COST_DIGITS), hops, seq)
        if (a, k) not in best or label < best[(a, k)]:
            best[(a, k)] = label
            heapq.heappush(heap, (*label, a, k, cost))

    for k in g.cover[0]:
        p = g.node_peer[k]
        push(g.client_half_ms[p] + HOP_OVERHEAD_MS + g.layer_ms[p], 1, (_hop_key(g, k, 0),), 1, k)
    while heap:
        rounded, hops, seq, a, k, cost = heapq.heappop(heap)
        if best[(a, k)] != (rounded, hops, seq):
            continue  # a better label reached this state after this one was pushed
        if a > L:
            return cost, seq
        p = g.node_peer[k]
        if a == L:
            push(cost + g.client_half_ms[p], hops, seq, L + 1, -1)
            continue
        if a < g.node_layers[k].stop:  # continue on node k
            push(cost + g.layer_ms[p], hops, seq, a + 1, k)
        for m in g.cover[a]:  # switch to node m, which runs layer a
            q = g.node_peer[m]
            if q != p:
                push(cost + g.link_half_ms[p][q] + HOP_OVERHEAD_MS + g.layer_ms[q], hops + 1,
                     seq + (_hop_key(g, m, a),), a + 1, m)
    return None


def _hop_key(g: _Graph, node: int, start: int) -> _HopKey:
    p = g.node_peer[node]
    return (-g.peers[p].free_kv_tokens, g.peers[p].peer_id, start, p)


def _search_without_revisits(g: _Graph, relaxed: _Found, windows: _Windows) -> tuple[_HopKey, ...]:
    """The best chain in which no peer serves two hops, by best-first branch and bound.

    ``relaxed`` is :func:`_search`'s answer on ``g``, whose nodes are ``windows``. Each node of the tree narrows the
    peers' windows, and its relaxed optimum bounds from below every chain without
    revisits inside it. When a node's optimum re-enters peer p (it leaves p at layer b1
    and enters it again at layer a2), every chain without revisits falls in one of three
    children: p runs no layer >= a2, p runs no layer < b1, or p runs layers b1 - 1
    through a2 and no other peer runs any of them. None of the children holds the node's
    optimum, so the tree is finite. The first node whose optimum has no revisit is the
    answer. In practice the tree has a few nodes, because revisits pay only when a slow peer
    wraps a much faster one. After :data:`MAX_REVISIT_BRANCHES` searches, the best chain
    without revisits seen so far is taken, or else :func:`_greedy_chain`.
    """
    order = itertools.count()
    tree = [(_label(relaxed), next(order), windows, relaxed)]
    searches = 0
    while tree and searches < MAX_REVISIT_BRANCHES:
        _, _, windows, found = heapq.heappop(tree)
        revisit = _first_revisit(found[1], g.num_layers)
        if revisit is None:
            return found[1]
        for child in _branches(windows, *revisit, g.num_layers):
            searches += 1
            child_found = _search(g.with_windows(child))
            if child_found is not None:
                heapq.heappush(tree, (_label(child_found), next(order), child, child_found))
    done = [item for item in tree if _first_revisit(item[3][1], g.num_layers) is None]
    return min(done)[3][1] if done else _greedy_chain(g)


def _greedy_chain(g: _Graph) -> tuple[_HopKey, ...]:
    """A chain without revisits, not always the cheapest: at each layer still to run, take the
    peer that holds it and reaches furthest, the fastest per layer among equals. No peer
    can come back, because the next layer is beyond the stop of every peer used so far."""
    seq, a = [], 0
    while a < g.num_layers:
        k = max(g.cover[a], key=lambda k: (g.node_layers[k].stop, -g.layer_ms[g.node_peer[k]], -k))
        seq.append(_hop_key(g, k, a))
        a = g.node_layers[k].stop
    return tuple(seq)


def _label(found: _Found) -> tuple:
    return (round(found[0], _COST_DIGITS), len(found[1]), found[1])


def _first_revisit(seq: tuple[_HopKey, ...], num_layers: int) -> tuple[int, int, int] | None:
    """``(peer index, layer where its first hop ends, layer where its second hop starts)``."""
    first_end: dict[int, int] = {}
    for k, (_, _, start, p) in enumerate(seq):
        if p in first_end:
            return p, first_end[p], start
        first_end[p] = seq[k + 1][2] if k + 1 < len(seq) else num_layers
    return None


def _branches(windows: _Windows, p: int, b1: int, a2: int, num_layers: int) -> list[_Windows]:
    """The three children of :func:`_search_without_revisits` for peer ``p``."""

    def clip(ws: tuple[LayerRange, ...], lo: int, hi: int) -> tuple[LayerRange, ...]:
        return tuple(LayerRange(max(w.start, lo), min(w.stop, hi)) for w in ws if max(w.start, lo) < min(w.stop, hi))

    def without(ws: tuple[LayerRange, ...], lo: int, hi: int) -> tuple[LayerRange, ...]:
        return clip(ws, 0, lo) + clip(ws, hi, num_layers)

    below = windows[:p] + (clip(windows[p], 0, a2),) + windows[p + 1:]
    above = windows[:p] + (clip(windows[p], b1, num_layers),) + windows[p + 1:]
    through = tuple(ws if q == p else without(ws, b1 - 1, a2 + 1) for q, ws in enumerate(windows))
    return [below, above, through]


def _to_route(g: _Graph, seq: tuple[_HopKey, ...], key: CompatKey, client_rtts_ms: Mapping[str, float],
              table: Mapping[str, PeerAdvert]) -> Route:
    """Build the route. Its cost is recomputed hop by hop, so it does not carry per-layer rounding."""
    starts = [h[2] for h in seq] + [g.num_layers]
    hops = tuple(Hop(g.peers[h[3]], LayerRange(starts[k], starts[k + 1])) for k, h in enumerate(seq))
    return Route(hops, estimate_ms_per_token(hops, client_rtts_ms=client_rtts_ms, table=table), key)


# ---------------------------------------------------------------------------- messages


def _layers_text(ranges: Sequence[LayerRange]) -> str:
    """``"layer 5"``, ``"layers 12-17"``, ``"layers 0-3 and 8-11"``, ``"layers 1, 3-4 and 9"``."""
    parts = [r.cli() if len(r) > 1 else str(r.start) for r in ranges]
    joined = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return ("layer " if _is_one_layer(ranges) else "layers ") + joined


def _is_one_layer(ranges: Sequence[LayerRange]) -> bool:
    return len(ranges) == 1 and len(ranges[0]) == 1


def _gap_text(missing: Sequence[LayerRange]) -> str:
    return f"{_layers_text(missing)} {'has' if _is_one_layer(missing) else 'have'} no ready peer"


def _reasons_text(members: Sequence[PeerAdvert], missing: Sequence[LayerRange],
                  exclude: Set[str], min_free_kv_tokens: int) -> str:
    """``" (peer ab12 is draining; peer cd34 is excluded)"``: why the peers holding the gap are skipped."""
    reasons = []
    for p in members:
        if any(p.layers.start < r.stop and r.start < p.layers.stop for r in missing):
            why = _unusable_reason(p, exclude, min_free_kv_tokens)
            reasons.append(f"peer {p.peer_id[:PEER_ID_PREFIX_CHARS]} {why}")
    return f" ({'; '.join(reasons)})" if reasons else ""


def _no_route_message(statuses: Sequence[GroupStatus], groups: Mapping[CompatKey, Sequence[PeerAdvert]],
                      exclude: Set[str], min_free_kv_tokens: int) -> str:
    """Name the best group's missing layers and, with several identities, what each one serves."""
    best = min(statuses, key=lambda s: (sum(len(r) for r in s.missing), s.compat_key))
    gap = _gap_text(best.missing) + _reasons_text(groups[best.compat_key], best.missing, exclude,
                                                  min_free_kv_tokens)
    if len(statuses) == 1:
        return f"no route: {gap}"
    served = []
    for s in statuses:
        usable = [p for p in groups[s.compat_key] if _unusable_reason(p, exclude, min_free_kv_tokens) is None]
        held = _held_ranges(usable, s.compat_key[3])
        if held:
            served.append((held, s.identity))
    if not served:
        return f"no route: no ready peer in any of {len(statuses)} model identities; with {best.identity}, {gap}"
    served.sort(key=lambda item: (item[0][0].start, item[1]))
    (first, first_ident), rest = served[0], served[1:]
    parts = [f"{_layers_text(first)} {'is' if _is_one_layer(first) else 'are'} served by {first_ident}"]
    parts += [f"{_layers_text(held)} by {ident}" for held, ident in rest]
    listing = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return (f"no compatible chain: {listing}; with {best.identity}, {gap}{_backend_note(statuses)}"
            f"{precision_note(statuses)}")


def precision_note(statuses: Sequence[GroupStatus]) -> str:
    """What to do when peers of one model differ in precision: `` (peers of different
    precisions, ... never chain: ...)``, or "" when none do. Used by the no-route error and
    ``meshinfer status``."""
    by_model: dict[tuple, set[str]] = {}
    for s in statuses:
        weights_hash, precision, protocol, num_layers, _ = s.compat_key
        by_model.setdefault((weights_hash, protocol, num_layers), set()).add(precision)
    known = [sorted(ps & set(PRECISION_NAMES)) for ps in by_model.values()]  # an advert's string is not printed
    mixed = sorted({p for ps in known if len(ps) > 1 for p in ps})
    if not mixed:
        return ""
    return (f" (peers of different precisions, {', '.join(mixed)}, never chain: start the peers of one route "
            f"with the same --dtype, or add peers so that one precision covers every layer)")


def _backend_note(statuses: Sequence[GroupStatus]) -> str:
    """Why groups that differ only in their device type do not chain ("" when none do)."""
    split = {}
    for s in statuses:
        weights_hash, precision, protocol, num_layers, backend = s.compat_key
        if backend != "any":
            split.setdefault((weights_hash, precision, protocol, num_layers), set()).add(backend)
    notes = [f"{key[1]} peers on {' and '.join(sorted(backends))} do not chain: only "
             f"{'/'.join(sorted(PORTABLE_PRECISIONS))} gives the same tokens on every device type"
             for key, backends in split.items() if len(backends) > 1]
    return "".join(f" ({n})" for n in notes)


def _held_ranges(usable: Sequence[PeerAdvert], num_layers: int) -> tuple[LayerRange, ...]:
    """Maximal runs of layers that some peer in ``usable`` holds (the complement of the gaps)."""
    edges = [0] + [x for r in _missing_layers(usable, num_layers) for x in (r.start, r.stop)] + [num_layers]
    return tuple(LayerRange(a, b) for a, b in zip(edges[::2], edges[1::2]) if b > a)


def _empty_table_message(num_layers: int | None, compat_key: CompatKey | None) -> str:
    if compat_key is not None:
        protocol, num_layers = compat_key[2], compat_key[3]
        return f"no route: no peer advertises {compat_label(compat_key)} (protocol {protocol}, {num_layers} layers)"
    if num_layers is not None:
        return f"no route: no peer advertises a {num_layers}-layer model"
    return "no route: the peer table is empty"
