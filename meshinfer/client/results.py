"""What a conversation's generation returns: the result (``meshinfer chat --json``), and the
per-hop timing it reports (:class:`StepTimes` keeps a conversation's step and compute times)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from meshinfer.core.generation import Generation


@dataclass
class HopStats:
    """Per-hop timing of a generation, milliseconds per decode token."""

    peer_id: str
    address: str
    layers: str
    device: str
    precision: str
    compute_ms_per_token: float = 0.0
    network_ms_per_token: float = 0.0


@dataclass
class ChatResult(Generation):
    """What ``meshinfer chat --json`` prints: a :class:`Generation` plus the route, failovers and
    lying hops detected (``detections``: peer, reason, tokens kept after the rollback), hops
    whose output nothing verified (``unverified``: peer, layers, reason) and
    speculation counters (``{proposed, accepted, steps, draft_tokens, acceptance}``; empty when off)."""

    route: list[dict] = field(default_factory=list)
    failovers: list[dict] = field(default_factory=list)
    detections: list[dict] = field(default_factory=list)
    unverified: list[dict] = field(default_factory=list)
    speculative: dict = field(default_factory=dict)


class StepTimes:
    """A conversation's decode-step wall times and each hop's compute times, ms per token."""

    def __init__(self) -> None:
        self._compute_ms: dict[str, list[float]] = {}
        self._step_ms: list[float] = []

    def record(self, trace: list, step_ms: float, n_tokens: int = 1) -> None:
        """Keep a decode step's wall ms and each hop's compute ms, per token the step produced."""
        self._step_ms.append(step_ms / n_tokens)
        for entry in trace[:64]:
            if isinstance(entry, dict) and isinstance(entry.get("peer"), str):
                ms = entry.get("compute_ms", 0.0)
                ms = float(ms) if isinstance(ms, (int, float)) else 0.0
                self._compute_ms.setdefault(entry["peer"], []).append(ms / n_tokens)

    def hop_stats(self, client, route) -> list[dict]:
        """Per-hop compute ms/token (from the hops' traces) and network ms/token of ``route``,
        as :class:`HopStats` dicts (``client``: the :class:`~meshinfer.client.mesh.MeshClient`,
        for its RTTs and the address it reaches each hop at).

        Network time is the client-measured step time minus all hops' compute, split across
        the links into each hop in proportion to their measured RTTs (client->hop 1 and the
        way back count for the first and last hop). See docs/architecture.md.
        """
        hops = route.hops
        compute = [statistics.fmean(self._compute_ms.get(h.peer_id) or [0.0]) for h in hops]
        step = statistics.fmean(self._step_ms) if self._step_ms else 0.0
        network = max(0.0, step - sum(compute))
        weights = []
        for i, h in enumerate(hops):
            w = client.rtts_ms.get(h.peer_id, 1.0) / 2 if i == 0 else \
                (hops[i - 1].peer.rtts_ms.get(h.peer_id) or h.peer.rtts_ms.get(hops[i - 1].peer_id) or 1.0) / 2
            if i == len(hops) - 1:
                w += client.rtts_ms.get(h.peer_id, 1.0) / 2
            weights.append(max(w, 1e-3))
        total = sum(weights)
        return [HopStats(peer_id=h.peer_id, address=client.address(h.peer), layers=h.layers.cli(),
                         device=h.peer.device, precision=h.peer.precision,
                         compute_ms_per_token=round(c, 3),
                         network_ms_per_token=round(network * w / total, 3)).__dict__
                for h, c, w in zip(hops, compute, weights)]
