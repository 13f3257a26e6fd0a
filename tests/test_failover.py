"""Failover with replay on an in-process mesh of a tiny model: 3 hops plus a standby middle."""

from __future__ import annotations

import asyncio
import threading

import pytest

from helpers.meshkit import crash, file_hash, start_peer, wait_for_tables
from meshinfer.core.config import LayerRange
from meshinfer.core.errors import NoRoute, PeerUnavailable
from meshinfer.engine.generate import greedy_generate, load_shard
from meshinfer.client.mesh import MeshClient
from meshinfer.text.tokenizer import Tokenizer
from helpers.tiny import random_weights, tiny_config, write_gguf

N_TOKENS = 50
#: Per-step deadline floor of these tests, seconds. Far above a step of either model even on one
#: loaded core (a decode step of the real default model takes about 0.1 s on a quiet core), so a
#: slow machine cannot turn a healthy step into a failover; the stall test holds its hop for
#: STALL_S, longer than the deadline plus the failover.
DEADLINE_FLOOR_S = 10.0
STALL_S = 120.0
PROMPT = [{"role": "user", "content": "tell me a long story about meshes and hops"}]


@pytest.fixture(scope="module", params=["tiny", pytest.param("default", marks=pytest.mark.realmodel)])
def model(request, tmp_path_factory):
    """(shard factory, weights hash, tokenizer, prompt ids, uninterrupted tokens, standby range)."""
    if request.param == "tiny":
        cfg = tiny_config("qwen2", context=256)
        path = write_gguf(tmp_path_factory.mktemp("failover") / "tiny.gguf", cfg, random_weights(cfg, seed=7))
        tok = Tokenizer.from_gguf(path)
        ids = tok.encode_chat(PROMPT)
        factory = lambda r: load_shard(path, r)  # noqa: E731
        bounds = (0, 1, 3, 4)
    else:
        from helpers.realmodels import model_path
        from helpers.realmodels import DEFAULT, load_cases, shard_of

        path = model_path(DEFAULT)
        tok = Tokenizer.from_gguf(path)
        ids = load_cases(DEFAULT)["prime"]["prompt_ids"]
        factory = lambda r: shard_of(DEFAULT, r.start, r.stop)  # noqa: E731
        bounds = (0, 8, 16, 24)
    whole = factory(LayerRange(bounds[0], bounds[-1]))
    expected = greedy_generate(whole, ids, max_tokens=N_TOKENS).token_ids
    return factory, file_hash(path), tok, ids, expected, bounds


async def start_mesh(model, **settings):
    """Hops over ``bounds`` plus a standby for the middle range; returns (first, middles, last)."""
    factory, digest, tok, _, _, (a, b, c, d) = model
    first = await start_peer(factory(LayerRange(a, b)), weights_hash=digest, bundle=tok.to_bundle(), **settings)
    rest = [await start_peer(factory(r), weights_hash=digest, bootstrap=first.addrs, **settings)
            for r in (LayerRange(b, c), LayerRange(b, c), LayerRange(c, d))]
    await wait_for_tables([first, *rest])
    return first, rest[:2], rest[2]


async def run_with_fault(model, fault, *, before_close=None, **settings):
    """Generate N_TOKENS greedily while ``fault(conversation, middle_peer)`` strikes;
    ``before_close()`` runs once the conversation is closed, before the peers are."""
    ids = model[3]
    first, middles, last = await start_mesh(model, **settings)
    try:
        async with MeshClient(list(first.addrs)) as client:
            route = await client.plan()
            mid = next(p for p in middles if p.peer_id == route.hops[1].peer_id)
            standby = next(p for p in middles if p is not mid)
            conv = client.conversation(route, max_tokens_total=len(ids) + N_TOKENS, deadline_floor_s=DEADLINE_FLOOR_S)
            hook = await fault(conv, mid)
            out = await conv.generate(ids, max_tokens=N_TOKENS, eos_ids=(), on_token=hook)
            await conv.close()
            return out, mid, standby, first, last, conv
    finally:
        if before_close is not None:
            before_close()
        for p in (first, *middles, last):
            await p.close()


