"""Pure planner tests on synthetic peer tables (no I/O)."""

from __future__ import annotations

import random

import pytest

from meshinfer.client import routing
from meshinfer.core.config import LayerRange
from meshinfer.core.errors import NoRoute
from meshinfer.wire.protocol import DRAINING, JOINING, READY, PeerAdvert
from meshinfer.client.routing import (DEFAULT_UNKNOWN_RTT_MS, HOP_OVERHEAD_MS, Route,
    complete_routes_summary, estimate_ms_per_token, link_rtt_ms, plan_route)

HASH_A = "1d9614638d18" + "a" * 52
HASH_B = "0a0b1c2d3e4f" + "b" * 52


def peer(peer_id: str, first: int, last: int, *, num_layers: int = 24, weights: str = HASH_A,
         precision: str = "f32", state: str = READY, compute_ms: float = 12.0, free_kv: int = 4096,
         rtts: dict[str, float] | None = None, seq: int = 0, protocol: int = 1, device: str = "cpu") -> PeerAdvert:
    """A ready advert holding the inclusive CLI range ``first-last``."""
    return PeerAdvert(peer_id=peer_id, addrs=(f"ws://{peer_id}:7000",), protocol_version=protocol,
                      weights_hash=weights, architecture="llama", num_layers=num_layers,
                      layers=LayerRange(first, last + 1), device=device, precision=precision, state=state,
                      free_kv_tokens=free_kv, compute_ms_per_token=compute_ms, rtts_ms=dict(rtts or {}),
                      seq=seq)


def chain(route: Route) -> list[tuple[str, str]]:
    return [(h.peer_id, h.layers.cli()) for h in route.hops]


def assert_valid_route(route: Route, num_layers: int, *, allow_revisit: bool = False) -> None:
    """The invariant every route must hold: [0, L) once, in order, on compatible ready peers."""
    hops = route.hops
    assert hops, "a route has at least one hop"
    assert route.num_layers == num_layers
    assert hops[0].layers.start == 0
    assert hops[0].peer.layers.start == 0, "the first hop must hold the embedding"
    assert hops[-1].layers.stop == num_layers
    assert hops[-1].peer.layers.stop == num_layers, "the last hop must hold the output head"
    for prev, nxt in zip(hops, hops[1:]):
        assert prev.layers.stop == nxt.layers.start, "hops must be contiguous and in order"
    covered = [layer for h in hops for layer in range(h.layers.start, h.layers.stop)]
    assert covered == list(range(num_layers)), "each layer exactly once, in order"
    for h in hops:
        assert h.peer.layers.start <= h.layers.start < h.layers.stop <= h.peer.layers.stop
        assert h.peer.state == READY
        assert h.peer.compat_key == route.compat_key
    if not allow_revisit:
        assert len(set(route.peer_ids)) == len(hops), "a peer serves at most one hop"


# ------------------------------------------------------------------------- choosing by latency


def test_redundant_peers_choice_follows_client_rtt():
    peers = [peer("a", 0, 11), peer("b", 0, 11), peer("c", 12, 23)]
    route = plan_route(peers, client_rtts_ms={"a": 10.0, "b": 50.0, "c": 10.0})
    assert chain(route) == [("a", "0-11"), ("c", "12-23")]
    route = plan_route(peers, client_rtts_ms={"a": 50.0, "b": 10.0, "c": 10.0})
    assert chain(route) == [("b", "0-11"), ("c", "12-23")]


def test_redundant_peers_choice_follows_compute_time():
    rtts = {"a": 10.0, "b": 10.0, "c": 10.0}
    fast_a = [peer("a", 0, 11, compute_ms=5.0), peer("b", 0, 11, compute_ms=80.0), peer("c", 12, 23)]
    assert chain(plan_route(fast_a, client_rtts_ms=rtts))[0] == ("a", "0-11")
    fast_b = [peer("a", 0, 11, compute_ms=80.0), peer("b", 0, 11, compute_ms=5.0), peer("c", 12, 23)]
    assert chain(plan_route(fast_b, client_rtts_ms=rtts))[0] == ("b", "0-11")


