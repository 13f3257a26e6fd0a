"""KV budgets, context limits, long prompts and repeated use on an in-process tiny-model mesh."""

from __future__ import annotations

import asyncio

import pytest

from helpers.convauth import authorize
from helpers.meshkit import mesh, start_peer, wait_for_tables
from meshinfer.core.config import LayerRange
from meshinfer.peer.conversations import STATEMENT_BYTES_PER_TOKEN as STATEMENT, STATEMENT_OVERHEAD_BYTES
from meshinfer.core.errors import CacheFull, ContextOverflow
from meshinfer.peer.node import ClientLimits
from meshinfer.engine.generate import greedy_generate, load_shard
from meshinfer.client.mesh import MeshClient


TINY_MODEL = {"context": 4096, "seed": 11}  # tokens of context; the seed of its weights


def expected(tiny, ids, n):
    return greedy_generate(tiny[3], ids, max_tokens=n).token_ids


async def test_full_budget_is_refused_and_the_next_conversation_goes_elsewhere(tiny):
    path, digest, tok, _ = tiny
    per_token = 2 * 2 * 2 * 8 * 4 + 4 * 32 + STATEMENT  # K+V of layers 2-3 is on the last hop; hop 1 also logs C floats
    first = await start_peer(load_shard(path, LayerRange(0, 2)), weights_hash=digest, bundle=tok.to_bundle())
    small = await start_peer(load_shard(path, LayerRange(2, 4)), weights_hash=digest, bootstrap=first.addrs,
                             kv_budget_bytes=150 * (2 * 2 * 2 * 8 * 4 + STATEMENT),  # 150 tokens, all for one host
                             client_limits=ClientLimits(kv_share=1.0))
    big = await start_peer(load_shard(path, LayerRange(2, 4)), weights_hash=digest, bootstrap=first.addrs,
                           kv_budget_bytes=10_000 * per_token)
    try:
        await wait_for_tables([first, small, big])
        assert small.free_kv_tokens == 150
        async with MeshClient(list(first.addrs)) as client:
            route = await client.plan()
            ids = tok.encode_chat([{"role": "user", "content": "fill me"}])
            # force the small peer first, as a planner with stale adverts would
            forced = type(route)(hops=(route.hops[0], type(route.hops[1])(small.advert(), LayerRange(2, 4))),
                                 estimated_ms_per_token=1.0, compat_key=route.compat_key)
            conv = client.conversation(forced, max_tokens_total=140)
            out = await conv.generate(ids, max_tokens=4, eos_ids=())
            assert out.token_ids == expected(tiny, ids, 4) and small.free_kv_tokens == 10
            second = client.conversation(forced, max_tokens_total=140)
            out2 = await second.generate(ids, max_tokens=4, eos_ids=())
            assert second.route.peer_ids[1] == big.peer_id  # refused by small, planned around it
            assert out2.token_ids == out.token_ids
            with pytest.raises(CacheFull, match="needs 140 tokens of KV cache; this peer has 10 free of 150"):
                await client._links[small.peer_id].request("open", timeout_s=5, **authorize(
                    "open", dict(conv="x", layers=[2, 4], max_tokens=140, prev=first.peer_id), small.peer_id))
            await conv.close()
            await second.close()
    finally:
        for p in (big, small, first):
            await p.close()