async def test_middle_hop_killed_mid_generation(model):
    async def fault(conv, mid):
        def on_token(_):
            # after 10 generated tokens (>=: a speculative step may add several at once)
            if len(conv.cached) - len(model[3]) >= 9 and not mid._closing:
                asyncio.ensure_future(crash(mid))
        return on_token

    out, mid, standby, first, last, conv = await run_with_fault(model, fault)
    print("failover:", out.failovers)
    assert out.token_ids == model[4]
    assert len(out.failovers) == 1 and out.failovers[0]["failed"] == [mid.peer_id]
    assert out.failovers[0]["kept_hops"] == 2 and out.failovers[0]["seconds"] > 0
    assert conv.route.peer_ids == (first.peer_id, standby.peer_id, last.peer_id)


async def test_middle_hop_stalls(model):
    release = threading.Event()

    async def fault(conv, mid):
        real = mid.shard.forward

        def stuck(x, start, *args, **kwargs):
            if start >= len(model[3]) + 10:
                release.wait(STALL_S)  # the device thread hangs before the pass; the event loop still answers
            return real(x, start, *args, **kwargs)

        mid.shard.forward = stuck
        return None

    # the stuck thread is let go only once the client is done, so nothing it sends late can reach
    # the conversation, and closing the stalled peer (which joins its device thread) does not wait
    # out STALL_S
    try:
        out, mid, standby, first, last, conv = await run_with_fault(model, fault, before_close=release.set)
    finally:
        release.set()
    assert out.token_ids == model[4]
    assert [f["failed"] for f in out.failovers] == [[mid.peer_id]]
    assert "no token" in out.failovers[0]["reason"]


async def test_failover_back_to_a_hop_that_still_holds_the_conversation(model):
    """A hop that failed by stalling still holds the conversation when a later failover routes
    through it again (the standby failed too, and its backoff ran out): the client closes it
    there and opens it afresh. It used to be refused with "conversation ... is already open".
    Driven through ``_failover`` directly, so no deadline or timing decides what happens."""
    ids, expected = model[3], model[4]
    first, middles, last = await start_mesh(model)
    try:
        async with MeshClient(list(first.addrs)) as client:
            route = await client.plan()
            mid = next(p for p in middles if p.peer_id == route.hops[1].peer_id)
            standby = next(p for p in middles if p is not mid)
            conv = client.conversation(route, max_tokens_total=len(ids) + N_TOKENS, speculate=False)
            head = (await conv.generate(ids, max_tokens=5, eos_ids=())).token_ids
            await conv._failover(PeerUnavailable("mid stalled"), in_flight=len(conv.cached), failed={mid.peer_id})
            assert conv.route.hops[1].peer_id == standby.peer_id and conv.conv_id in mid.convs
            client._failed.pop(mid.peer_id)  # its backoff is over
            await conv._failover(PeerUnavailable("standby stalled"), in_flight=len(conv.cached),
                                 failed={standby.peer_id})
            assert conv.route.peer_ids == (first.peer_id, mid.peer_id, last.peer_id)
            tail = (await conv.generate(ids + head, max_tokens=N_TOKENS - 5, eos_ids=())).token_ids
            assert head + tail == expected
            assert mid.convs[conv.conv_id].cache.length == len(ids) + N_TOKENS - 1
            await conv.close()
    finally:
        for p in (first, *middles, last):
            await p.close()


async def test_middle_hop_killed_during_prefill(model):
    async def fault(conv, mid):
        real = mid._on_step

        async def on_step(link, f):
            await real(link, f)
            asyncio.ensure_future(crash(mid))  # dies after the first prefill chunk arrives

        mid._on_step = on_step
        return None

    out, mid, standby, first, last, conv = await run_with_fault(model, fault, max_step_tokens=8)
    assert out.token_ids == model[4]
    assert [f["failed"] for f in out.failovers] == [[mid.peer_id]]
    assert out.failovers[0]["replayed_tokens"] == 0


async def test_no_route_left_gives_a_clear_error_in_bounded_time(model):
    ids, (_, b, c, _) = model[3], model[5]
    first, middles, last = await start_mesh(model)
    try:
        async with MeshClient(list(first.addrs), request_timeout_s=2.0) as client:
            route = await client.plan()
            conv = client.conversation(route, max_tokens_total=len(ids) + N_TOKENS, deadline_floor_s=1.0)
            await conv.generate(ids, max_tokens=2, eos_ids=())
            for p in middles:
                await crash(p)
            async with asyncio.timeout(60):
                with pytest.raises(NoRoute, match=f"layers {b}-{c - 1} have no ready peer"):
                    await conv.generate(ids + [5, 6], max_tokens=3, eos_ids=())
    finally:
        for p in (first, *middles, last):
            await p.close()
