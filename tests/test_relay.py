"""Peers behind NAT on loopback: ``--listen none`` peers reached through relays, the
reachability check, forged relay lists, a relay killed mid-generation, a tampering relay."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshkit import crash, file_hash, start_peer, wait_for_tables
from meshinfer import discovery, protocol
from meshinfer.config import LayerRange
from meshinfer.errors import PeerUnavailable
from meshinfer.generate import greedy_generate, load_shard
from meshinfer.peer import Peer
from meshinfer.session import MeshClient
from meshinfer.tokenizer import Tokenizer
from tiny import random_weights, tiny_config, write_gguf

N_TOKENS = 24
PROMPT = [{"role": "user", "content": "a home machine behind NAT serves the first layers"}]
#: Per-step deadline floor, seconds: far above a tiny step on a loaded core, so only a killed
#: relay causes a failover.
DEADLINE_FLOOR_S = 10.0


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(path, weights hash, tokenizer, prompt ids, tokens of the whole model, other path, its hash)."""
    d = tmp_path_factory.mktemp("relay")
    cfg = tiny_config("qwen2", context=256)
    path = write_gguf(d / "tiny.gguf", cfg, random_weights(cfg, seed=11))
    other = write_gguf(d / "other.gguf", cfg, random_weights(cfg, seed=12))
    tok = Tokenizer.from_gguf(path)
    ids = tok.encode_chat(PROMPT)
    expected = greedy_generate(load_shard(path), ids, max_tokens=N_TOKENS).token_ids
    return path, file_hash(path), tok, ids, expected, other, file_hash(other)


async def hidden(path, digest, layers, bootstrap, *, bundle=None, **settings) -> Peer:
    """A peer that never listens (``join --listen none``) serving ``layers`` of ``path``."""
    return await start_peer(load_shard(path, layers), weights_hash=digest, bundle=bundle,
                            bootstrap=bootstrap, listen=False, **settings)


async def wait_relayed(peers, hidden_peers, *, timeout_s: float = 30.0) -> None:
    """Wait until every peer knows every other and each hidden peer's advert, as the first
    peer holds it, lists a relay."""
    await wait_for_tables(peers, timeout_s=timeout_s)
    async with asyncio.timeout(timeout_s):
        while not all((ad := peers[0].table.get(h.peer_id)) is not None and ad.relays for h in hidden_peers
                      if h is not peers[0]):
            await asyncio.sleep(0.05)


async def generate(bootstrap, ids, *, n_tokens=N_TOKENS, on_token=None, hook=None):
    """(route, result, client failovers) of one greedy conversation through the mesh at ``bootstrap``."""
    async with MeshClient(list(bootstrap)) as client:
        route = await client.plan()
        conv = client.conversation(route, max_tokens_total=len(ids) + n_tokens, deadline_floor_s=DEADLINE_FLOOR_S)
        if hook is not None:
            hook(client, conv)
        try:
            out = await conv.generate(ids, max_tokens=n_tokens, eos_ids=(),
                                      on_token=(lambda t: on_token(conv)) if on_token else None)
        finally:
            await conv.close()
    return route, out


async def test_a_peer_that_never_listens_serves_the_first_layers_through_its_relay(model):
    path, digest, tok, ids, expected, *_ = model
    public = await start_peer(load_shard(path, LayerRange(2, 4)), weights_hash=digest)
    home = await hidden(path, digest, LayerRange(0, 2), public.addrs, bundle=tok.to_bundle())
    try:
        await wait_relayed([public, home], [home])
        assert home.addrs == () and home.reachable is False
        assert home.relays() == (public.peer_id,)
        route, out = await generate(public.addrs, ids)
        assert route.peer_ids == (home.peer_id, public.peer_id)
        assert out.token_ids == expected
        assert not out.failovers
    finally:
        await home.close()
        await public.close()


async def test_both_hops_behind_nat_reach_each_other_through_a_third_peer(model):
    path, digest, tok, ids, expected, other, other_digest = model
    relay = await start_peer(load_shard(other, LayerRange(0, 2)), weights_hash=other_digest)  # another model
    first = await hidden(path, digest, LayerRange(0, 2), relay.addrs, bundle=tok.to_bundle())
    last = await hidden(path, digest, LayerRange(2, 4), relay.addrs)
    try:
        await wait_relayed([relay, first, last], [first, last])
        route, out = await generate(relay.addrs, ids)
        assert route.peer_ids == (first.peer_id, last.peer_id)
        assert out.token_ids == expected
        assert first.links[last.peer_id].relay_id == relay.peer_id  # hop to hop through the relay too
    finally:
        for p in (last, first, relay):
            await p.close()