def test_cost_is_the_documented_sum():
    peers = [peer("a", 0, 11, compute_ms=6.0, rtts={"c": 4.0}), peer("c", 12, 23, compute_ms=10.0)]
    route = plan_route(peers, client_rtts_ms={"a": 20.0, "c": 30.0})
    # client->a 10 + a->c 2 + c->client 15 + compute 6 + 10 + two hops' overhead
    expected = 43.0 + 2 * HOP_OVERHEAD_MS
    assert route.estimated_ms_per_token == pytest.approx(expected)
    assert estimate_ms_per_token(route.hops, client_rtts_ms={"a": 20.0, "c": 30.0}) == pytest.approx(expected)


def test_link_rtt_is_the_mean_of_both_reports_or_either_or_the_default():
    a, b = peer("a", 0, 11, rtts={"b": 10.0}), peer("b", 12, 23, rtts={"a": 30.0})
    assert link_rtt_ms(a, b) == 20.0
    assert link_rtt_ms(a, peer("b", 12, 23)) == 10.0
    assert link_rtt_ms(peer("a", 0, 11), b) == 30.0
    assert link_rtt_ms(peer("a", 0, 11), peer("b", 12, 23)) == DEFAULT_UNKNOWN_RTT_MS


def test_link_rtt_decides_the_second_hop():
    rtts = {"a": 10.0, "b": 10.0, "c": 10.0}
    peers = [peer("a", 0, 11, rtts={"b": 5.0, "c": 60.0}), peer("b", 12, 23), peer("c", 12, 23)]
    assert chain(plan_route(peers, client_rtts_ms=rtts))[1] == ("b", "12-23")
    peers = [peer("a", 0, 11, rtts={"b": 60.0, "c": 5.0}), peer("b", 12, 23), peer("c", 12, 23)]
    assert chain(plan_route(peers, client_rtts_ms=rtts))[1] == ("c", "12-23")


def test_unknown_client_rtt_uses_the_default_and_loses_to_a_known_small_one():
    peers = [peer("a", 0, 23), peer("b", 0, 23)]
    route = plan_route(peers, client_rtts_ms={"b": 20.0})
    assert route.peer_ids == ("b",)
    route = plan_route([peer("a", 0, 23, compute_ms=12.0)], client_rtts_ms={})
    assert route.estimated_ms_per_token == pytest.approx(DEFAULT_UNKNOWN_RTT_MS + 12.0 + HOP_OVERHEAD_MS)


def test_invalid_client_rtt_counts_as_unknown():
    route = plan_route([peer("a", 0, 23, compute_ms=0.0)], client_rtts_ms={"a": float("nan")})
    assert route.estimated_ms_per_token == DEFAULT_UNKNOWN_RTT_MS + HOP_OVERHEAD_MS


def test_single_peer_with_all_layers():
    route = plan_route([peer("solo", 0, 23, compute_ms=30.0)], client_rtts_ms={"solo": 2.0})
    assert chain(route) == [("solo", "0-23")]
    assert route.estimated_ms_per_token == pytest.approx(32.0 + HOP_OVERHEAD_MS)
    assert_valid_route(route, 24)


# ------------------------------------------------------------------------- covers and sub-ranges


def test_overlapping_ranges_get_exact_sub_ranges():
    rtts = {"a": 10.0, "b": 10.0, "c": 10.0}
    # a runs a layer for 1 ms, b for 2 ms: a keeps every layer it can.
    peers = [peer("a", 0, 11, compute_ms=12.0), peer("b", 6, 17, compute_ms=24.0), peer("c", 18, 23)]
    route = plan_route(peers, client_rtts_ms=rtts)
    assert chain(route) == [("a", "0-11"), ("b", "12-17"), ("c", "18-23")]
    assert_valid_route(route, 24)
    # Now b is faster, so a gives it every layer from 6 on.
    peers = [peer("a", 0, 11, compute_ms=24.0), peer("b", 6, 17, compute_ms=12.0), peer("c", 18, 23)]
    route = plan_route(peers, client_rtts_ms=rtts)
    assert chain(route) == [("a", "0-5"), ("b", "6-17"), ("c", "18-23")]
    assert route.hops[1].compute_ms == pytest.approx(12.0)
    assert_valid_route(route, 24)


def test_uneven_split_over_five_peers():
    spans = [(0, 3), (4, 9), (10, 14), (15, 20), (21, 23)]
    peers = [peer(f"p{i}", a, b) for i, (a, b) in enumerate(spans)]
    route = plan_route(peers, client_rtts_ms={p.peer_id: 5.0 for p in peers}, num_layers=24)
    assert chain(route) == [(f"p{i}", f"{a}-{b}") for i, (a, b) in enumerate(spans)]
    assert_valid_route(route, 24)