async def test_a_full_peer_with_no_other_route_is_reported_as_full(tiny):
    """The one peer of layers 2-3 has room for 150 tokens and holds 140: the next conversation
    gets cache_full naming that peer and the numbers, not "no route ... is excluded"."""
    path, digest, tok, _ = tiny
    first = await start_peer(load_shard(path, LayerRange(0, 2)), weights_hash=digest, bundle=tok.to_bundle())
    small = await start_peer(load_shard(path, LayerRange(2, 4)), weights_hash=digest, bootstrap=first.addrs,
                             kv_budget_bytes=150 * (2 * 2 * 2 * 8 * 4 + STATEMENT),  # 150 tokens, all for one host
                             client_limits=ClientLimits(kv_share=1.0))
    try:
        await wait_for_tables([first, small])
        async with MeshClient(list(first.addrs)) as client:
            route = await client.plan()
            ids = tok.encode_chat([{"role": "user", "content": "fill me"}])
            held = client.conversation(route, max_tokens_total=140)
            await held.generate(ids, max_tokens=2, eos_ids=())
            second = client.conversation(route, max_tokens_total=140)
            with pytest.raises(CacheFull) as err:
                await second.generate(ids, max_tokens=2, eos_ids=())
            assert err.value.code == "cache_full"
            assert str(err.value).startswith(
                f"peer {small.peer_id[:12]} is full: conversation needs 140 tokens of KV cache; this peer has "
                f"10 free of 150; no other route has room (no route: layers 2-3 have no ready peer")
            assert second.conv_id not in client._convs and second.conv_id not in first.convs
            await held.close()
    finally:
        for p in (small, first):
            await p.close()


async def test_the_statements_a_hop_keeps_count_in_its_kv_budget_and_usage(tiny):
    """A hop past layer 0 keeps, per position, its previous hop's signed statement: each
    reserved token costs ``STATEMENT_BYTES_PER_TOKEN`` more of the budget, and the bytes a
    conversation holds count each statement it keeps once."""
    path, digest, tok, _ = tiny
    async with mesh([load_shard(path, LayerRange(0, 2)), load_shard(path, LayerRange(2, 4))],
                    weights_hash=digest, bundle=tok.to_bundle(), kv_budget_bytes=1 << 20) as peers:
        second = peers[1]
        assert second.capacity_tokens == (1 << 20) // (2 * 2 * 2 * 8 * 4 + STATEMENT)
        async with MeshClient(list(peers[0].addrs)) as client:
            conv = client.conversation(await client.plan(), max_tokens_total=64)
            out = await conv.generate([65, 66, 67], max_tokens=5, eos_ids=())
            held = second.convs[conv.conv_id]
            assert len(held.signed_at) == held.cache.length == 3 + len(out.token_ids) - 1
            distinct = {id(st): st for st in held.signed_at}.values()  # the prompt's step, then one per token
            assert held.statement_bytes == sum(len(st[2]) + len(st[3]) + STATEMENT_OVERHEAD_BYTES for st in distinct) + 8 * 7
            assert second.kv_bytes_used == held.cache.nbytes + held.statement_bytes
            await conv.close()
        await asyncio.sleep(0.1)
        assert second.kv_bytes_used == 0


async def test_prompt_beyond_context_is_refused_before_any_allocation(tiny):
    path, digest, tok, _ = tiny
    async with mesh([load_shard(path, LayerRange(0, 2)), load_shard(path, LayerRange(2, 4))],
                    weights_hash=digest, bundle=tok.to_bundle()) as peers:
        async with MeshClient(list(peers[0].addrs)) as client:
            route = await client.plan()
            conv = client.conversation(route, max_tokens_total=4096)
            with pytest.raises(ContextOverflow, match=r"prompt \(4000 tokens\) \+ max_tokens \(200\) = 4200 "
                                                      r"exceeds the conversation's reserved context of 4096"):
                await conv.generate([65] * 4000, max_tokens=200, eos_ids=())
            assert all(not p.convs and p.kv_bytes_used == 0 for p in peers)
            too_big = client.conversation(route, max_tokens_total=5000)
            with pytest.raises(ContextOverflow, match="asks for 5000 tokens; the model's context is 4096"):
                await too_big.generate([65] * 10, max_tokens=5, eos_ids=())
            assert all(not p.convs for p in peers)
            at_limit = client.conversation(route, max_tokens_total=4096)
            out = await at_limit.generate([65] * 4090, max_tokens=None, eos_ids=())
            assert out.finish_reason == "length" and len(out.token_ids) == 6
            await at_limit.close()