async def test_a_relay_killed_mid_generation_fails_over_to_another_relay(model):
    path, digest, tok, ids, expected, *_ = model
    relays = [await start_peer(load_shard(path, LayerRange(2, 4)), weights_hash=digest) for _ in range(2)]
    home = await hidden(path, digest, LayerRange(0, 2), relays[0].addrs + relays[1].addrs, bundle=tok.to_bundle())
    killed = []

    def on_token(conv):
        if len(conv.cached) - len(ids) >= 8 and not killed:
            via = conv.client._links[home.peer_id].relay_id
            killed.append(next(r for r in relays if r.peer_id == via))
            asyncio.ensure_future(crash(killed[0]))

    try:
        await wait_relayed([*relays, home], [home])
        async with asyncio.timeout(30):
            while len(home.relays()) < 2:
                await asyncio.sleep(0.05)
        _, out = await generate(relays[0].addrs + relays[1].addrs, ids, on_token=on_token)
        assert killed and out.token_ids == expected
        assert len(out.failovers) == 1
        assert out.route[0]["peer_id"] == home.peer_id  # the hidden peer stays, through the other relay
    finally:
        for p in (home, *relays):
            await p.close()


async def test_a_relay_cannot_pose_as_the_peer_behind_it(model):
    path, digest, tok, ids, *_ = model

    class Impostor(Peer):
        """A relay that swaps the hidden peer's welcome for one signed with its own key."""

        async def _on_relay_back(self, link, f):
            msg_type, inner = protocol.decode(f.get("data", bytes), max_bytes=1 << 24)
            if msg_type == "welcome":
                fields = {k: v for k, v in inner.d.items() if k not in ("v", "t")}
                fields["proof"] = discovery.welcome_proof(self.key, b"\0" * 32, fields["nonce"])
                f.d["data"] = protocol.encode("welcome", **fields)
            await super()._on_relay_back(link, f)

    relay = await start_peer(load_shard(path, LayerRange(2, 4)), weights_hash=digest)
    relay.__class__ = Impostor
    home = await hidden(path, digest, LayerRange(0, 2), relay.addrs, bundle=tok.to_bundle())
    try:
        await wait_relayed([relay, home], [home])
        async with MeshClient(list(relay.addrs)) as client:
            await client.refresh()
            with pytest.raises(PeerUnavailable, match="could not prove it holds its key"):
                await client.link(client.table[home.peer_id])
    finally:
        await home.close()
        await relay.close()


async def test_a_forged_relay_list_is_refused(model):
    path, digest, tok, *_ = model
    public = await start_peer(load_shard(path, LayerRange(2, 4)), weights_hash=digest)
    home = await hidden(path, digest, LayerRange(0, 2), public.addrs)
    try:
        await wait_relayed([public, home], [home])
        real = home.advert()
        assert real.relays == (public.peer_id,) and discovery.verify_advert(real)
        attacker = Ed25519PrivateKey.generate()
        unsigned = replace(real, relays=(discovery.peer_id_of(attacker),))
        other_key = discovery.sign_advert(unsigned, attacker)
        for forged in (unsigned, other_key):
            assert not discovery.verify_advert(forged)
            public._merge([replace(forged, seq=real.seq + 100)])
            assert public.table.get(home.peer_id).relays == (public.peer_id,)
        with pytest.raises(protocol.ProtocolError, match="at most 4"):
            protocol.PeerAdvert.from_wire(dict(real.to_wire(), relays=["a" * 32] * 5))
    finally:
        await home.close()
        await public.close()


async def test_a_failed_dial_back_marks_the_peer_unreachable_and_it_is_served_through_relays(model):
    path, digest, tok, ids, expected, *_ = model
    public = await start_peer(load_shard(path, LayerRange(2, 4)), weights_hash=digest)
    # advertises a port nobody listens on, as behind a NAT without a forwarded port
    nat = await start_peer(load_shard(path, LayerRange(0, 2)), weights_hash=digest, bundle=tok.to_bundle(),
                           bootstrap=public.addrs, public_addrs=("ws://127.0.0.1:9",))
    try:
        async with asyncio.timeout(30):
            while nat.reachable is None:
                await asyncio.sleep(0.05)
        assert nat.reachable is False
        assert "could not dial it back" in nat.reachability_note
        await wait_relayed([public, nat], [nat])
        assert public.table.get(nat.peer_id).relays == (public.peer_id,)
        assert public.reachable is None  # a first peer has nobody to ask, and advertises no relay
        _, out = await generate(public.addrs, ids)
        assert out.token_ids == expected
    finally:
        await nat.close()
        await public.close()


async def test_a_reachable_peer_passes_the_dial_back_and_lists_no_relay(model):
    path, digest, *_ = model
    public = await start_peer(load_shard(path, LayerRange(2, 4)), weights_hash=digest)
    second = await start_peer(load_shard(path, LayerRange(0, 2)), weights_hash=digest, bootstrap=public.addrs)
    try:
        async with asyncio.timeout(30):
            while second.reachable is None:
                await asyncio.sleep(0.05)
        assert second.reachable is True and second.advert().relays == ()
        assert "relays" not in second.advert().to_wire()  # a reachable peer's advert keeps its bytes
    finally:
        await second.close()
        await public.close()