def test_a_one_layer_hop_near_the_client_can_be_best():
    # Only "near" is close to the client, and it is slow. Running layer 0 on it makes the
    # client's link cheap; the fast, distant peer runs the rest and sends the token back.
    peers = [peer("near", 0, 11, compute_ms=240.0, rtts={"far": 2.0}), peer("far", 0, 23, compute_ms=24.0)]
    route = plan_route(peers, client_rtts_ms={"near": 2.0})
    assert chain(route) == [("near", "0-0"), ("far", "1-23")]
    # client->near 1 + near->far 1 + far->client 50 (unknown RTT) + compute 20 + 23 + 2 hops
    assert route.estimated_ms_per_token == pytest.approx(95.0 + 2 * HOP_OVERHEAD_MS)


def test_revisiting_a_peer_only_when_allowed():
    peers = [peer("a", 0, 23, compute_ms=240.0, rtts={"b": 1.0}), peer("b", 6, 17, compute_ms=12.0)]
    rtts = {"a": 1.0, "b": 1.0}
    route = plan_route(peers, client_rtts_ms=rtts)
    assert chain(route) == [("a", "0-23")]
    route = plan_route(peers, client_rtts_ms=rtts, allow_revisit=True)
    assert chain(route) == [("a", "0-5"), ("b", "6-17"), ("a", "18-23")]
    assert_valid_route(route, 24, allow_revisit=True)


def test_no_revisit_still_finds_the_best_chain_without_one():
    # With revisits, a->b->a would win. Without them, the best is a->b->c, not a alone.
    peers = [peer("a", 0, 23, compute_ms=240.0, rtts={"b": 1.0}),
             peer("b", 6, 17, compute_ms=12.0, rtts={"c": 1.0}),
             peer("c", 18, 23, compute_ms=60.0)]
    route = plan_route(peers, client_rtts_ms={"a": 1.0, "c": 1.0})
    assert chain(route) == [("a", "0-5"), ("b", "6-17"), ("c", "18-23")]
    assert_valid_route(route, 24)


def test_no_revisit_can_move_the_slow_peer_to_the_end():
    # a is slow (80 ms a layer) but near the client; c is fast but 200 ms from the client
    # one way. With revisits, a runs layer 0 and layers 6-7. Without, c runs layers 0-1 and a
    # only layers 6-7: a alone would cost 640 ms of compute.
    rtts = {"a": 1.0, "b": 1.0, "c": 400.0}
    lan = {"a": 1.0, "b": 1.0, "c": 1.0}
    peers = [peer("a", 0, 7, num_layers=8, compute_ms=640.0, rtts=lan),
             peer("b", 2, 5, num_layers=8, compute_ms=4.0, rtts=lan),
             peer("c", 0, 1, num_layers=8, compute_ms=1.0, rtts=lan)]
    revisiting = plan_route(peers, client_rtts_ms=rtts, allow_revisit=True)
    assert chain(revisiting) == [("a", "0-0"), ("c", "1-1"), ("b", "2-5"), ("a", "6-7")]
    assert chain(plan_route(peers, client_rtts_ms=rtts)) == [("c", "0-1"), ("b", "2-5"), ("a", "6-7")]


def test_capped_search_without_revisits_still_returns_a_valid_chain(monkeypatch):
    # The table of the test above: uncapped, the answer is c[0-1] -> b[2-5] -> a[6-7].
    lan = {"a": 1.0, "b": 1.0, "c": 1.0}
    peers = [peer("a", 0, 7, num_layers=8, compute_ms=640.0, rtts=lan),
             peer("b", 2, 5, num_layers=8, compute_ms=4.0, rtts=lan),
             peer("c", 0, 1, num_layers=8, compute_ms=1.0, rtts=lan)]
    monkeypatch.setattr(routing, "MAX_REVISIT_BRANCHES", 0)
    route = plan_route(peers, client_rtts_ms={"a": 1.0, "b": 1.0, "c": 400.0})
    assert chain(route) == [("a", "0-7")]  # the greedy chain: a reaches furthest
    assert_valid_route(route, 8)


# ------------------------------------------------------------------------- states and filters


def test_never_uses_joining_or_draining_peers():
    peers = [peer("a", 0, 11, compute_ms=50.0), peer("fast-drain", 0, 11, compute_ms=1.0, state=DRAINING),
             peer("fast-join", 12, 23, compute_ms=1.0, state=JOINING), peer("b", 12, 23, compute_ms=50.0)]
    route = plan_route(peers, client_rtts_ms={})
    assert chain(route) == [("a", "0-11"), ("b", "12-23")]