async def test_long_prompt_crosses_hops_in_chunks(tiny):
    path, digest, tok, _ = tiny
    ids = tok.encode(("a long prompt about meshes, hops and routes. " * 80))[:3000]
    assert len(ids) == 3000
    async with mesh([load_shard(path, LayerRange(0, 2)), load_shard(path, LayerRange(2, 4))],
                    weights_hash=digest, bundle=tok.to_bundle(), max_step_tokens=512) as peers:
        async with MeshClient(list(peers[0].addrs)) as client:
            conv = client.conversation(await client.plan(), max_tokens_total=3010)
            out = await conv.generate(ids, max_tokens=5, eos_ids=())
            await conv.close()
    assert out.token_ids == expected(tiny, ids, 5)


async def test_twenty_conversations_in_a_row_memory_stays_flat(tiny):
    path, digest, tok, _ = tiny
    async with mesh([load_shard(path, LayerRange(0, 2)), load_shard(path, LayerRange(2, 4))],
                    weights_hash=digest, bundle=tok.to_bundle()) as peers:
        baseline = [(p.kv_bytes_used, p.free_kv_tokens, len(p._tasks)) for p in peers]
        async with MeshClient(list(peers[0].addrs)) as client:
            route = await client.plan()
            for i in range(20):
                ids = tok.encode_chat([{"role": "user", "content": "x" * (5 + 37 * i % 300)}])
                n = 1 + (7 * i) % 12
                conv = client.conversation(route, max_tokens_total=len(ids) + n)
                out = await conv.generate(ids, max_tokens=n, eos_ids=())
                await conv.close()
                assert out.token_ids == expected(tiny, ids, n), i
        await asyncio.sleep(0.2)
        assert [(p.kv_bytes_used, p.free_kv_tokens) for p in peers] == [b[:2] for b in baseline]
        # no task per conversation is left behind (gossip exchanges in flight come and go)
        assert all(len(p._tasks) <= b[2] + 3 for p, b in zip(peers, baseline))


def test_statements_are_counted_once_each_and_a_conversation_cannot_pin_past_its_allowance():
    """``Conv.keep_signed``/``drop_signed``: a statement is counted once while any position
    holds it, released when the last goes, and a conversation that cuts long steps back to one
    position again and again (each cut pins a whole step's digests: found by an attack run,
    669-746 bytes a position against 320 counted) is refused past ``STATEMENT_BYTES_PER_TOKEN``
    a reserved token."""
    from meshinfer.peer.conversations import Conv

    conv = Conv(conv_id="c", run=LayerRange(2, 4), owner=None, prev_id="p", next_id=None, next_addrs=(),
                reserved_tokens=200, cache=None)

    def held() -> int:
        distinct = {id(s): s for s in conv.signed_at if s is not None}.values()
        return sum(len(s[2]) + len(s[3]) + STATEMENT_OVERHEAD_BYTES for s in distinct) + 8 * len(conv.signed_at)

    conv.keep_signed(1, 0, bytes(16 * 100), bytes(64))  # a 100-position prefill chunk
    assert conv.statement_bytes == held() == 1600 + 64 + STATEMENT_OVERHEAD_BYTES + 800
    conv.keep_signed(2, 100, bytes(16), bytes(64))
    conv.drop_signed(50, len(conv.signed_at))  # truncated: the chunk's statement is still held by 50
    assert len(conv.signed_at) == 50 and conv.statement_bytes == held()
    conv.keep_signed(3, 10, bytes(16 * 5), bytes(64), replay=True)  # a replay of 5 kept positions
    assert conv.statement_bytes == held()
    refused = 0
    for k in range(50, 150):  # 100-position steps cut back to one position each time
        if not conv.statements_fit(bytes(16 * 100), bytes(64)):
            refused = k
            break
        conv.keep_signed(k, k, bytes(16 * 100), bytes(64))
        conv.drop_signed(k + 1, len(conv.signed_at))
        assert conv.statement_bytes == held()
    assert refused and conv.statement_bytes <= 200 * STATEMENT
    conv.drop_signed(0, len(conv.signed_at))
    assert conv.statement_bytes == 0 and conv._holders == {}
