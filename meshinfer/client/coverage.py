"""Layer coverage of a mesh, and which layers a joining peer should take (pure: no I/O, no torch).

``join --layers auto`` asks the mesh for its adverts, counts how many ready peers of the same
model identity (weights hash, precision, layer count) serve each layer, and takes the
contiguous range of at most ``max_layers`` layers that the mesh serves least
(:func:`choose_layers`), as Petals servers choose the blocks the swarm serves least
(``petals/server/block_selection.py``: the span with the lowest throughput). ``meshinfer
status`` prints the same counts as one cell per layer (:func:`coverage_strip`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from meshinfer.core.config import LayerRange, ModelConfig
from meshinfer.wire.protocol import READY, PeerAdvert

#: Bytes per weight by precision: f32 4, bf16/f16 2, int8 1 plus a bf16 scale per output row
#: (about 1). See ``meshinfer.engine.models.quant``.
BYTES_PER_WEIGHT = {"f32": 4.0, "bf16": 2.0, "f16": 2.0, "q8-bf16": 1.0,
                    # the file's own blocks: at most Q8_0's 34 bytes per 32 weights for the
                    # quantized types these precisions keep (Q4_K_M files average about 0.8)
                    "gguf": 1.07, "gguf-a16": 1.07, "gguf-a8": 1.07}
#: Share of the free memory a peer's weights may take when ``join`` sizes its range by memory;
#: the KV budget (half of what is free, by default) comes on top, so the rest is headroom.
WEIGHTS_MEMORY_SHARE = 0.4


def coverage(peers: Iterable[PeerAdvert], num_layers: int) -> list[int]:
    """Ready peers serving each layer: ``counts[i]`` for layer ``i`` of ``num_layers``. One
    advert per peer id counts (the newest by ``seq``); layers past ``num_layers`` are ignored."""
    newest: dict[str, PeerAdvert] = {}
    for p in peers:
        if p.peer_id not in newest or p.seq > newest[p.peer_id].seq:
            newest[p.peer_id] = p
    counts = [0] * num_layers
    for p in newest.values():
        if p.state == READY:
            for i in range(p.layers.start, min(p.layers.stop, num_layers)):
                counts[i] += 1
    return counts


def coverage_strip(counts: Sequence[int]) -> str:
    """One character per layer: ``.`` where no peer serves it (a gap), else the count (``+``
    from 10): ``"1111..22"`` is layers 0-3 on one peer, 4-5 on none, 6-7 on two."""
    return "".join("." if c == 0 else str(c) if c < 10 else "+" for c in counts)


def layers_that_fit(cfg: ModelConfig, precision: str, memory_bytes: int) -> int:
    """How many decoder layers of ``cfg`` fit in ``memory_bytes`` at ``precision``, after the
    token embedding and output head (counted twice when untied), at least 1.

    Per layer: q and o ``C x H*D``, k and v ``C x Hkv*D``, the MLP ``3 x C x intermediate``
    (norms and biases are negligible).

    Raises:
        ValueError: an unknown ``precision``.
    """
    if precision not in BYTES_PER_WEIGHT:
        raise ValueError(f"unknown precision {precision!r}; choose one of {', '.join(BYTES_PER_WEIGHT)}")
    width = BYTES_PER_WEIGHT[precision]
    c, d = cfg.hidden_size, cfg.head_dim
    per_layer = (2 * c * cfg.num_attention_heads * d + 2 * c * cfg.num_key_value_heads * d
                 + 3 * c * cfg.intermediate_size) * width
    ends = cfg.vocab_size * c * width * (1 if cfg.tie_word_embeddings else 2)
    return max(1, int((memory_bytes - ends) // per_layer))


@dataclass(frozen=True)
class Placement:
    """The layers a joining peer takes, and why.

    Attributes:
        layers: the half-open range to serve.
        reason: a sentence for the peer's log: what the mesh serves and why this range.
    """

    layers: LayerRange
    reason: str


def choose_layers(counts: Sequence[int], max_layers: int | None = None) -> Placement:
    """The contiguous range of at most ``max_layers`` layers (all, when None or larger) that
    the mesh serves least.

    Windows are compared by the layers they would fill that no peer serves (more is better),
    then by the fewest peers serving their least-served layer, then by the fewest peers over
    the whole window, then the earliest start.

    Args:
        counts: peers serving each layer (:func:`coverage`); ``len(counts)`` is L.
        max_layers: most layers this peer can hold (memory bound), >= 1.

    Raises:
        ValueError: ``counts`` is empty or ``max_layers < 1``.
    """
    n = len(counts)
    if n == 0:
        raise ValueError("the model has no layers")
    if max_layers is not None and max_layers < 1:
        raise ValueError(f"max_layers must be at least 1, got {max_layers}")
    width = n if max_layers is None else min(max_layers, n)
    best = min(range(n - width + 1), key=lambda s: (-sum(c == 0 for c in counts[s:s + width]),
                                                    min(counts[s:s + width]), sum(counts[s:s + width]), s))
    layers = LayerRange(best, best + width)
    window = counts[best:best + width]
    if not any(counts):
        why = "no peer of this model is in the mesh yet"
    elif 0 in window:
        gaps = sum(c == 0 for c in window)
        why = f"{gaps} of its layers have no peer (mesh coverage {coverage_strip(counts)})"
    else:
        why = (f"every layer is served; these are served least, by {min(window)} peer(s) "
               f"(mesh coverage {coverage_strip(counts)})")
    limit = "" if width == n else f", at most {width} layers fit"
    return Placement(layers, f"taking layers {layers.cli()} of {n}: {why}{limit}")