def test_gap_left_by_joining_and_draining_peers_is_named():
    peers = [peer("a", 0, 11), peer("j", 12, 17, state=JOINING), peer("d", 12, 17, state=DRAINING),
             peer("c", 18, 23)]
    with pytest.raises(NoRoute) as err:
        plan_route(peers, client_rtts_ms={})
    assert str(err.value) == "no route: layers 12-17 have no ready peer (peer d is draining; peer j is joining)"


def test_gap_of_one_layer_and_several_gaps_are_named():
    with pytest.raises(NoRoute) as err:
        plan_route([peer("a", 0, 11), peer("c", 13, 23)], client_rtts_ms={})
    assert str(err.value) == "no route: layer 12 has no ready peer"
    with pytest.raises(NoRoute) as err:
        plan_route([peer("a", 2, 11), peer("c", 13, 20)], client_rtts_ms={})
    assert str(err.value) == "no route: layers 0-1, 12 and 21-23 have no ready peer"


def test_excluded_peers_are_not_used():
    peers = [peer("a", 0, 11, compute_ms=1.0), peer("b", 0, 11, compute_ms=90.0), peer("c", 12, 23)]
    assert plan_route(peers, client_rtts_ms={}).peer_ids == ("a", "c")
    assert plan_route(peers, client_rtts_ms={}, exclude=frozenset({"a"})).peer_ids == ("b", "c")
    with pytest.raises(NoRoute) as err:
        plan_route(peers, client_rtts_ms={}, exclude=frozenset({"a", "b"}))
    assert str(err.value) == "no route: layers 0-11 have no ready peer (peer a is excluded; peer b is excluded)"


def test_min_free_kv_tokens_skips_full_peers():
    peers = [peer("full", 0, 23, compute_ms=1.0, free_kv=100), peer("roomy", 0, 23, compute_ms=90.0, free_kv=9000)]
    assert plan_route(peers, client_rtts_ms={}).peer_ids == ("full",)
    assert plan_route(peers, client_rtts_ms={}, min_free_kv_tokens=512).peer_ids == ("roomy",)
    with pytest.raises(NoRoute) as err:
        plan_route(peers, client_rtts_ms={}, min_free_kv_tokens=10_000)
    assert str(err.value) == ("no route: layers 0-23 have no ready peer (peer full has 100 free KV tokens, "
                              "10000 needed; peer roomy has 9000 free KV tokens, 10000 needed)")


def test_newest_advert_of_a_peer_wins():
    old = peer("a", 0, 23, seq=1)
    new = peer("a", 0, 23, seq=2, state=DRAINING)
    with pytest.raises(NoRoute):
        plan_route([new, old], client_rtts_ms={})
    assert plan_route([peer("a", 0, 23, seq=3), new], client_rtts_ms={}).peer_ids == ("a",)


def test_bad_arguments_raise_value_error():
    with pytest.raises(ValueError, match="min_free_kv_tokens must be >= 0, got -1"):
        plan_route([peer("a", 0, 23)], client_rtts_ms={}, min_free_kv_tokens=-1)
    with pytest.raises(ValueError, match="num_layers 12 disagrees with compat_key"):
        plan_route([peer("a", 0, 23)], client_rtts_ms={}, num_layers=12,
                   compat_key=peer("a", 0, 23).compat_key)


def test_empty_table_and_unknown_model_are_no_route():
    with pytest.raises(NoRoute) as err:
        plan_route([], client_rtts_ms={})
    assert str(err.value) == "no route: the peer table is empty"
    with pytest.raises(NoRoute) as err:
        plan_route([peer("a", 0, 23)], client_rtts_ms={}, num_layers=32)
    assert str(err.value) == "no route: no peer advertises a 32-layer model"


# ------------------------------------------------------------------------- compatibility


def test_never_mixes_weights_hashes():
    peers = [peer("a", 0, 11, weights=HASH_A), peer("b", 12, 23, weights=HASH_B)]
    with pytest.raises(NoRoute) as err:
        plan_route(peers, client_rtts_ms={})
    assert str(err.value) == (
        "no compatible chain: layers 0-11 are served by weights 1d9614638d18 f32 and layers 12-23 by "
        "weights 0a0b1c2d3e4f f32; with weights 0a0b1c2d3e4f f32, layers 0-11 have no ready peer")


