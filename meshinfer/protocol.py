"""Wire types of the meshinfer protocol.

(Work in progress: the message codec lands in this module too.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .config import LayerRange

#: Version of the wire protocol. Peers refuse a handshake whose major version differs.
PROTOCOL_VERSION = 1

#: Peer states as advertised.
JOINING, READY, DRAINING = "joining", "ready", "draining"


@dataclass(frozen=True)
class PeerAdvert:
    """What a peer announces about itself; gossiped through the mesh.

    Attributes:
        peer_id: hex id derived from the peer's public key.
        addrs: websocket URLs the peer can be dialed at (may be empty behind NAT).
        protocol_version: the peer's :data:`PROTOCOL_VERSION`.
        weights_hash: sha256 hex of the weights (see ``meshinfer.weights.identity``).
        architecture: ``"llama"`` or ``"qwen2"``.
        num_layers: L, layers of the whole model.
        layers: the half-open layer range this peer holds.
        device: ``"cpu"``, ``"cuda:0"``, ``"mps"`` ...
        precision: compute precision identity, e.g. ``"f32"`` or ``"bf16"``.
        state: ``"joining"``, ``"ready"`` or ``"draining"``.
        free_kv_tokens: how many more tokens of KV cache the peer can hold for its range.
        compute_ms_per_token: measured decode time of its whole range per token, milliseconds.
        rtts_ms: the peer's measured round-trip times to other peers, by peer id, milliseconds.
        seq: per-peer counter, larger means newer.
        ttl_s: seconds the record stays valid after it was received, unless refreshed.
    """

    peer_id: str
    addrs: tuple[str, ...]
    protocol_version: int
    weights_hash: str
    architecture: str
    num_layers: int
    layers: LayerRange
    device: str
    precision: str
    state: str = READY
    free_kv_tokens: int = 0
    compute_ms_per_token: float = 0.0
    rtts_ms: dict[str, float] = field(default_factory=dict, hash=False, compare=False)
    seq: int = 0
    ttl_s: float = 15.0

    @property
    def compat_key(self) -> tuple[str, str, int, int]:
        """Peers may share a route only when this key is equal: (hash, precision, protocol, L)."""
        return (self.weights_hash, self.precision, self.protocol_version, self.num_layers)
