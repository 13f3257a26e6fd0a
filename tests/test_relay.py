"""Peers behind NAT on loopback: ``--listen none`` peers reached through relays, the
reachability check, forged relay lists, a relay killed mid-generation, a tampering relay."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from helpers.meshkit import crash, file_hash, start_peer, wait_for_tables
from meshinfer.wire import discovery, protocol
from meshinfer.wire.circuit_seal import CircuitSeal
from meshinfer.core.config import LayerRange
from meshinfer.core.errors import PeerUnavailable
from meshinfer.engine.generate import greedy_generate, load_shard
from meshinfer.peer.node import Peer
from meshinfer.client.mesh import MeshClient
from meshinfer.text.tokenizer import Tokenizer
from helpers.tiny import random_weights, tiny_config, write_gguf

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


async def test_a_hidden_first_hop_sends_a_tokenizer_larger_than_its_relay_forwards_in_parts(model):
    """Found by a new-user run of the quickstart's relay setup: the default model's tokenizer
    bundle (5.4 MB) is larger than a relay forwards (what a 512-token step needs, 1.9 MB), so a
    hidden first hop, the only peer with the tokenizer, could serve no chat ("no peer sent a
    trustworthy tokenizer ... larger than relay ... forwards"). Over a circuit that cannot hold
    it, the bundle goes in parts the client joins and checks against the advertised hash."""
    from meshinfer.wire.protocol import TOKENIZER_PART_MARGIN_BYTES

    path, digest, tok, ids, expected, *_ = model
    bundle = tok.to_bundle()
    bundle["chat_template"] = "{# " + "padding " * 40_000 + "#}" + (bundle.get("chat_template") or "")
    public = await start_peer(load_shard(path, LayerRange(2, 4)), weights_hash=digest)
    home = await hidden(path, digest, LayerRange(0, 2), public.addrs, bundle=bundle)
    parts: list = []
    real = home.handshake.on_get_tokenizer

    async def count(link, f):
        parts.append(f.get("part", int, 0))
        await real(link, f)

    home.handshake.on_get_tokenizer = count
    try:
        await wait_relayed([public, home], [home])
        async with MeshClient(list(public.addrs)) as client:
            route = await client.plan()
            assert route.peer_ids == (home.peer_id, public.peer_id)
            link = await client.link(client.table[home.peer_id])
            assert len(home.tokenizer_wire or b"x" * 10**6) + TOKENIZER_PART_MARGIN_BYTES > link.ws.max_send_bytes
            got = await client.tokenizer(route)
        assert got.chat_template == bundle["chat_template"] and len(parts) > 1 and parts == list(range(len(parts)))
        assert got.encode_chat(PROMPT) == ids
    finally:
        await home.close()
        await public.close()


async def test_a_private_mesh_works_through_a_relay_and_an_outsider_gets_nothing(model):
    path, digest, tok, ids, expected, *_ = model
    key = b"k" * 32
    public = await start_peer(load_shard(path, LayerRange(2, 4)), weights_hash=digest, mesh_key=key)
    home = await hidden(path, digest, LayerRange(0, 2), public.addrs, bundle=tok.to_bundle(), mesh_key=key)
    try:
        await wait_relayed([public, home], [home])
        async with MeshClient(list(public.addrs), mesh_key=key) as client:
            route = await client.plan()
            conv = client.conversation(route, max_tokens_total=len(ids) + N_TOKENS)
            out = await conv.generate(ids, max_tokens=N_TOKENS, eos_ids=())
            await conv.close()
        assert route.peer_ids == (home.peer_id, public.peer_id) and out.token_ids == expected
        async with MeshClient(list(public.addrs)) as outsider:  # no key: refused before any relaying
            with pytest.raises(Exception, match="private"):
                await outsider.refresh()
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


async def test_a_relay_between_two_hidden_hops_killed_mid_generation_is_blamed_at_once(model):
    """Hop A forwards to hop B (both hidden) through relay R, while the client reaches both through
    relay R2. R dies carrying a decode step from A to B: A reports at once that its circuit to B
    through R closed; the client fails over well before the step deadline, backs off R (not A
    or B), and A reaches B through R2."""
    path, digest, tok, ids, expected, other, other_digest = model
    deadline_floor_s = 60.0  # a failover that waited out the step deadline would take longer than this
    killed: list = []
    relayed: list = []  # sizes of the steps the relay forwarded from A to B

    class Doomed(Peer):
        """A relay that dies, as a power cut would, while it forwards a decode step (which dies with it)."""

        armed = False  # set once A's circuit to B is up: from then on A sends B only steps

        async def _on_relay(self, link, f):
            # the circuit is sealed (the relay cannot read it): a frame of more than 200 bytes
            # from A is a step (a prefill chunk, then one per decode step); die at the ninth decode step
            if self.armed and f.str("to", None) is not None and not killed and len(f.get("data", bytes)) > 200:
                relayed.append(len(f.d["data"]))
                if len(relayed) >= 10:
                    killed.append((time.monotonic(), asyncio.ensure_future(crash(self))))
                    return
            await super()._on_relay(link, f)

    survivor = await start_peer(load_shard(other, LayerRange(0, 2)), weights_hash=other_digest)  # another model
    doomed = await start_peer(load_shard(other, LayerRange(0, 2)), weights_hash=other_digest,
                              bootstrap=survivor.addrs)
    doomed.__class__ = Doomed
    first = await hidden(path, digest, LayerRange(0, 2), survivor.addrs, bundle=tok.to_bundle())
    last = await hidden(path, digest, LayerRange(2, 4), survivor.addrs)
    both = (survivor.peer_id, doomed.peer_id)  # the bootstrap peer first: the client goes through it
    try:
        await wait_for_tables([survivor, doomed, first, last], timeout_s=30)
        async with asyncio.timeout(30):  # each relay knows both hidden peers list both relays
            while not all((ad := r.table.get(h.peer_id)) is not None and ad.relays == both
                          for r in (survivor, doomed) for h in (first, last)):
                await asyncio.sleep(0.05)
        hop_link = await first.conns.link_to(last.peer_id, (), (doomed.peer_id,))  # A -> B through R
        assert hop_link.relay_id == doomed.peer_id
        gossip_to = first.gossip.gossip_to

        async def no_gossip_to_last(peer_id, addrs, payload):
            """A gossips over the links it holds, its circuit to B too; a gossip frame there is
            as large as a step, and the relay dying with it lost no step (CI saw that)."""
            if peer_id != last.peer_id:
                return await gossip_to(peer_id, addrs, payload)
            first.gossip.in_flight.discard(peer_id)

        first.gossip.gossip_to = no_gossip_to_last
        doomed.armed = True
        async with MeshClient(list(survivor.addrs)) as client:
            route = await client.plan()
            assert route.peer_ids == (first.peer_id, last.peer_id)
            assert {client._links[h].relay_id for h in route.peer_ids} == {survivor.peer_id}
            conv = client.conversation(route, max_tokens_total=len(ids) + N_TOKENS,
                                       deadline_floor_s=deadline_floor_s)
            try:
                out = await conv.generate(ids, max_tokens=N_TOKENS, eos_ids=())
            finally:
                await conv.close()
            done_at = time.monotonic()
            failed_records = set(client._failed)
        assert killed and out.token_ids == expected
        assert len(out.failovers) == 1
        failover = out.failovers[0]
        assert failover["failed"] == [doomed.peer_id]  # the relay, not either hop
        assert f"through relay {doomed.peer_id[:12]}" in failover["reason"]
        assert failover["kept_hops"] == 2
        assert failed_records == {doomed.peer_id}
        # at once: far below the step deadline, which waiting for the lost step would have taken
        assert failover["seconds"] < deadline_floor_s / 4
        assert done_at - killed[0][0] < deadline_floor_s / 2
        assert [h["peer_id"] for h in out.route] == [first.peer_id, last.peer_id]
        assert first.links[last.peer_id].relay_id == survivor.peer_id
    finally:
        if killed:
            await killed[0][1]
        for p in (last, first, doomed, survivor):
            await p.close()


async def test_a_relay_cannot_pose_as_the_peer_behind_it(model):
    """A relay that answers the opener's key offer itself (signed with its own key) instead of
    the hidden peer: the answer is not signed by the peer asked for, so the circuit ends before
    any frame of the handshake is sent, and the client gets no link to the peer."""
    path, digest, tok, ids, *_ = model
    answered: list = []

    class Impostor(Peer):
        """A relay that swaps the hidden peer's key answer for its own."""

        offers: dict = {}

        async def _on_relay(self, link, f):
            if f.str("to", None) is not None:
                self.offers.setdefault(f.d["circ"], f.get("data", bytes))
            await super()._on_relay(link, f)

        async def _on_relay_back(self, link, f):
            src = self.relay.backwards.get((link, f.d["circ"]))
            if src is not None and src[1] in self.offers and src[1] not in answered:
                answered.append(src[1])
                f.d["data"] = CircuitSeal(sign_key=self.key).answer(self.offers[src[1]])
            await super()._on_relay_back(link, f)

    relay = await start_peer(load_shard(path, LayerRange(2, 4)), weights_hash=digest)
    relay.__class__ = Impostor
    home = await hidden(path, digest, LayerRange(0, 2), relay.addrs, bundle=tok.to_bundle())
    try:
        await wait_relayed([relay, home], [home])
        async with MeshClient(list(relay.addrs)) as client:
            await client.refresh()
            t0 = time.monotonic()
            with pytest.raises(PeerUnavailable, match="closed"):
                await client.link(client.table[home.peer_id])
            assert answered and time.monotonic() - t0 < 4  # ended at the answer, not by a timeout
    finally:
        await home.close()
        await relay.close()


async def test_a_relay_cannot_read_or_alter_its_circuits_and_no_hop_is_blamed(model):
    """Circuits are sealed end to end (``wire.circuit_seal``): the relay forwards ciphertext, so
    nothing it carries shows the conversation id or a frame's fields, and a frame it changes
    does not open: the circuit ends, the client fails over and reconnects, and nobody is taken
    for a liar. (Before sealing the relay could change the tokens a hidden last hop sent back,
    and the spot-checks then blamed that honest hop.)"""
    path, digest, tok, ids, expected, *_ = model
    seen: list[bytes] = []
    tampered: list = []

    class Tamperer(Peer):
        """A relay that keeps what it forwards and, once armed, flips one byte of the hidden
        peer's third frame back."""

        armed = 0

        async def _on_relay(self, link, f):
            seen.append(f.get("data", bytes))
            await super()._on_relay(link, f)

        async def _on_relay_back(self, link, f):
            seen.append(f.get("data", bytes))
            self.armed += bool(self.armed)
            if self.armed > 3 and not tampered:
                data = bytearray(f.d["data"])
                data[-1] ^= 1
                f.d["data"] = bytes(data)
                tampered.append(len(seen))
            await super()._on_relay_back(link, f)

    relay = await start_peer(load_shard(path, LayerRange(0, 2)), weights_hash=digest, bundle=tok.to_bundle())
    relay.__class__ = Tamperer
    home = await hidden(path, digest, LayerRange(2, 4), relay.addrs)
    spare = await start_peer(load_shard(path, LayerRange(2, 4)), weights_hash=digest, bootstrap=relay.addrs)
    try:
        await wait_relayed([relay, home, spare], [home])
        async with MeshClient(list(relay.addrs)) as client:
            route = await client.plan(exclude=frozenset({spare.peer_id}))  # through the hidden peer first
            assert route.peer_ids == (relay.peer_id, home.peer_id)
            relay.armed = 1
            conv = client.conversation(route, max_tokens_total=len(ids) + N_TOKENS, deadline_floor_s=DEADLINE_FLOOR_S)
            try:
                out = await conv.generate(ids, max_tokens=N_TOKENS, eos_ids=())
            finally:
                await conv.close()
        assert out.token_ids == expected and tampered
        assert out.detections == [] and len(out.failovers) >= 1
        conv_id = conv.conv_id.encode()
        assert seen and not any(conv_id in data or b"conv" in data or b"token" in data for data in seen)
    finally:
        for p in (spare, home, relay):
            await p.close()


async def test_a_relay_forwards_only_to_a_peer_that_lists_it(model):
    from meshinfer.client.links import CLIENT_MAX_FRAME_BYTES
    from meshinfer.wire.transport import circuit_link

    path, digest, *_ = model
    relay = await start_peer(load_shard(path, LayerRange(2, 4)), weights_hash=digest)
    other = await start_peer(load_shard(path, LayerRange(0, 2)), weights_hash=digest, bootstrap=relay.addrs)
    try:
        await wait_for_tables([relay, other])
        assert other.peer_id in relay.links  # a link it opened, but it lists no relay: it is reachable
        async with MeshClient(list(relay.addrs)) as client:
            await client.refresh()
            carrier = await client.link(client.table[relay.peer_id])
            sock = carrier.open_circuit(other.peer_id, public_key=client.table[other.peer_id].public_key,
                                        max_bytes=CLIENT_MAX_FRAME_BYTES)
            with pytest.raises(PeerUnavailable, match="closed"):
                await client._greet(circuit_link(sock, on_message=client._on_message, name="relay://x"), "relay://x")
            assert relay._forwards == {} and carrier.circuits == {}
    finally:
        await other.close()
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


# ---------------------------------------------------------------------------- planner (pure)
def advert(peer_id, first, last, *, addrs=True, relays=(), rtts=None, weights="a" * 64):
    """A ready advert of a 24-layer model holding the inclusive range ``first-last``."""
    return protocol.PeerAdvert(peer_id=peer_id, addrs=(f"ws://{peer_id}:7000",) if addrs else (),
                               protocol_version=protocol.PROTOCOL_VERSION, weights_hash=weights, architecture="llama", num_layers=24,
                               layers=LayerRange(first, last + 1), device="cpu", precision="f32",
                               free_kv_tokens=4096, compute_ms_per_token=12.0, rtts_ms=dict(rtts or {}),
                               relays=tuple(relays))


def test_the_planner_adds_the_relays_detour_to_an_unmeasured_relayed_link():
    from meshinfer.client.routing import RELAY_FORWARD_MS, hop_rtt_ms, plan_route

    relay = advert("r", 0, 23, weights="b" * 64)  # another model: a relay, never a hop here
    a = advert("a", 0, 11, rtts={"r": 10.0})
    b = advert("b", 12, 23, addrs=False, relays=["r"], rtts={"r": 20.0})
    table = {p.peer_id: p for p in (relay, a, b)}
    assert hop_rtt_ms(a, b, table) == 10.0 + 20.0 + RELAY_FORWARD_MS
    route = plan_route([relay, a, b], client_rtts_ms={"a": 4.0, "b": 30.0}, compat_key=a.compat_key)
    assert route.estimated_ms_per_token == pytest.approx(4.0 / 2 + 31.0 / 2 + 30.0 / 2 + 12.0 + 12.0 + 2 * 1.0)
    # a measured RTT (pings through the circuit) already holds the detour: used as it is
    measured = replace(a, rtts_ms={"r": 10.0, "b": 40.0})
    assert hop_rtt_ms(measured, b, table) == 40.0


def test_a_direct_peer_wins_over_a_relayed_one_of_equal_compute():
    from meshinfer.client.routing import plan_route

    relay = advert("r", 0, 23, weights="b" * 64)
    a = advert("a", 0, 11, rtts={"r": 10.0, "c": 10.0})
    b = advert("b", 12, 23, addrs=False, relays=["r"], rtts={"r": 10.0})
    c = advert("c", 12, 23)
    route = plan_route([relay, a, b, c], client_rtts_ms={"a": 4.0, "b": 4.0, "c": 4.0}, compat_key=a.compat_key)
    assert route.peer_ids == ("a", "c")


# ---------------------------------------------------------------------------- command line
@pytest.mark.slow
def test_join_listen_none_from_the_command_line(model, tmp_path):
    """``join --listen none`` serves layers 0-1 through the public peer it dials; ``status`` says
    so and ``chat`` through the public peer only gives the whole model's tokens."""
    import json
    import os
    import re
    import subprocess
    import sys
    import time

    path, _, tok, *_ = model
    env = dict(os.environ, MESHINFER_HOME=str(tmp_path))

    def run(*args):
        return subprocess.run([sys.executable, "-m", "meshinfer", *args], capture_output=True, text=True,
                              timeout=120, env=env)

    procs = []

    def join(*extra):
        log = tmp_path / f"join{len(procs)}.log"  # a file, not a pipe nobody reads
        proc = subprocess.Popen([sys.executable, "-m", "meshinfer", "join", "--model", str(path),
                                 "--key", str(tmp_path / f"k{len(procs)}.pem"), *extra],
                                stdout=subprocess.PIPE, stderr=log.open("w"), text=True, env=env)
        procs.append(proc)
        line = proc.stdout.readline()
        assert line.startswith("ready:"), line + log.read_text()
        return line

    try:
        public = join("--layers", "2-3", "--listen", "127.0.0.1:0")
        url = re.search(r"at (ws://127\.0\.0\.1:\d+)", public).group(1)
        home = join("--layers", "0-1", "--listen", "none", "--peers", url)
        assert "at no address (--listen none" in home
        public_id = re.search(r"ready: peer (\w+)", public).group(1)
        deadline = time.monotonic() + 60  # the hidden peer's advert with its relay reaches the public peer
        status = run("status", "--peers", url)
        while f"relayed via {public_id[:12]}" not in status.stdout and time.monotonic() < deadline:
            time.sleep(0.5)
            status = run("status", "--peers", url)
        assert f"relayed via {public_id[:12]}" in status.stdout, status.stdout + status.stderr
        chat = run("chat", "--peers", url, "-p", "hello", "--max-tokens", "6", "--json")
        assert chat.returncode == 0, chat.stderr
        d = json.loads(chat.stdout)
        ids = tok.encode_chat([{"role": "user", "content": "hello"}])
        assert d["token_ids"] == greedy_generate(load_shard(path), ids, max_tokens=6, eos_ids=tok.eos_ids).token_ids
        assert d["route"][0]["address"] == f"relay://{public_id}"
        bad = run("join", "--model", str(path), "--layers", "0-1", "--listen", "none")
        assert bad.returncode == 2 and "--listen none needs --peers" in bad.stderr
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_a_circuit_nobody_reads_ends_without_cutting_the_relays_link():
    from websockets.protocol import State

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from meshinfer.wire.circuit_seal import KX_BYTES, SIG_BYTES, CircuitSeal
    from meshinfer.wire.transport import OUTBOX_BYTES, CircuitSocket

    class Carrier:
        """The link to the relay: records what the circuit posts on it."""

        remote_id = "r" * 32

        def __init__(self):
            self.circuits, self.posted = {}, []

        def post(self, msg_type, **fields):
            self.posted.append((msg_type, fields))
            return True

    carrier = Carrier()
    sock = CircuitSocket(carrier, 7, side="in", seal=CircuitSeal(sign_key=Ed25519PrivateKey.generate()),
                         max_bytes=64 * 1024)
    carrier.circuits[("in", 7)] = sock
    for _ in range(OUTBOX_BYTES // (64 * 1024) + 1):  # 4 MiB plus one frame may wait unread
        sock.feed(b"x" * 64 * 1024)
    assert sock.state is State.OPEN
    sock.feed(b"x" * 64 * 1024)
    assert sock.state is State.CLOSED and carrier.circuits == {}
    assert carrier.posted == [("relay_close", {"circ": 7, "back": True, "cut": False})]
    big = CircuitSocket(carrier, 8, side="out", to="t" * 32, seal=CircuitSeal(peer_public_key="00" * 32),
                        max_bytes=1024)
    big.feed(b"x" * (1024 + KX_BYTES + SIG_BYTES + 1))  # a frame over the circuit's limit (and a seal's) ends it too
    assert big.state is State.CLOSED


def test_a_sealed_circuit_opens_only_the_other_ends_frames_in_order():
    """``CircuitSeal``: the opener's offer, the hidden peer's signed answer, then frames that
    open only at the other end, unchanged, once and in order; an answer signed by another key
    is refused, and so are an offer or answer of the wrong size."""
    from meshinfer.core.errors import ProtocolError

    key = Ed25519PrivateKey.generate()
    public = discovery.public_key_hex(key)
    opener, hidden_end = CircuitSeal(peer_public_key=public), CircuitSeal(sign_key=key)
    opener.accept(hidden_end.answer(opener.offer()))
    assert opener.keyed and hidden_end.keyed
    frames = [opener.seal(b"hello"), opener.seal(b"step" * 100)]
    assert b"hello" not in frames[0] and len(frames[0]) == len(b"hello") + 16
    assert hidden_end.open(frames[0]) == b"hello" and hidden_end.open(frames[1]) == b"step" * 100
    back = hidden_end.seal(b"token")
    assert opener.open(back) == b"token"
    with pytest.raises(ProtocolError, match="does not open"):
        opener.open(back)  # replayed
    late = CircuitSeal(peer_public_key=public), CircuitSeal(sign_key=key)
    late[0].accept(late[1].answer(late[0].offer()))
    late[0].seal(b"a")  # sent, lost
    second = late[0].seal(b"b")
    with pytest.raises(ProtocolError, match="does not open"):
        late[1].open(second)  # out of order
    changed = CircuitSeal(peer_public_key=public), CircuitSeal(sign_key=key)
    changed[0].accept(changed[1].answer(changed[0].offer()))
    frame = bytearray(changed[0].seal(b"tokens"))
    frame[0] ^= 1
    with pytest.raises(ProtocolError, match="does not open"):
        changed[1].open(bytes(frame))
    impostor = CircuitSeal(sign_key=Ed25519PrivateKey.generate())
    victim = CircuitSeal(peer_public_key=public)
    with pytest.raises(ProtocolError, match="not signed by the peer asked for"):
        victim.accept(impostor.answer(victim.offer()))
    with pytest.raises(ProtocolError, match="key offer"):
        CircuitSeal(sign_key=key).answer(b"short")
    with pytest.raises(ProtocolError, match="signed key answer"):
        CircuitSeal(peer_public_key=public).accept(b"x" * 95)


async def test_tokenizer_parts_that_are_malformed_are_refused_not_a_crash():
    """Found by an attack run on tokenizer parts (a lying hidden peer's replies): parts that
    decode to a map with an unhashable key crashed the fetch (``TypeError``, the other sources
    never asked), tiny parts made joining quadratic, and the joined bytes were decoded without
    the frame decoder's limits. Each is a ``ProtocolError`` now (the client tries the next source)."""
    import msgpack

    from meshinfer.client.tokenizer_trust import _get_tokenizer
    from meshinfer.core.errors import ProtocolError
    from meshinfer.wire.protocol import MIN_TOKENIZER_PART_BYTES

    class Link:
        def __init__(self, parts):
            self.parts = parts

        async def request(self, msg_type, *, timeout_s, part=0):
            chunk = self.parts[part]
            return "tokenizer", protocol.Fields({"weights_hash": "w", "chunk": chunk, "part": part,
                                                 "parts": len(self.parts)}, "tokenizer")

    def split(data: bytes, size: int) -> list[bytes]:
        return [data[i:i + size] for i in range(0, len(data), size)]

    unhashable = b"\x81\x81\x01\x02\x01" + b"\x00" * MIN_TOKENIZER_PART_BYTES  # {{1: 2}: 1} and junk
    with pytest.raises(ProtocolError, match="do not decode"):
        await _get_tokenizer(Link(split(unhashable, MIN_TOKENIZER_PART_BYTES)), 5.0)
    with pytest.raises(ProtocolError, match="smaller than the peers send"):
        await _get_tokenizer(Link([b"x"] * 10), 5.0)
    huge_list = msgpack.packb({"a": [0] * 70_000})
    with pytest.raises(ProtocolError, match="do not decode"):
        await _get_tokenizer(Link(split(huge_list + b"\x00" * MIN_TOKENIZER_PART_BYTES, MIN_TOKENIZER_PART_BYTES)), 5.0)
    good = msgpack.packb({"version": 1, "pad": "p" * (2 * MIN_TOKENIZER_PART_BYTES)})
    assert (await _get_tokenizer(Link(split(good, MIN_TOKENIZER_PART_BYTES)), 5.0))[1]["version"] == 1


def test_a_relay_ends_a_circuit_whose_frame_the_far_end_would_not_take():
    """Found by an attack run: a relay forwarded a stranger's frame larger than the hidden peer
    takes, and the hidden peer's whole connection to the relay closed (every circuit on it)."""
    from meshinfer.peer.relay import too_big
    from meshinfer.wire.transport import RELAY_OVERHEAD_BYTES

    class Link:
        info = {"max_frame_bytes": 131_072}

    assert not too_big(Link(), b"x" * (131_072 - RELAY_OVERHEAD_BYTES))
    assert too_big(Link(), b"x" * (131_072 - RELAY_OVERHEAD_BYTES + 1))
    Link.info = {}
    assert not too_big(Link(), b"x" * 10**7)  # unknown limit: not checked


async def test_a_relay_that_cuts_circuits_during_open_costs_a_backoff_not_the_conversation(model):
    """Found by an attack run: a relay that cannot read its circuits can still count frames and
    cut the one carrying ``open``; ``Conversation.open`` recovered only from a full hop, so every
    conversation through that relay failed and nothing was backed off. Now a hop unreachable
    during open is backed off and the route planned again: the reply comes through the spare."""
    path, digest, tok, ids, expected, other, other_digest = model
    frames: dict = {}

    class Cutter(Peer):
        """A relay that flips a byte of the 6th frame of each circuit toward the hidden peer."""

        async def _on_relay(self, link, f):
            if f.str("to", None) is not None:
                key = (id(link), f.d["circ"])
                frames[key] = frames.get(key, 0) + 1
                if frames[key] == 6:
                    f.d["data"] = f.d["data"][:-1] + bytes([f.d["data"][-1] ^ 1])
            await super()._on_relay(link, f)

    relay = await start_peer(load_shard(other, LayerRange(0, 2)), weights_hash=other_digest)  # never a hop
    relay.__class__ = Cutter
    first = await start_peer(load_shard(path, LayerRange(0, 2)), weights_hash=digest, bootstrap=relay.addrs)
    home = await hidden(path, digest, LayerRange(2, 4), relay.addrs)
    spare = await start_peer(load_shard(path, LayerRange(2, 4)), weights_hash=digest, bootstrap=relay.addrs)
    try:
        await wait_relayed([relay, first, home, spare], [home])
        async with MeshClient(list(first.addrs)) as client:
            route = await client.plan(exclude=frozenset({spare.peer_id}))
            assert route.peer_ids == (first.peer_id, home.peer_id)
            conv = client.conversation(route, max_tokens_total=len(ids) + N_TOKENS, deadline_floor_s=DEADLINE_FLOOR_S)
            try:
                out = await conv.generate(ids, max_tokens=N_TOKENS, eos_ids=())
            finally:
                await conv.close()
            failed = dict(client._failed)
        assert out.token_ids == expected and conv.route.peer_ids == (first.peer_id, spare.peer_id)
        assert home.peer_id in failed and all(until != float("inf") for until, _ in failed.values())
    finally:
        for p in (spare, home, first, relay):
            await p.close()


async def test_one_host_holds_at_most_its_share_of_a_hidden_peers_circuits(model, monkeypatch):
    """An attack run took all 256 circuit slots of a hidden peer from one host in 0.75 s (4
    connections to its relay, 64 circuits each). A relay forwards at most
    ``MAX_CIRCUITS_PER_HOST_TO_PEER`` circuits from one client host to one hidden peer, over all
    that host's connections; a client on another host still gets one. (Caps scaled down.)"""
    import websockets

    from meshinfer.client.links import CLIENT_MAX_FRAME_BYTES
    from meshinfer.core.errors import MeshError
    from meshinfer.peer import limits
    from meshinfer.wire.transport import Link, circuit_link

    path, digest, tok, *_ = model
    public = await start_peer(load_shard(path, LayerRange(2, 4)), weights_hash=digest)
    home = await hidden(path, digest, LayerRange(0, 2), public.addrs, bundle=tok.to_bundle())
    monkeypatch.setattr(limits, "MAX_CIRCUITS_PER_HOST_TO_PEER", 3)
    monkeypatch.setattr(limits, "MAX_CIRCUITS_PER_LINK", 2)
    try:
        await wait_relayed([public, home], [home])
        async with MeshClient(list(public.addrs)) as client:
            await client.refresh()
            key = client.table[home.peer_id].public_key

            async def circuit(carrier):
                sock = carrier.open_circuit(home.peer_id, public_key=key, max_bytes=CLIENT_MAX_FRAME_BYTES)
                link, advert, _ = await client._greet(circuit_link(sock, on_message=client._on_message,
                                                                   name="relay://x"), "relay://x")
                assert advert.peer_id == home.peer_id
                return link

            url = public.addrs[0]
            first, (second, _, _) = await client.link(client.table[public.peer_id]), await client._hello(url)
            held = [await circuit(first), await circuit(first), await circuit(second)]
            with pytest.raises(MeshError):
                await circuit(second)  # this host's fourth, on a connection with room for one more
            assert len(public._forwards) == 3
            ws = await websockets.connect(url, local_addr=("127.0.0.2", 0), max_size=CLIENT_MAX_FRAME_BYTES,
                                          compression=None)
            other = Link(ws, max_bytes=CLIENT_MAX_FRAME_BYTES, on_message=client._on_message, name=url)
            other.reader = asyncio.get_running_loop().create_task(other.run())
            other, _, _ = await client._greet(other, url)
            held.append(await circuit(other))  # another host is served
            assert len(public._forwards) == 4
            for link in held + [second, other]:
                await link.close()
    finally:
        await home.close()
        await public.close()