def test_never_mixes_precisions():
    peers = [peer("a", 0, 11, precision="f32"), peer("b", 12, 23, precision="bf16")]
    with pytest.raises(NoRoute) as err:
        plan_route(peers, client_rtts_ms={})
    assert "weights 1d9614638d18 f32" in str(err.value)
    assert "weights 1d9614638d18 bf16" in str(err.value)


def test_picks_the_complete_group_even_if_a_mixed_chain_would_be_faster():
    peers = [peer("a1", 0, 11, weights=HASH_A, compute_ms=1.0), peer("b1", 12, 23, weights=HASH_B, compute_ms=1.0),
             peer("slow", 0, 23, weights=HASH_B, compute_ms=500.0)]
    route = plan_route(peers, client_rtts_ms={})
    assert chain(route) == [("slow", "0-11"), ("b1", "12-23")]
    assert route.compat_key[0] == HASH_B


def test_best_complete_group_wins_and_required_key_restricts():
    fast_a = peer("a", 0, 23, weights=HASH_A, compute_ms=10.0)
    slow_b = peer("b", 0, 23, weights=HASH_B, compute_ms=90.0)
    assert plan_route([fast_a, slow_b], client_rtts_ms={}).peer_ids == ("a",)
    assert plan_route([fast_a, slow_b], client_rtts_ms={}, compat_key=slow_b.compat_key).peer_ids == ("b",)


def test_protocol_version_is_named_when_it_differs():
    peers = [peer("a", 0, 11, protocol=1), peer("b", 12, 23, protocol=2)]
    with pytest.raises(NoRoute) as err:
        plan_route(peers, client_rtts_ms={})
    assert "weights 1d9614638d18 f32 protocol 1" in str(err.value)
    assert "weights 1d9614638d18 f32 protocol 2" in str(err.value)


# ------------------------------------------------------------------------- ties


def test_tie_prefers_more_free_kv_then_lower_peer_id():
    peers = [peer("a", 0, 23, free_kv=100), peer("b", 0, 23, free_kv=200)]
    assert plan_route(peers, client_rtts_ms={}).peer_ids == ("b",)
    peers = [peer("b", 0, 23), peer("a", 0, 23)]
    assert plan_route(peers, client_rtts_ms={}).peer_ids == ("a",)


def test_tie_prefers_fewer_hops():
    # One hop: 25 + 25 + 16 + 1 = 67. Two hops: 25 + 0 + 25 + 8 + 7 + 2 = 67. The
    # per-layer sums (16/24, 8/12 and 7/12 ms) are inexact floats, so this also checks that
    # the tie survives them.
    assert HOP_OVERHEAD_MS == 1.0
    peers = [peer("z", 0, 23, compute_ms=16.0), peer("a", 0, 11, compute_ms=8.0, rtts={"b": 0.0}),
             peer("b", 12, 23, compute_ms=7.0)]
    route = plan_route(peers, client_rtts_ms={"z": 50.0, "a": 50.0, "b": 50.0})
    assert route.peer_ids == ("z",)
    assert route.estimated_ms_per_token == 67.0
    # Make the two-hop chain 1 ms cheaper and it wins.
    peers[2] = peer("b", 12, 23, compute_ms=6.0)
    assert plan_route(peers, client_rtts_ms={"z": 50.0, "a": 50.0, "b": 50.0}).peer_ids == ("a", "b")


# ------------------------------------------------------------------------- status summary


def test_complete_routes_summary_lists_each_group():
    peers = [peer("a", 0, 23, weights=HASH_A), peer("b", 0, 11, weights=HASH_B),
             peer("c", 12, 23, weights=HASH_B, state=JOINING)]
    summary = complete_routes_summary(peers, client_rtts_ms={"a": 4.0})
    assert [s.identity for s in summary] == ["weights 1d9614638d18 f32", "weights 0a0b1c2d3e4f f32"]
    assert summary[0].route is not None and summary[0].route.peer_ids == ("a",)
    assert summary[0].missing == ()
    assert summary[1].route is None
    assert summary[1].missing == (LayerRange(12, 24),)
    assert (summary[1].num_peers, summary[1].num_usable) == (2, 1)


def test_route_describe():
    route = plan_route([peer("a", 0, 11, compute_ms=1.0), peer("b", 12, 23, compute_ms=1.0)],
                       client_rtts_ms={"a": 1.0, "b": 1.0})
    assert route.describe() == "a[0-11] -> b[12-23] (~55.0 ms/token)"


