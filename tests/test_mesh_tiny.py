"""A real in-process mesh (websockets on 127.0.0.1, port 0) with a tiny random model."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from helpers.convauth import authorize, conv_id
from helpers.meshkit import file_hash, mesh, split, start_peer, wait_for_tables
from meshinfer.wire import protocol
from meshinfer.core.config import LayerRange
from meshinfer.core.errors import (CacheFull, ContextOverflow, LayerRangeError, NoRoute,
    PositionError)
from meshinfer.engine.generate import greedy_generate, load_shard
from meshinfer.peer.launch import launch_peer
from meshinfer.peer import steps
from meshinfer.peer.conversations import STATEMENT_BYTES_PER_TOKEN
from meshinfer.peer.node import PeerSettings
from meshinfer.client.mesh import MeshClient
from meshinfer.text.tokenizer import Tokenizer
from meshinfer.wire.transport import dial


async def test_a_failing_bootstrap_address_is_a_warning_once_per_reason(tiny, caplog):
    """A wrong scheme in ``join --peers`` left a peer that looked ready but never joined, with
    the reason at debug level only."""
    path, digest, _, whole = tiny
    a = await start_peer(whole, weights_hash=digest)
    url = a.addrs[0].replace("ws://", "wss://")
    try:
        with caplog.at_level(logging.DEBUG, logger="meshinfer.peer.node"):
            b = await start_peer(whole, weights_hash=digest, bootstrap=(url,))
            await asyncio.sleep(12 * b.settings.gossip_interval_s)  # a dozen rounds of retries
            await b.close()
    finally:
        await a.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and url in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"cannot join the mesh through {url} yet (retrying every "
                                  f"{b.settings.gossip_interval_s:g} s): cannot reach {url}: TLS handshake failed (")
    assert warnings[0].endswith("; if the peer serves plain websockets, use ws://")
    assert sum(r.levelno == logging.DEBUG and f"bootstrap {url}:" in r.getMessage() for r in caplog.records) >= 3


MESSAGES = [{"role": "user", "content": "hello there, tiny model"}]


def reference(tiny, prompt_ids, max_tokens=12):
    path, _, tok, whole = tiny
    return greedy_generate(whole, prompt_ids, max_tokens=max_tokens, eos_ids=tok.eos_ids).token_ids


async def ask(client: MeshClient, tok: Tokenizer, messages=MESSAGES, max_tokens=12, **plan):
    route = await client.plan(**plan)
    conv = client.conversation(route, max_tokens_total=128)
    try:
        ids = tok.encode_chat(messages)
        return route, ids, await conv.generate(ids, max_tokens=max_tokens, eos_ids=tok.eos_ids)
    finally:
        await conv.close()


@pytest.mark.parametrize("bounds", [[0, 2, 4], [0, 1, 3, 4]], ids=["2-peers", "3-peers"])
async def test_chain_equals_single_process(tiny, bounds):
    path, digest, tok, _ = tiny
    shards = split(lambda r: load_shard(path, r), bounds)
    async with mesh(shards, weights_hash=digest, bundle=tok.to_bundle()) as peers:
        async with MeshClient(list(peers[0].addrs)) as client:
            route, ids, out = await ask(client, tok)
    assert [h.layers for h in route.hops] == [LayerRange(a, b) for a, b in zip(bounds, bounds[1:])]
    assert out.token_ids == reference(tiny, ids)
    assert len(out.route) == len(bounds) - 1 and all(h["compute_ms_per_token"] > 0 for h in out.route)


async def test_overlapping_peers_run_sub_ranges(tiny):
    path, digest, tok, _ = tiny
    shards = [load_shard(path, LayerRange(0, 3)), load_shard(path, LayerRange(1, 4))]
    async with mesh(shards, weights_hash=digest, bundle=tok.to_bundle()) as peers:
        async with MeshClient(list(peers[0].addrs)) as client:
            route, ids, out = await ask(client, tok)
    assert sum(len(h.layers) for h in route.hops) == 4
    assert out.token_ids == reference(tiny, ids)


async def test_client_never_sends_or_receives_hidden_states(tiny, monkeypatch):
    path, digest, tok, _ = tiny
    seen = []
    real_decode = protocol.decode

    def spy(frame, *, max_bytes):
        msg_type, f = real_decode(frame, max_bytes=max_bytes)
        seen.append((msg_type, set(f.d)))
        return msg_type, f

    shards = split(lambda r: load_shard(path, r), [0, 2, 4])
    async with mesh(shards, weights_hash=digest, bundle=tok.to_bundle()) as peers:
        import meshinfer.wire.transport as transport
        async with MeshClient(list(peers[0].addrs)) as client:
            route = await client.plan()
            await client.tokenizer(route)
            monkeypatch.setattr(transport.protocol, "decode", spy)  # frames decoded from now on
            sent = []
            real_send = transport.Link.send

            async def send_spy(self, msg_type, **fields):
                if self in client._links.values():
                    sent.append((msg_type, set(fields)))
                return await real_send(self, msg_type, **fields)

            monkeypatch.setattr(transport.Link, "send", send_spy)
            conv = client.conversation(route, max_tokens_total=64)
            await conv.generate(tok.encode_chat(MESSAGES), max_tokens=5, eos_ids=())
            await conv.close()
    client_steps = [fields for t, fields in sent if t == "step"]
    assert client_steps and all("tokens" in f and "hidden" not in f for f in client_steps)
    hop_to_hop = [fields for t, fields in seen if t == "step" and "hidden" in fields]
    assert hop_to_hop, "the hops did exchange hidden states"
    received_by_client = [t for t, _ in seen if t == "token"]
    assert received_by_client and not any("hidden" in f for t, f in seen if t == "token")


async def test_reuse_sequential_and_concurrent_then_memory_at_baseline(tiny):
    path, digest, tok, _ = tiny
    shards = split(lambda r: load_shard(path, r), [0, 2, 4])
    prompts = [[{"role": "user", "content": f"q{i} " * (i + 1)}] for i in range(9)]
    async with mesh(shards, weights_hash=digest, bundle=tok.to_bundle()) as peers:
        baseline = [(p.kv_bytes_used, p.free_kv_tokens) for p in peers]
        async with MeshClient(list(peers[0].addrs)) as client:
            for msgs in prompts[:5]:
                _, ids, out = await ask(client, tok, msgs)
                assert out.token_ids == reference(tiny, ids)
            results = await asyncio.gather(*(ask(client, tok, msgs) for msgs in prompts[5:]))
            for _, ids, out in results:
                assert out.token_ids == reference(tiny, ids)
        await asyncio.sleep(0.2)
        assert [(p.kv_bytes_used, p.free_kv_tokens) for p in peers] == baseline
        assert all(not p.convs for p in peers)


async def test_multi_turn_reuses_cache_and_matches_fresh_run(tiny):
    path, digest, tok, _ = tiny
    shards = split(lambda r: load_shard(path, r), [0, 2, 4])
    async with mesh(shards, weights_hash=digest, bundle=tok.to_bundle()) as peers:
        async with MeshClient(list(peers[0].addrs)) as client:
            route = await client.plan()
            conv = client.conversation(route, max_tokens_total=200)
            msgs = list(MESSAGES)
            first = await conv.generate(tok.encode_chat(msgs), max_tokens=6, eos_ids=())
            msgs += [{"role": "assistant", "content": tok.decode(first.token_ids)},
                     {"role": "user", "content": "and again"}]
            ids = tok.encode_chat(msgs)
            cached_before = len(conv.cached)
            second = await conv.generate(ids, max_tokens=6, eos_ids=tok.eos_ids)
            await conv.close()
    assert cached_before > len(tok.encode_chat(MESSAGES))
    assert second.token_ids == reference(tiny, ids, 6)


async def test_client_disconnect_frees_cache(tiny):
    path, digest, tok, _ = tiny
    shards = split(lambda r: load_shard(path, r), [0, 2, 4])
    async with mesh(shards, weights_hash=digest, bundle=tok.to_bundle()) as peers:
        client = MeshClient(list(peers[0].addrs))
        route = await client.plan()
        conv = client.conversation(route, max_tokens_total=64)
        await conv.generate(tok.encode_chat(MESSAGES), max_tokens=3, eos_ids=())
        assert all(p.convs for p in peers)
        for link in client._links.values():  # drop the sockets without a close frame
            link.ws.transport.abort()
        async with asyncio.timeout(5):
            while any(p.convs for p in peers):
                await asyncio.sleep(0.05)
        assert all(p.kv_bytes_used == 0 for p in peers)
        async with MeshClient(list(peers[0].addrs)) as again:
            _, ids, out = await ask(again, tok)
        assert out.token_ids == reference(tiny, ids)


async def test_no_mixing_of_weights_or_precision(tiny, tmp_path):
    path, digest, tok, _ = tiny
    other = tmp_path / "other.gguf"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # one byte of the last tensor changed
    other.write_bytes(bytes(data))
    other_digest = file_hash(other)
    assert other_digest != digest
    first = await start_peer(load_shard(path, LayerRange(0, 2)), weights_hash=digest, bundle=tok.to_bundle())
    odd = await start_peer(load_shard(other, LayerRange(2, 4)), weights_hash=other_digest,
                           bootstrap=first.addrs)
    half = await start_peer(load_shard(path, LayerRange(2, 4), dtype=torch.bfloat16), weights_hash=digest,
                            precision="bf16", bootstrap=first.addrs)
    try:
        await wait_for_tables([first, odd, half])
        async with MeshClient(list(first.addrs)) as client:
            with pytest.raises(NoRoute) as err:
                await client.plan()
        text = str(err.value)
        assert digest[:12] in text and other_digest[:12] in text and "bf16" in text
        good = await start_peer(load_shard(path, LayerRange(2, 4)), weights_hash=digest, bootstrap=first.addrs)
        try:
            await wait_for_tables([first, odd, half, good])
            async with MeshClient(list(first.addrs)) as client:
                route, ids, out = await ask(client, tok)
            assert route.peer_ids == (first.peer_id, good.peer_id)
            assert out.token_ids == reference(tiny, ids)
        finally:
            await good.close()
    finally:
        for p in (half, odd, first):
            await p.close()


async def test_dead_peer_expires_from_tables_within_ttl(tiny):
    path, digest, tok, _ = tiny
    shards = split(lambda r: load_shard(path, r), [0, 2, 4])
    async with mesh(shards + [load_shard(path, LayerRange(2, 4))], weights_hash=digest) as peers:
        victim = peers[2]
        await victim.close()
        ttl = victim.settings.advert_ttl_s
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        while any(p.table.get(victim.peer_id) for p in peers[:2]):
            await asyncio.sleep(0.02)
            assert loop.time() - t0 <= ttl + victim.settings.gossip_interval_s + 0.5
        assert all(p.table.get(victim.peer_id) is None for p in peers[:2])


async def test_position_gap_layer_range_and_budget_errors(tiny):
    path, digest, tok, _ = tiny
    async with mesh([load_shard(path, LayerRange(0, 4))], weights_hash=digest, bundle=tok.to_bundle(),
                    kv_budget_bytes=100 * (4 * 2 * 2 * 8 * 4 + STATEMENT_BYTES_PER_TOKEN)) as peers:
        peer = peers[0]
        link = await dial(peer.addrs[0], max_bytes=1 << 20, on_message=lambda *a: asyncio.sleep(0))
        try:
            await link.request("hello", timeout_s=5, role="client")
            with pytest.raises(LayerRangeError, match="serves layers 0-3, asked for 0-4"):
                await link.request("open", timeout_s=5,
                                   **authorize("open", dict(conv="a", layers=[0, 5], max_tokens=10), peer.peer_id))
            with pytest.raises(CacheFull, match="needs 101 tokens of KV cache; this peer has 100 free"):
                await link.request("open", timeout_s=5,
                                   **authorize("open", dict(conv="a", layers=[0, 4], max_tokens=101), peer.peer_id))
            with pytest.raises(ContextOverflow, match="context is 256 tokens"):
                await link.request("open", timeout_s=5,
                                   **authorize("open", dict(conv="a", layers=[0, 4], max_tokens=300), peer.peer_id))
            await link.request("open", timeout_s=5,
                                   **authorize("open", dict(conv="a", layers=[0, 4], max_tokens=50), peer.peer_id))
            with pytest.raises(PositionError,
                               match=f"starts at position 3; conversation {conv_id('a')} expects position 0"):
                await link.request("step", timeout_s=5,
                                   **authorize("step", dict(conv="a", seq=1, start=3, tokens=[1, 2]), peer.peer_id))
        finally:
            await link.close()


async def test_version_mismatch_is_refused_naming_both_versions(tiny):
    import msgpack
    import websockets

    path, digest, tok, _ = tiny
    async with mesh([load_shard(path, LayerRange(0, 4))], weights_hash=digest) as peers:
        async with websockets.connect(peers[0].addrs[0]) as ws:
            await ws.send(msgpack.packb({"v": 99, "t": "hello", "role": "client"}))
            reply = msgpack.unpackb(await ws.recv())
            assert reply["t"] == "error" and reply["code"] == "version_mismatch"
            assert "version 99" in reply["message"] and f"version {protocol.PROTOCOL_VERSION}" in reply["message"]
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await ws.recv()
            assert closed.value.rcvd.code == 4002


async def test_launch_peer_loads_and_serves(tiny, tmp_path):
    path, digest, tok, _ = tiny
    settings = PeerSettings(gossip_interval_s=0.1, advert_ttl_s=1.0)
    peer = await launch_peer(str(path), None, settings=settings, key_path=str(tmp_path / "k.pem"),
                             home=str(tmp_path))
    try:
        assert peer.state == protocol.READY and peer.compute_ms_per_token > 0
        assert oct((tmp_path / "k.pem").stat().st_mode & 0o777) == "0o600"
        async with MeshClient(list(peer.addrs)) as client:
            _, ids, out = await ask(client, tok)
        assert out.token_ids == reference(tiny, ids)
    finally:
        await peer.close()


async def test_idle_conversation_is_freed_after_timeout(tiny):
    path, digest, tok, _ = tiny
    async with mesh([load_shard(path, LayerRange(0, 4))], weights_hash=digest, bundle=tok.to_bundle(),
                    idle_timeout_s=0.3) as peers:
        async with MeshClient(list(peers[0].addrs)) as client:
            route = await client.plan()
            conv = client.conversation(route, max_tokens_total=64)
            await conv.generate(tok.encode_chat(MESSAGES), max_tokens=2, eos_ids=())
            assert peers[0].convs and peers[0].kv_bytes_used > 0
            async with asyncio.timeout(5):
                while peers[0].convs:
                    await asyncio.sleep(0.05)
            assert peers[0].kv_bytes_used == 0 and peers[0].free_kv_tokens == peers[0].capacity_tokens


def test_bf16_shard_stays_close_to_f32(tiny):
    path, _, tok, whole = tiny
    half = load_shard(path, dtype=torch.bfloat16)
    ids = torch.tensor([tok.encode_chat(MESSAGES)])
    a, b = whole(ids, 0, logits="all"), half(ids, 0, logits="all")
    assert b.dtype == torch.float32 and half.dtype == torch.bfloat16
    assert ((a - b).abs().max() / a.abs().max()).item() < 0.05


async def test_hop_reuses_the_connection_the_next_peer_dialed(tiny, monkeypatch):
    """Peer 2 dialed peer 1 (its bootstrap); peer 1 forwards over that link and never dials."""
    path, digest, tok, _ = tiny
    shards = split(lambda r: load_shard(path, r), [0, 2, 4])
    async with mesh(shards, weights_hash=digest, bundle=tok.to_bundle()) as peers:
        first, second = peers
        inbound = first.links[second.peer_id]
        assert inbound in first._all_links and getattr(inbound, "reader", None) is None  # accepted, not dialed

        async def no_dialing(*args, **kwargs):
            raise AssertionError("peer 1 dialed peer 2 instead of reusing its connection")

        monkeypatch.setattr(first, "_dial_any", no_dialing)
        async with MeshClient(list(first.addrs)) as client:
            _, ids, out = await ask(client, tok)
        assert out.token_ids == reference(tiny, ids)


async def test_a_client_can_ask_for_one_precision_among_complete_routes(tiny):
    """Two complete routes of the same weights, one f32 and one gguf: ``plan_for`` (``chat
    --precision``) plans over the peers of the precision asked for only, and a precision no
    peer has is refused with the precisions the mesh does have."""
    from meshinfer.app.reply import plan_for

    path, digest, tok, _ = tiny
    bounds = [LayerRange(0, 2), LayerRange(2, 4)]
    peers = []
    try:
        for precision in ("f32", "gguf"):
            for r in bounds:
                peers.append(await start_peer(load_shard(path, r, dtype=precision), weights_hash=digest,
                                              precision=precision, bundle=tok.to_bundle(),
                                              bootstrap=peers[0].addrs if peers else ()))
        await wait_for_tables(peers)
        by_id = {p.peer_id: p.precision for p in peers}
        async with MeshClient(list(peers[0].addrs)) as client:
            for precision in ("gguf", "f32"):
                route, _ = await plan_for(client, precision=precision)
                assert {by_id[h.peer_id] for h in route.hops} == {precision}
                assert [h.layers for h in route.hops] == bounds
            with pytest.raises(NoRoute, match="asked for precision q8-bf16, the mesh's peers compute at f32, gguf") as err:
                await plan_for(client, precision="q8-bf16")
            assert str(err.value).startswith("no route at precision q8-bf16: ") and "excluded" not in str(err.value)
    finally:
        for p in peers:
            await p.close()


async def test_the_advertised_compute_time_follows_served_decode_steps(tiny):
    """A peer's advertised ms per token starts from its warm-up and then follows the decode
    steps it serves (``steps.COMPUTE_EWMA_WEIGHT``): a warm-up taken while the machine was busy
    (here: a stale 1,000,000 ms) no longer steers routes once the peer has served a reply."""
    path, digest, tok, _ = tiny
    async with mesh(split(lambda r: load_shard(path, r), [0, 2, 4]), weights_hash=digest,
                    bundle=tok.to_bundle()) as peers:
        for p in peers:
            p.compute_ms_per_token = 1e6
        async with MeshClient(list(peers[0].addrs)) as client:
            conv = client.conversation(await client.plan(), max_tokens_total=128, speculate=False)
            try:
                out = await conv.generate(tok.encode_chat([{"role": "user", "content": "hi"}]), max_tokens=40,
                                          eos_ids=())
            finally:
                await conv.close()
    assert len(out.token_ids) == 40
    assert all(0 < p.compute_ms_per_token < 1e4 for p in peers), [p.compute_ms_per_token for p in peers]


def test_the_advertised_compute_time_returns_toward_idle_when_no_step_comes():
    """A burst of load raises a peer's cost; routes then avoid it, no decode step comes to
    measure it again, and it used to stay avoided for good. Without steps the cost relaxes
    toward the lowest it has been (half-life ``steps.COMPUTE_IDLE_HALF_LIFE_S``); a served
    step continues from there."""
    half = steps.COMPUTE_IDLE_HALF_LIFE_S
    cost = steps.ComputeCost()
    assert cost.value(0.0) == 0.0
    cost.set(10.0, now=0.0)  # the warm-up
    for i in range(30):
        cost.observe(110.0, now=1.0 + i / 100)  # a burst: each pass 110 ms
    busy = cost.value(1.3)
    assert busy > 100
    assert cost.floor_ms < 10.1  # a burst of 0.3 s barely moves the idle cost
    assert cost.value(1.3 + half) == pytest.approx(cost.floor_ms + (busy - cost.floor_ms) / 2)
    assert cost.value(1.3 + 10 * half) == pytest.approx(10, abs=0.2)
    relaxed = cost.value(1.3 + 2 * half)
    cost.observe(20.0, now=1.3 + 2 * half)
    assert cost.value(1.3 + 2 * half) == pytest.approx(relaxed + steps.COMPUTE_EWMA_WEIGHT * (20 - relaxed))
    slower = steps.ComputeCost()  # a machine that became slower for good: after hours of serving,
    slower.set(10.0, now=0.0)     # its idle cost has followed
    hours = int(4 * steps.COMPUTE_FLOOR_HALF_LIFE_S)
    for i in range(hours):
        slower.observe(50.0, now=float(i))
    assert slower.floor_ms > 45 and slower.value(hours + 10 * half) > 45
