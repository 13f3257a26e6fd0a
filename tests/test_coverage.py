"""Layer coverage and the layers ``join --layers auto`` takes: pure, on synthetic peer tables."""

from __future__ import annotations

import pytest

from meshinfer.core.config import LayerRange, ModelConfig
from meshinfer.client.coverage import choose_layers, coverage, coverage_strip, layers_that_fit
from meshinfer.wire.protocol import DRAINING, READY, PeerAdvert


def ad(pid: str, a: int, b: int, *, state: str = READY, seq: int = 0, L: int = 24) -> PeerAdvert:
    return PeerAdvert(peer_id=pid, addrs=(), protocol_version=1, weights_hash="w", architecture="qwen2",
                      num_layers=L, layers=LayerRange(a, b), device="cpu", precision="f32", state=state, seq=seq)


def test_coverage_counts_ready_peers_once_each():
    peers = [ad("a", 0, 12), ad("b", 6, 18), ad("c", 0, 24, state=DRAINING), ad("b", 0, 2, seq=-1)]
    counts = coverage(peers, 24)
    assert counts == [1] * 6 + [2] * 6 + [1] * 6 + [0] * 6
    assert coverage_strip(counts) == "111111222222111111......"
    assert coverage_strip([0, 1, 9, 10, 42]) == ".19++"


@pytest.mark.parametrize("counts, max_layers, layers, reason", [
    ([0] * 24, None, (0, 24), "taking layers 0-23 of 24: no peer of this model is in the mesh yet"),
    ([1] * 12 + [0] * 12, 12, (12, 24), "taking layers 12-23 of 24: 12 of its layers have no peer "
                                        "(mesh coverage 111111111111............), at most 12 layers fit"),
    ([1] * 12 + [0] * 12, 8, (12, 20), None),  # the first window that is all gap
    ([1] * 4 + [0] * 2 + [1] * 2, 4, (2, 6), None),  # covers both gap layers; the earliest of three
    ([2, 2, 1, 1, 2, 2], 2, (2, 4), "taking layers 2-3 of 6: every layer is served; these are served least, "
                                    "by 1 peer(s) (mesh coverage 221122), at most 2 layers fit"),
    ([1, 1, 1, 1], 99, (0, 4), None),  # a larger bound than the model: all of it
])
def test_choose_layers_takes_what_the_mesh_serves_least(counts, max_layers, layers, reason):
    placement = choose_layers(counts, max_layers)
    assert placement.layers == LayerRange(*layers)
    if reason is not None:
        assert placement.reason == reason


def test_choose_layers_refuses_nonsense():
    with pytest.raises(ValueError, match="max_layers must be at least 1, got 0"):
        choose_layers([0, 0], 0)
    with pytest.raises(ValueError, match="the model has no layers"):
        choose_layers([], None)


def test_layers_that_fit_counts_weights_at_the_precision():
    cfg = ModelConfig(architecture="qwen2", vocab_size=1000, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                      rope_theta=1e4, max_position_embeddings=256, attention_bias=True, tie_word_embeddings=True)
    per_layer = (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128) * 4  # bytes at f32
    ends = 1000 * 64 * 4
    assert layers_that_fit(cfg, "f32", ends + 3 * per_layer) == 3
    assert layers_that_fit(cfg, "bf16", ends // 2 + 3 * per_layer) == 6
    assert layers_that_fit(cfg, "f32", 10) == 1  # never less than one layer
    with pytest.raises(ValueError, match="unknown precision 'f8'"):
        layers_that_fit(cfg, "f8", 1 << 30)