# ------------------------------------------------------------------------- random tables vs brute force


def _brute_force(peers: list[PeerAdvert], client_rtts: dict[str, float], *, exclude: set[str],
                 min_kv: int, allow_revisit: bool) -> float | None:
    """Cheapest chain over every compat group by exhaustive enumeration, written independently."""
    best = None
    for key in {p.compat_key for p in peers}:
        L = key[3]
        usable = [p for p in peers if p.compat_key == key and p.state == READY and p.peer_id not in exclude
                  and (not min_kv or p.free_kv_tokens >= min_kv)]

        def client(p):
            return client_rtts.get(p.peer_id, DEFAULT_UNKNOWN_RTT_MS)

        def link(p, q):
            seen = [r for r in (p.rtts_ms.get(q.peer_id), q.rtts_ms.get(p.peer_id)) if r is not None]
            return sum(seen) / len(seen) if seen else DEFAULT_UNKNOWN_RTT_MS

        def walk(a, prev, used, cost):
            nonlocal best
            if a == L:
                total = cost + client(prev) / 2
                best = total if best is None else min(best, total)
                return
            for p in usable:
                if not (p.layers.start <= a < p.layers.stop) or p is prev:
                    continue
                if not allow_revisit and p.peer_id in used:
                    continue
                hop_in = client(p) / 2 if prev is None else link(prev, p) / 2
                for b in range(a + 1, p.layers.stop + 1):
                    compute = p.compute_ms_per_token * (b - a) / len(p.layers)
                    walk(b, p, used | {p.peer_id}, cost + hop_in + compute + HOP_OVERHEAD_MS)

        walk(0, None, frozenset(), 0.0)
    return best


def _random_table(rng: random.Random) -> tuple[list[PeerAdvert], dict[str, float], set[str], int]:
    """2-5 peers over 1-7 layers: mostly ready, some with other weights, some unmeasured links."""
    L = rng.randint(1, 7)
    ids = [f"p{i}" for i in range(rng.randint(2, 5))]
    peers = []
    for pid in ids:
        start = 0 if rng.random() < 0.3 else rng.randrange(L)
        stop = L if rng.random() < 0.4 else rng.randint(start + 1, L)
        rtts = {q: float(rng.randint(0, 20)) for q in ids if q != pid and rng.random() < 0.8}
        compute = float(rng.choice([rng.randint(0, 60), 300])) * (stop - start)
        peers.append(peer(pid, start, stop - 1, num_layers=L, compute_ms=compute,
                          weights=HASH_A if rng.random() < 0.85 else HASH_B,
                          state=rng.choice([READY] * 6 + [JOINING, DRAINING]),
                          free_kv=rng.choice([0, 100, 5000, 5000]), rtts=rtts))
    client_rtts = {pid: float(rng.randint(0, 80)) for pid in ids if rng.random() < 0.7}
    exclude = {pid for pid in ids if rng.random() < 0.1}
    min_kv = rng.choice([0, 0, 50, 1000])
    return peers, client_rtts, exclude, min_kv


def _random_wrap_table(rng: random.Random) -> tuple[list[PeerAdvert], dict[str, float], set[str], int]:
    """A slow peer holding every layer plus fast partial peers on a LAN: re-entering the slow
    peer around a fast one often pays, so the search without revisits has work to do."""
    L = rng.randint(3, 7)
    ids = [f"p{i}" for i in range(rng.randint(2, 5))]
    peers = [peer(ids[0], 0, L - 1, num_layers=L, compute_ms=300.0 * L,
                  rtts={q: float(rng.randint(0, 5)) for q in ids[1:]})]
    for pid in ids[1:]:
        start = rng.randrange(0, L)
        stop = rng.randint(start + 1, L)
        rtts = {q: float(rng.randint(0, 5)) for q in ids if q != pid}
        peers.append(peer(pid, start, stop - 1, num_layers=L, compute_ms=float(rng.randint(0, 20) * (stop - start)),
                          rtts=rtts))
    client_rtts = {pid: float(rng.randint(0, 10)) for pid in ids}
    return peers, client_rtts, set(), 0


