"""The live picture of a mesh behind ``GET /v1/mesh`` and the page's mesh view.

:class:`MeshView` refreshes the client's peer table and RTTs (at most once per
:data:`MESH_REFRESH_S`, shared by every caller), remembers peers that left (state ``gone``)
for :data:`GONE_FORGET_S`, and builds one JSON-able snapshot: the peers, a layer-coverage
strip per model identity (weights, precision, layer count), the route each group would take,
the route and timings of the last reply, recent failovers and lying-peer detections, and the
one problem a person should act on (no complete route, a private mesh without its key,
every peer gone). Everything in it that a peer advertised is attacker-controlled text: the
page escapes it.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any, Callable, Iterable, Sequence

from meshinfer.core.config import LayerRange
from meshinfer.client.coverage import coverage
from meshinfer.core.errors import MeshError, Unauthenticated
from meshinfer.wire.protocol import PeerAdvert
from meshinfer.client.routing import GroupStatus, compat_label, complete_routes_summary
from meshinfer.client.mesh import MeshClient
from meshinfer.client.results import ChatResult

#: Seconds a refreshed peer table and RTTs are reused: a page polls every 2 s, so several open
#: pages cost one refresh per interval.
MESH_REFRESH_S = 2.0
#: Seconds a peer that left the table is still listed (state ``gone``).
GONE_FORGET_S = 600.0
#: Peers that left which are remembered at most (the oldest are forgotten first).
MAX_GONE_PEERS = 256
#: Failovers and detections kept for the page, newest last.
MAX_EVENTS = 32


def gaps(counts: Sequence[int]) -> list[LayerRange]:
    """The runs of layers no peer serves (``counts[i] == 0``), as half-open ranges, in order."""
    out, start = [], None
    for i, c in enumerate(list(counts) + [1]):
        if c == 0 and start is None:
            start = i
        elif c != 0 and start is not None:
            out.append(LayerRange(start, i))
            start = None
    return out


def group_json(g: GroupStatus, peers: Iterable[PeerAdvert], *, model: str | None = None) -> dict:
    """One model identity for ``status --json`` and ``GET /v1/mesh``: coverage (ready peers per
    layer among ``peers``), the best route (or None), its estimated ms/token, and the missing
    layers (inclusive ``"a-b"`` strings)."""
    counts = coverage([p for p in peers if p.compat_key == g.compat_key], g.compat_key[3])
    missing = [r.cli() for r in g.missing] if g.route is None else []
    if g.route is None and not missing:
        missing = [r.cli() for r in gaps(counts)]
    out = {"identity": g.identity, "peers": g.num_peers, "usable": g.num_usable, "coverage": counts,
           "route": [{"peer_id": h.peer_id, "layers": h.layers.cli()} for h in g.route.hops] if g.route else None,
           "estimated_ms_per_token": g.route.estimated_ms_per_token if g.route else None,
           "missing_layers": missing}
    if model is not None:
        out.update(model=model, weights_hash=g.compat_key[0], precision=g.compat_key[1], num_layers=g.compat_key[3],
                   backend=g.compat_key[4])
    return out


def reply_json(result: ChatResult) -> dict:
    """The ``meshinfer`` field of a completion: time to first token (ms), decode tokens/s, the
    route with per-hop compute and network ms per token, failovers, detections, and the hops
    no spot-check verified (``unverified``: peer, layers, reason; docs/security.md)."""
    return {"ttft_ms": round(result.ttft_ms, 1), "tokens_per_s": round(result.decode_tokens_per_s, 2),
            "route": result.route, "failovers": result.failovers, "detections": result.detections,
            "unverified": result.unverified}


class MeshView:
    """Peers, coverage, routes and recent events of the mesh ``client`` sees.

    Args:
        client: the server's :class:`MeshClient` (owned by the caller).
        model_id: maps a weights hash to the model id the API shows.
        refresh_s: see :data:`MESH_REFRESH_S`.
        forget_gone_s: see :data:`GONE_FORGET_S`.
    """

    def __init__(self, client: MeshClient, *, model_id: Callable[[str], str], refresh_s: float = MESH_REFRESH_S,
                 forget_gone_s: float = GONE_FORGET_S) -> None:
        self.client, self.model_id = client, model_id
        self.refresh_s, self.forget_gone_s = refresh_s, forget_gone_s
        self._seen: dict[str, tuple[PeerAdvert, float]] = {}  # peer id -> (newest advert, monotonic last seen)
        self._live: set[str] = set()  # peer ids in the table at the last refresh
        self._problem: dict | None = None  # the refresh's own failure
        self._refreshed_at = -float("inf")
        self._refreshing: asyncio.Task | None = None
        self.last_reply: dict | None = None
        self.events: collections.deque = collections.deque(maxlen=MAX_EVENTS)

    async def snapshot(self) -> dict:
        """The JSON of ``GET /v1/mesh`` (see docs/api.md), refreshing first when stale.

        Never raises for the mesh's state: a failed refresh becomes ``problem``. Cancelling
        the caller leaves a refresh in flight to finish for the next one.
        """
        if time.monotonic() - self._refreshed_at > self.refresh_s:
            if self._refreshing is None or self._refreshing.done():
                self._refreshing = asyncio.ensure_future(self._refresh())
            await asyncio.shield(self._refreshing)
        return self._build()

    async def _refresh(self) -> None:
        try:
            ads = await self.client.refresh()
            await self.client.measure_rtts(ads)
        except MeshError as exc:
            self._live, self._problem = set(), self._refresh_problem(exc)
        else:
            now = time.monotonic()
            self._live, self._problem = {a.peer_id for a in ads}, None
            for a in ads:
                self._seen[a.peer_id] = (a, now)
        finally:
            self._refreshed_at = time.monotonic()
        self._forget_old()

    @staticmethod
    def _refresh_problem(exc: MeshError) -> dict:
        if isinstance(exc, Unauthenticated):
            return {"code": "unauthenticated", "message": f"the mesh refused this server: {exc}",
                    "missing_layers": []}
        return {"code": "peer_unavailable", "message": f"no peer answers: {exc}", "missing_layers": []}

    def _forget_old(self) -> None:
        now = time.monotonic()
        gone = sorted((seen, pid) for pid, (_, seen) in self._seen.items() if pid not in self._live)
        for i, (seen, pid) in enumerate(gone):
            if now - seen > self.forget_gone_s or i < len(gone) - MAX_GONE_PEERS:
                del self._seen[pid]

    def _state(self, ad: PeerAdvert) -> str:
        if ad.peer_id not in self._live:
            return "gone"
        if ad.peer_id not in self.client.rtts_ms:
            return "unreachable"
        return ad.state

    def _peer_json(self, ad: PeerAdvert, seen: float, now: float) -> dict:
        rtt = self.client.rtts_ms.get(ad.peer_id) if ad.peer_id in self._live else None
        address = (ad.addrs or ("",))[0] if not ad.relays or ad.addrs else f"relayed via {ad.relays[0][:12]}"
        return {"peer_id": ad.peer_id, "address": address, "relays": list(ad.relays),
                "model": self.model_id(ad.weights_hash),
                "weights_hash": ad.weights_hash, "layers": ad.layers.cli(), "layers_start": ad.layers.start,
                "layers_stop": ad.layers.stop, "num_layers": ad.num_layers, "device": ad.device,
                "precision": ad.precision, "state": self._state(ad),
                "rtt_ms": round(rtt, 2) if rtt is not None else None, "free_kv_tokens": ad.free_kv_tokens,
                "compute_ms_per_token": round(ad.compute_ms_per_token, 2), "seen_s_ago": round(now - seen, 1)}

    def _build(self) -> dict:
        now = time.monotonic()
        known = sorted(self._seen.values(), key=lambda s: (s[0].weights_hash, s[0].layers.start, s[0].peer_id))
        live = [ad for ad, _ in known if ad.peer_id in self._live]
        reachable = frozenset(p.peer_id for p in live if p.peer_id in self.client.rtts_ms)
        serving = [p for p in live if p.peer_id in reachable]
        summary = {g.compat_key: g for g in complete_routes_summary(
            live, client_rtts_ms=self.client.rtts_ms, exclude=frozenset(p.peer_id for p in live) - reachable)}
        groups = []
        for key in dict.fromkeys(ad.compat_key for ad, _ in known):
            g = summary.get(key) or GroupStatus(compat_key=key, identity=compat_label(key),
                                                num_peers=0, num_usable=0, route=None,
                                                missing=(LayerRange(0, key[3]),))
            groups.append(group_json(g, serving, model=self.model_id(key[0])))
        return {"object": "mesh", "time": time.time(),
                "peers": [self._peer_json(ad, seen, now) for ad, seen in known],
                "groups": groups, "problem": self._problem or self._route_problem(groups),
                "last_reply": self.last_reply, "events": list(self.events)}

    @staticmethod
    def _route_problem(groups: list[dict]) -> dict | None:
        if not groups or any(g["route"] for g in groups):
            return None
        g = groups[0]
        return {"code": "no_route", "message": f"no complete route: layers {', '.join(g['missing_layers'])} of "
                                               f"{g['model']} ({g['precision']}) have no reachable peer",
                "missing_layers": g["missing_layers"]}

    def record_reply(self, model: str, result: ChatResult) -> dict:
        """Keep ``result`` as the last reply (and its failovers and detections as events);
        return its ``meshinfer`` field (:func:`reply_json`)."""
        info = reply_json(result)
        at = time.time()
        self.last_reply = dict(info, model=model, time=at, finish_reason=result.finish_reason,
                               completion_tokens=len(result.token_ids))
        for kind, items in (("failover", result.failovers), ("detection", result.detections)):
            for item in items:
                self.events.append({"kind": kind, "time": at, "model": model, **_plain(item)})
        return info


def _plain(item: Any) -> dict:
    """A failover or detection as a flat dict (they are dicts already; anything else is wrapped)."""
    return dict(item) if isinstance(item, dict) else {"detail": str(item)}
