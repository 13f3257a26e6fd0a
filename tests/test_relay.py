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