@pytest.mark.parametrize("allow_revisit", [False, True])
def test_random_tables_match_brute_force(allow_revisit):
    rng = random.Random(20240611)
    outcomes = {"route": 0, "no_route": 0, "multi_hop": 0}
    for _ in range(200):
        peers, client_rtts, exclude, min_kv = _random_table(rng)
        expected = _brute_force(peers, client_rtts, exclude=exclude, min_kv=min_kv, allow_revisit=allow_revisit)
        kwargs = dict(client_rtts_ms=client_rtts, exclude=frozenset(exclude), min_free_kv_tokens=min_kv,
                      allow_revisit=allow_revisit)
        if expected is None:
            with pytest.raises(NoRoute):
                plan_route(peers, **kwargs)
            outcomes["no_route"] += 1
            continue
        route = plan_route(peers, **kwargs)
        assert_valid_route(route, route.num_layers, allow_revisit=allow_revisit)
        assert not set(route.peer_ids) & exclude
        assert all(not min_kv or h.peer.free_kv_tokens >= min_kv for h in route.hops)
        assert route.estimated_ms_per_token == pytest.approx(expected)
        assert estimate_ms_per_token(route.hops, client_rtts_ms=client_rtts) == pytest.approx(expected)
        outcomes["route"] += 1
        outcomes["multi_hop"] += len(route.hops) > 1
    assert min(outcomes.values()) > 20, outcomes  # the generator exercises every outcome


def test_random_wrap_tables_match_brute_force_with_and_without_revisits():
    rng = random.Random(99)
    revisits = 0
    for _ in range(200):
        peers, client_rtts, _, _ = _random_wrap_table(rng)
        free = plan_route(peers, client_rtts_ms=client_rtts, allow_revisit=True)
        assert_valid_route(free, free.num_layers, allow_revisit=True)
        assert free.estimated_ms_per_token == pytest.approx(
            _brute_force(peers, client_rtts, exclude=set(), min_kv=0, allow_revisit=True))
        once = plan_route(peers, client_rtts_ms=client_rtts)
        assert_valid_route(once, once.num_layers)
        assert once.estimated_ms_per_token == pytest.approx(
            _brute_force(peers, client_rtts, exclude=set(), min_kv=0, allow_revisit=False))
        revisits += len(set(free.peer_ids)) < len(free.hops)
    assert revisits > 20, revisits  # the search without revisits had to differ that often


def test_planner_is_deterministic_under_input_order():
    rng = random.Random(7)
    for _ in range(50):
        peers, client_rtts, exclude, min_kv = _random_table(rng)
        results = []
        for order in (peers, peers[::-1]):
            try:
                results.append(chain(plan_route(order, client_rtts_ms=client_rtts, exclude=frozenset(exclude),
                                                min_free_kv_tokens=min_kv)))
            except NoRoute as exc:
                results.append(str(exc))
        assert results[0] == results[1]


def test_larger_table_plans_quickly():
    # 80 layers, 40 peers with overlapping ranges, every link measured: the search stays small.
    rng = random.Random(3)
    peers = []
    for i in range(40):
        start = rng.randrange(0, 80, 4)
        stop = min(80, start + rng.choice([8, 16, 24, 80]))
        peers.append(peer(f"p{i:02d}", start, stop - 1, num_layers=80, compute_ms=float(rng.randint(5, 90)),
                          rtts={f"p{j:02d}": float(rng.randint(1, 60)) for j in range(40) if j != i}))
    peers.append(peer("head", 0, 79, num_layers=80, compute_ms=400.0))
    route = plan_route(peers, client_rtts_ms={p.peer_id: float(rng.randint(1, 60)) for p in peers})
    assert_valid_route(route, 80)


def test_a_checkable_route_beats_a_faster_one_nobody_can_check():
    """A lone peer advertising every layer at 0 ms would take every route alone; with
    checkable=True each hop runs layers another peer serves whole, so a spot-check can catch it."""
    liar, a, b = peer("liar", 0, 23, compute_ms=0.0), peer("a", 0, 11), peer("b", 12, 23)
    rtts = {"liar": 1.0, "a": 1.0, "b": 1.0}
    assert chain(plan_route([liar, a, b], client_rtts_ms=rtts)) == [("liar", "0-23")]
    route = plan_route([liar, a, b], client_rtts_ms=rtts, checkable=True)
    assert_valid_route(route, 24)
    assert all(any(q.peer_id != h.peer_id and q.layers.start <= h.layers.start and h.layers.stop <= q.layers.stop
                   for q in (liar, a, b)) for h in route.hops)
    assert chain(route) in ([("liar", "0-11"), ("b", "12-23")], [("a", "0-11"), ("liar", "12-23")])
    assert chain(plan_route([liar, a, b], client_rtts_ms=rtts, checkable=True, trusted={"liar"})) == \
        [("liar", "0-23")]  # a trusted (allowlisted) peer needs no check


def test_checkable_planning_falls_back_when_no_route_can_be_checked():
    a, b = peer("a", 0, 11), peer("b", 12, 23)  # no twins at all
    assert chain(plan_route([a, b], client_rtts_ms={}, checkable=True)) == [("a", "0-11"), ("b", "12-23")]


def test_peers_of_two_precisions_get_a_hint_of_what_to_do():
    """A new user's run: a gguf-a8 peer on 0-11 and an f32 peer on 12-23; the error said what was
    wrong but not what to do."""
    mixed = [peer("a", 0, 11, precision="gguf-a8"), peer("b", 12, 23)]
    with pytest.raises(NoRoute) as err:
        plan_route(mixed, client_rtts_ms={})
    assert ("(peers of different precisions, f32, gguf-a8, never chain: start the peers of one route with the "
            "same --dtype, or add peers so that one precision covers every layer)") in str(err.value)
    with pytest.raises(NoRoute) as err:  # an advert's own precision string is never printed by the hint
        plan_route([peer("a", 0, 11, precision="\x1b]0;owned\x07"), peer("b", 12, 23)], client_rtts_ms={})
    assert "never chain" not in str(err.value)
    with pytest.raises(NoRoute) as err:  # one precision on two device types: the backend note says why
        plan_route([peer("a", 0, 11, precision="bf16", device="cpu"), peer("b", 12, 23, precision="bf16", device="cuda")],
                   client_rtts_ms={})
    assert "never chain" not in str(err.value)


def test_a_precision_other_than_f32_chains_only_on_one_device_type():
    """f32 chooses the same tokens on every backend, so a CPU and a CUDA peer chain; any other
    precision is repeatable only on one kind of backend, so they do not, and the error says why
    (issue 13, the route gate). Two CUDA devices are one kind."""
    f32 = [peer("c", 0, 11, device="cpu"), peer("d", 12, 23, device="cuda:0")]
    assert plan_route(f32, client_rtts_ms={}).peer_ids == ("c", "d")
    mixed = [peer("a", 0, 11, precision="bf16", device="cpu"), peer("b", 12, 23, precision="bf16", device="cuda")]
    with pytest.raises(NoRoute) as err:
        plan_route(mixed, client_rtts_ms={})
    message = str(err.value)
    assert "bf16 on cpu" in message and "bf16 on cuda" in message, message
    assert "bf16 peers on cpu and cuda do not chain: only f32 gives the same tokens on every device type" in message
    gpus = [peer("a", 0, 11, precision="q8-bf16", device="cuda:0"), peer("b", 12, 23, precision="q8-bf16",
                                                                          device="cuda:1")]
    assert plan_route(gpus, client_rtts_ms={}).peer_ids == ("a", "b")
    groups = {g.identity: g.route is not None for g in complete_routes_summary(mixed + f32)}
    assert groups == {"weights " + HASH_A[:12] + " f32": True, "weights " + HASH_A[:12] + " bf16 on cpu": False,
                      "weights " + HASH_A[:12] + " bf16 on cuda": False}


def test_an_old_peers_removed_precision_is_only_a_precision_nobody_else_shares():
    """q4-gG-bf16 was removed on 2026-12-02, but a peer that predates that still advertises it:
    the advert validates (precision is any string on the wire) and such peers never chain with
    peers at another precision; the route takes the current peers, and the error names it."""
    old = PeerAdvert.from_wire(peer("old", 12, 23, precision="q4-g32-bf16").to_wire())
    assert old.precision == "q4-g32-bf16"
    with pytest.raises(NoRoute) as err:
        plan_route([peer("a", 0, 11, precision="q8-bf16"), old], client_rtts_ms={})
    assert "weights 1d9614638d18 q4-g32-bf16" in str(err.value) and "weights 1d9614638d18 q8-bf16" in str(err.value)
    route = plan_route([peer("a", 0, 11, precision="q8-bf16"), old, peer("b", 12, 23, precision="q8-bf16")],
                       client_rtts_ms={})
    assert chain(route) == [("a", "0-11"), ("b", "12-23")] and route.compat_key[1] == "q8-bf16"
