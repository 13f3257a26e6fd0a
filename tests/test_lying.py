"""Lying peers: a hop whose output does not match its advert is caught, banned and routed around,
and the conversation ends with exactly the honest mesh's tokens.

The mesh: hop 0 (layers 0-0), two peers for layers 1-2 (one honest, one liar), hop 3 (layer 3).
The client is forced through the liar by planning without the honest twin; after the liar is
caught, failover plans freely and finds the twin.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace

import pytest
import torch

from helpers.meshkit import AlwaysDraft, crash, start_peer, wait_for_tables
from helpers.lying import LyingShard, noise
from meshinfer.client import reports, spotcheck
from meshinfer.wire import discovery, plausible, tensors
from meshinfer.core.config import LayerRange
from meshinfer.core.errors import LyingPeer
from meshinfer.core.sampling_params import SamplingParams
from meshinfer.engine.generate import greedy_generate, load_shard
from meshinfer.client.mesh import MeshClient
from meshinfer.client.routing import Hop, Route

MESSAGES = [{"role": "user", "content": "tell me a long story about meshes and hops"}]
N_TOKENS = 12


@pytest.fixture(scope="module")
def tiny(tiny):
    """conftest's tiny model with the chat's prompt ids and the whole model's greedy tokens after them."""
    path, digest, tok, whole = tiny
    ids = tok.encode_chat(MESSAGES)
    return path, digest, tok, ids, greedy_generate(whole, ids, max_tokens=N_TOKENS).token_ids


def skip_last_layer(shard, x, start, cache, run, logits):
    return shard(x, start, cache, run=LayerRange(run.start, run.stop - 1), logits=logits)


async def run_with_liar(tiny, *, lie_shard=None, lie_compute=None, rate=spotcheck.DEFAULT_SPOT_CHECK_RATE, seed=0):
    """Generate N_TOKENS through a route forced through the liar; (result, conversation, liar, twins)."""
    path, digest, tok, ids, _ = tiny
    shard = lambda a, b: load_shard(path, LayerRange(a, b))  # noqa: E731
    first = await start_peer(shard(0, 1), weights_hash=digest, bundle=tok.to_bundle())
    peers = [first] + [await start_peer(shard(a, b), weights_hash=digest, bootstrap=first.addrs, host=f"127.0.0.{i}")
                       for i, (a, b) in enumerate(((1, 3), (1, 3), (1, 3), (3, 4)), start=2)]
    # two honest twins, each on a loopback address of its own: a dispute needs a third opinion
    # from another host than the side it takes (MeshClient.host)
    twins, liar = (peers[1], peers[2]), peers[3]
    if lie_shard is not None:
        liar.shard = LyingShard(liar.shard, lie_shard)
    if lie_compute is not None:
        real = liar._finish_step  # what a hop yields from its forward pass: the hidden states it sends
        liar._finish_step = lambda *args: lie_compute(real(*args))
    try:
        await wait_for_tables(peers)
        async with MeshClient(list(first.addrs)) as client:
            route = await client.plan(exclude=frozenset(t.peer_id for t in twins))
            assert liar.peer_id in route.peer_ids
            conv = client.conversation(route, max_tokens_total=len(ids) + N_TOKENS, spot_check_rate=rate,
                                       spot_check_seed=seed)
            out = await conv.generate(ids, max_tokens=N_TOKENS, eos_ids=())
            await conv.close()
            assert liar.peer_id in client.backed_off()
            return out, conv, liar, twins
    finally:
        for p in peers:
            await p.close()


def assert_caught(out, conv, liar, twins, expected, reason: str):
    print("detections:", out.detections)
    assert out.token_ids == expected
    assert [d["peer"] for d in out.detections] == [liar.peer_id]
    assert reason in out.detections[0]["reason"]
    assert liar.peer_id not in conv.route.peer_ids and any(t.peer_id in conv.route.peer_ids for t in twins)


async def test_a_peer_that_skips_a_layer_is_caught_by_the_spot_check(tiny):
    out, conv, liar, twins = await run_with_liar(tiny, lie_shard=skip_last_layer)
    assert_caught(out, conv, liar, twins, tiny[4], "spot-check")
    assert out.detections[0]["kept_tokens"] == len(tiny[3])  # nothing was verified: back to the prompt


async def test_a_peer_adding_one_percent_noise_is_caught_by_the_spot_check(tiny):
    out, conv, liar, twins = await run_with_liar(tiny, lie_shard=noise(1e-2))
    assert_caught(out, conv, liar, twins, tiny[4], "relative L2")


async def test_a_peer_that_starts_lying_mid_generation_is_rolled_back(tiny):
    n_prompt = len(tiny[3])
    out, conv, liar, twins = await run_with_liar(tiny, lie_shard=noise(1.0, from_position=n_prompt + 3),
                                                rate=1.0, seed=3)
    assert_caught(out, conv, liar, twins, tiny[4], "spot-check")
    kept = out.detections[0]["kept_tokens"]
    assert n_prompt <= kept <= n_prompt + 4  # rolled back to the liar's last verified position


async def test_a_peer_that_logs_honestly_but_sends_noise_is_caught_by_the_next_hops_digests(tiny):
    def send_noise(out):  # the hop's log (for spot-checks) keeps the honest output
        return out + 1e-2 * out.pow(2).mean(-1, keepdim=True).sqrt() * torch.randn(out.shape)
    out, conv, liar, twins = await run_with_liar(tiny, lie_compute=send_noise)
    assert_caught(out, conv, liar, twins, tiny[4], "signed and sent what peer")


async def test_garbage_norms_are_caught_by_the_next_hop(tiny):
    out, conv, liar, twins = await run_with_liar(tiny, lie_compute=lambda out: out * 1e7)
    assert_caught(out, conv, liar, twins, tiny[4], "outside the plausible band")


async def test_an_extra_position_is_caught_by_the_next_hop(tiny):
    """A hop that sends one position more than the step has: the count is part of what the
    client signed (protocol 3), so the next hop refuses the step at once and names it (before,
    the last hop's position count caught it after the step)."""
    out, conv, liar, twins = await run_with_liar(tiny, lie_compute=lambda out: torch.cat([out, out[:, -1:]], 1))
    assert_caught(out, conv, liar, twins, tiny[4], "with fields the client did not sign")


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
async def test_honest_mesh_with_spot_checks_detects_nothing(tiny, temperature):
    from meshinfer.core.sampling_params import SamplingParams

    path, digest, tok, ids, expected = tiny
    shard = lambda a, b: load_shard(path, LayerRange(a, b))  # noqa: E731
    first = await start_peer(shard(0, 2), weights_hash=digest, bundle=tok.to_bundle())
    peers = [first] + [await start_peer(shard(a, b), weights_hash=digest, bootstrap=first.addrs)
                       for a, b in ((0, 2), (2, 4), (2, 4))]
    try:
        await wait_for_tables(peers)
        async with MeshClient(list(first.addrs)) as client:
            route = await client.plan()
            conv = client.conversation(route, max_tokens_total=len(ids) + N_TOKENS, spot_check_rate=1.0)
            out = await conv.generate(ids, max_tokens=N_TOKENS, eos_ids=(),
                                      sampling=SamplingParams(temperature=temperature, seed=5))
            await conv.close()
    finally:
        for p in peers:
            await p.close()
    assert out.detections == [] and out.failovers == []
    if temperature == 0:
        assert out.token_ids == expected
        assert conv.audit.checks >= N_TOKENS  # the prefill check of both hops, then one per decode step
    else:  # the sampled last hop is not checked (its tokens are not the argmax); the first hop is
        assert len(out.token_ids) == N_TOKENS and conv.audit.checks >= 1


def test_cheap_checks_name_the_sender():
    C = 8
    ok = torch.ones(1, 3, C)
    plausible.check_hidden(ok, width=C, sender="abc")
    cases = [(ok.double(), "dtype torch.float64"), (ok[0], "shape (3, 8)"), (torch.ones(1, 3, C + 1), "not (1, T, 8)"),
             (torch.full((1, 3, C), math.nan), "NaN or inf"), (torch.zeros(1, 3, C), "RMS 0"),
             (torch.full((1, 3, C), 1e6), "RMS 1e+06")]
    for x, text in cases:
        with pytest.raises(LyingPeer, match="previous hop abc") as err:
            plausible.check_hidden(x, width=C, sender="abc")
        assert text in str(err.value) and err.value.suspect == "abc"


def test_relative_error_and_tolerance():
    y = torch.randn(1, 5, 16, generator=torch.Generator().manual_seed(0))
    assert spotcheck.relative_error(y, y) == 0.0
    assert spotcheck.relative_error(y, y[:, :4]) == math.inf
    assert 0.5e-2 < spotcheck.relative_error(y, y * 1.01) < 1.5e-2
    assert spotcheck.TOLERANCE["f32"] < 1e-2  # one-percent noise must stay detectable


@pytest.mark.realmodel
async def test_default_model_liar_is_caught_and_output_is_exact():
    """3 honest peers + 1 liar with the same range as two of them (layers 0-11, 1% noise): the
    second honest twin, on a host of its own, settles the dispute between the liar and the first."""
    from helpers.realmodels import model_path
    from helpers.meshkit import file_hash
    from helpers.realmodels import DEFAULT, load_cases, shard_of
    from meshinfer.text.tokenizer import Tokenizer

    path = model_path(DEFAULT)
    digest, tok = file_hash(path), Tokenizer.from_gguf(path)
    case = load_cases(DEFAULT)["prime"]
    ids, n = case["prompt_ids"], 8
    honest = await start_peer(shard_of(DEFAULT, 0, 12), weights_hash=digest, bundle=tok.to_bundle())
    liar = await start_peer(shard_of(DEFAULT, 0, 12), weights_hash=digest, bundle=tok.to_bundle(),
                            bootstrap=honest.addrs, host="127.0.0.2")
    last = await start_peer(shard_of(DEFAULT, 12, 24), weights_hash=digest, bootstrap=honest.addrs, host="127.0.0.3")
    referee = await start_peer(shard_of(DEFAULT, 0, 12), weights_hash=digest, bundle=tok.to_bundle(),
                               bootstrap=honest.addrs, host="127.0.0.4")
    liar.shard = LyingShard(liar.shard, noise(1e-2))
    peers = [honest, liar, last, referee]
    try:
        await wait_for_tables(peers)
        async with MeshClient(list(honest.addrs)) as client:
            route = await client.plan(exclude=frozenset({honest.peer_id, referee.peer_id}))
            conv = client.conversation(route, max_tokens_total=len(ids) + n)
            out = await conv.generate(ids, max_tokens=n, eos_ids=())
            await conv.close()
    finally:
        for p in peers:
            await p.close()
    print("detections:", out.detections)
    assert out.token_ids == case["greedy_ids"][:n]
    assert [d["peer"] for d in out.detections] == [liar.peer_id]
    assert "relative L2" in out.detections[0]["reason"]
    assert conv.route.peer_ids in ((honest.peer_id, last.peer_id), (referee.peer_id, last.peer_id))


async def test_two_checkers_on_one_host_agreeing_on_a_lie_cannot_get_a_hop_banned(tiny):
    """Found by an attack run: two checker identities on one host (keys are free) gave the same
    false recomputation of honest hop A's layers; the second settled the first's dispute against
    A, and A was banned and replaced by a liar. A referee settles a dispute only from another
    host than the side it takes: here the dispute stays undecided, A stays on the route
    (unverified) and the reply is exact."""
    ids, expected = tiny[3], tiny[4]
    peers = await start_lying_mesh(tiny, [(0, 1), (1, 3), (1, 3), (1, 3), (3, 4)],
                                   hosts=["127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.3", "127.0.0.4"])
    first, a, b, c, last = peers
    for liar in (b, c):  # the same deterministic noise: the two agree with each other
        liar.shard = LyingShard(liar.shard, noise(1e-2))
    try:
        async with MeshClient(list(first.addrs)) as client:
            route = await client.plan(exclude=frozenset({b.peer_id, c.peer_id}))
            conv = client.conversation(route, max_tokens_total=len(ids) + N_TOKENS, spot_check_rate=1.0,
                                       spot_check_seed=0)
            out = await conv.generate(ids, max_tokens=N_TOKENS, eos_ids=())
            await conv.close()
            backed_off = client.backed_off()
            disputes = conv.audit.disputed_by(a.peer_id)
    finally:
        for p in peers:
            await p.close()
    assert out.token_ids == expected and out.detections == []
    assert a.peer_id not in backed_off and conv.route.peer_ids == (first.peer_id, a.peer_id, last.peer_id)
    assert disputes and set(disputes) <= {b.peer_id, c.peer_id}  # recorded, undecided


async def test_verify_and_get_log_requests_are_bounded_and_exact(tiny):
    """``verify`` recomputes exactly what a whole-model pass gives; bad requests get one-line errors."""
    from meshinfer.core.errors import InvalidInput as Bad, LayerRangeError, ProtocolError
    from meshinfer.engine.generate import load_shard as load

    path, digest, tok, ids, _ = tiny
    whole = load(path)
    peer = await start_peer(load(path, LayerRange(1, 4)), weights_hash=digest, max_step_tokens=16)
    try:
        async with MeshClient(list(peer.addrs)) as client:
            await client.refresh()
            link = await client.link(peer.advert())
            ask = lambda **f: link.request("verify", timeout_s=10, **f)  # noqa: E731
            h = whole(torch.tensor([ids[:10]]), 0, None, run=LayerRange(0, 1))  # (1, 10, C) after layer 0
            _, f = await ask(layers=[1, 4], hidden=tensors.tensor_to_wire(h), check=6)
            logits = whole(torch.tensor([ids[:10]]), 0, None, logits="all")  # (1, 10, V)
            assert f.get("tokens", list) == [int(t) for t in logits[0, 6:].argmax(-1)]
            _, f = await ask(layers=[1, 3], hidden=tensors.tensor_to_wire(h), check=0)
            want = whole(h, 0, None, run=LayerRange(1, 3))
            assert spotcheck.relative_error(want, tensors.tensor_from_wire(f.get("hidden", dict),
                                                                            max_elements=1 << 20)) < 1e-6
            with pytest.raises(LayerRangeError, match="verify: this peer serves layers 1-3, asked for 0-3"):
                await ask(layers=[0, 4], tokens=[1, 2], check=0)
            with pytest.raises(ProtocolError, match="tensor: 544 elements exceed the limit of 512"):
                await ask(layers=[1, 4], hidden=tensors.tensor_to_wire(torch.ones(1, 17, 32)), check=0)
            with pytest.raises(ProtocolError, match="field 'check' = 3 is outside"):
                await ask(layers=[1, 4], hidden=tensors.tensor_to_wire(torch.ones(1, 3, 32)), check=3)
            with pytest.raises(Bad, match="get_log: no such conversation on this connection"):
                await link.request("get_log", timeout_s=10, conv="nope", start=0, stop=1)
    finally:
        await peer.close()


async def start_lying_mesh(tiny, ranges, hosts=None):
    """Peers of ``ranges`` (the first as bootstrap), tables complete. Each listens on a loopback
    address of its own (``hosts[i]``, default 127.0.0.(i + 1)): the client counts peers on one
    address as one witness (``MeshClient.host``), so these are distinct hosts to it."""
    path, digest, tok, _, _ = tiny
    hosts = hosts or [f"127.0.0.{i + 1}" for i in range(len(ranges))]
    first = await start_peer(load_shard(path, LayerRange(*ranges[0])), weights_hash=digest, bundle=tok.to_bundle(),
                             host=hosts[0])
    peers = [first] + [await start_peer(load_shard(path, LayerRange(a, b)), weights_hash=digest,
                                        bootstrap=first.addrs, host=h) for (a, b), h in zip(ranges[1:], hosts[1:])]
    await wait_for_tables(peers)
    return peers


async def test_a_checker_that_lies_in_verify_is_outvoted_and_the_hop_stays(tiny):
    """Hop A (layers 1-2) is honest; checker B recomputes with noise; a third peer C settles it:
    B is banned, A stays on the route, the tokens are the honest ones."""
    ids, expected = tiny[3], tiny[4]
    peers = await start_lying_mesh(tiny, [(0, 1), (1, 3), (1, 3), (1, 3), (3, 4)])
    first, a, b, c, last = peers
    b.shard = LyingShard(b.shard, noise(1e-2))  # b is on no route: only its verify answers lie
    try:
        async with MeshClient(list(first.addrs)) as client:
            route = await client.plan(exclude=frozenset({b.peer_id, c.peer_id}))
            conv = client.conversation(route, max_tokens_total=len(ids) + N_TOKENS, spot_check_rate=1.0,
                                       spot_check_seed=0)
            real_choice = conv.audit.rng.choice  # b checks whenever it can; c is left as the referee
            conv.audit.rng.choice = lambda seq: next((p for p in seq if p.peer_id == b.peer_id), None) or \
                real_choice(seq)
            out = await conv.generate(ids, max_tokens=N_TOKENS, eos_ids=())
            await conv.close()
            assert out.token_ids == expected
            assert b.peer_id in client.backed_off() and a.peer_id not in client.backed_off()
            assert conv.route.peer_ids == (first.peer_id, a.peer_id, last.peer_id) and out.failovers == []
            assert [d["peer"] for d in out.detections] == [b.peer_id]
            assert "that peer" in out.detections[0]["reason"] and "contradict" in out.detections[0]["reason"]
    finally:
        for p in peers:
            await p.close()


async def test_a_lone_peer_advertising_every_layer_at_no_cost_is_checked_and_caught(tiny):
    """The liar serves all 4 layers, adds noise, and advertises 0 ms of compute, so the fastest
    route is the liar alone, which no peer could check. The planner prefers a route whose hops
    another peer serves whole: the liar gets some of the layers, a spot-check catches it, and the
    tokens are the honest ones."""
    ids, expected = tiny[3], tiny[4]
    peers = await start_lying_mesh(tiny, [(0, 2), (2, 4), (0, 4)])
    a, b, liar = peers
    liar.shard = LyingShard(liar.shard, noise(1.0))  # its verify answers lie too
    liar.compute_ms_per_token = 0.0  # its next adverts say so
    try:
        async with asyncio.timeout(10):
            while any(p.compute_ms_per_token for p in a.table.adverts() if p.peer_id == liar.peer_id):
                await asyncio.sleep(0.05)
        async with MeshClient(list(a.addrs)) as client:
            route = await client.plan()
            # the liar is on the route but not alone (under load RTTs can make a 3-hop route cheapest)
            assert liar.peer_id in route.peer_ids and len(route.hops) >= 2
            conv = client.conversation(route, max_tokens_total=len(ids) + N_TOKENS, spot_check_rate=1.0)
            out = await conv.generate(ids, max_tokens=N_TOKENS, eos_ids=())
            await conv.close()
            assert out.token_ids == expected
            assert [d["peer"] for d in out.detections] == [liar.peer_id]  # it contradicted both a and b
            assert conv.route.peer_ids == (a.peer_id, b.peer_id) and liar.peer_id in client.backed_off()
            assert not {a.peer_id, b.peer_id} & client.backed_off()
            assert out.unverified == [  # no twin left for either hop: the result says so
                {"peer": h.peer_id, "layers": h.layers.cli(), "reason": "no other peer serves these layers at f32 with these weights, "
                 "so nothing can check them"} for h in conv.route.hops]
    finally:
        for p in peers:
            await p.close()


async def test_a_reply_with_every_hop_checked_reports_nothing_unverified(tiny):
    ids = tiny[3]
    peers = await start_lying_mesh(tiny, [(0, 2), (0, 2), (2, 4), (2, 4)])
    try:
        async with MeshClient(list(peers[0].addrs)) as client:
            conv = client.conversation(await client.plan(), max_tokens_total=len(ids) + 4)
            out = await conv.generate(ids, max_tokens=4, eos_ids=())
            assert out.unverified == []
            unchecked = client.conversation(conv.route, max_tokens_total=len(ids) + 4, spot_check_rate=0.0)
            out = await unchecked.generate(ids, max_tokens=4, eos_ids=())
            # (measured RTTs under load may make a 3-hop route, e.g. 0-0, 1-1, 2-3, the cheapest)
            assert len(unchecked.route.hops) >= 2
            assert [(u["peer"], u["reason"]) for u in out.unverified] == [
                (h.peer_id, "spot-checks are off") for h in unchecked.route.hops]
            await conv.close()
            await unchecked.close()
    finally:
        for p in peers:
            await p.close()


async def generate_over(peers, route_peers, ids, **conv_options) -> tuple:
    """Plan a route through ``route_peers`` (the other ``peers`` excluded), generate N_TOKENS
    over it and close every peer; (result, conversation, backed-off peer ids)."""
    try:
        async with MeshClient(list(peers[0].addrs)) as client:
            route = await client.plan(exclude=frozenset(p.peer_id for p in peers if p not in route_peers))
            assert route.peer_ids == tuple(p.peer_id for p in route_peers)
            conv = client.conversation(route, max_tokens_total=len(ids) + N_TOKENS, **conv_options)
            out = await conv.generate(ids, max_tokens=N_TOKENS, eos_ids=())
            await conv.close()
            return out, conv, client.backed_off()
    finally:
        for p in peers:
            await p.close()


@pytest.mark.parametrize("lies", [("token",), ("token", "probed"), ("token", "probed", "log")],
                         ids=["in_its_token_reply", "in_probes_too", "forging_its_log_too"])
async def test_a_last_hop_that_over_reports_its_positions_is_the_one_excluded(tiny, monkeypatch, lies):
    """The last hop says it holds one position more than it does, in its ``token`` replies (and,
    a consistent liar, in its ``probed`` answers). The client banned the honest hop before it:
    the probes blamed the previous hop of the first hop holding another count. Now the hop that
    reported the wrong count is the suspect when the others agree with the conversation.

    The thorough liar also forges its log: a digest for the position it never received, and its
    previous hop's signed step moved to cover it. Before steps were signed, a digest was all the
    client asked for, and the honest previous hop was blamed; the signature does not verify."""
    from meshinfer.wire.transport import Link

    ids, expected = tiny[3], tiny[4]
    peers = await start_lying_mesh(tiny, [(0, 1), (1, 3), (3, 4), (3, 4)])
    first, middle, liar, twin = peers
    real_send = Link.send

    async def send(link, msg_type, **fields):
        if msg_type in lies and any(c.owner is link for c in liar.convs.values()):
            if msg_type != "log":
                fields["length"] += 1
            elif "signed" in fields:  # the genuine statement moved one position on, and a digest for it
                fields["received"] = bytes(range(16))
                fields["signed"] = {**fields["signed"], "start": fields["signed"]["start"] + 1}
        return await real_send(link, msg_type, **fields)

    monkeypatch.setattr(Link, "send", send)
    out, conv, banned = await generate_over(peers, (first, middle, liar), ids)
    assert out.token_ids == expected
    assert liar.peer_id in banned and not {first.peer_id, middle.peer_id} & banned
    assert [d["peer"] for d in out.detections] == [liar.peer_id]
    assert "positions after the step" in out.detections[0]["reason"]
    assert conv.route.peer_ids == (first.peer_id, middle.peer_id, twin.peer_id)


async def test_a_hop_that_does_not_sign_its_steps_is_refused_by_the_next_and_replaced(tiny):
    """Every hop signs the hidden states it sends (``Steps.sign``), and the next hop checks the
    signature against the key the sender proved in its handshake: a step without a valid one is
    refused with ``lying_peer`` naming the sender, which is replaced; the reply is unchanged."""
    ids, expected = tiny[3], tiny[4]
    peers = await start_lying_mesh(tiny, [(0, 1), (1, 3), (1, 3), (3, 4)])
    first, unsigned, twin, last = peers
    unsigned.steps.sign = lambda conv, seq, start, hidden: bytes(64)
    out, conv, banned = await generate_over(peers, (first, unsigned, last), ids)
    assert out.token_ids == expected
    assert [d["peer"] for d in out.detections] == [unsigned.peer_id]
    assert "without a valid signature" in out.detections[0]["reason"]
    assert unsigned.peer_id in banned and not {first.peer_id, last.peer_id} & banned
    assert conv.route.peer_ids == (first.peer_id, twin.peer_id, last.peer_id)


@pytest.mark.parametrize("change", ["sampling", "want", "drop_csig"])
async def test_a_hop_cannot_change_what_the_client_asked_of_the_hops_after_it(tiny, change):
    """A middle hop passes on the client's step with a field changed: ``sampling`` added (the
    honest last hop would sample, and the spot-check would then blame it for a token that is
    not the argmax), ``want`` set to "none" (the last hop would answer nothing and the step
    fail blaming nobody), or the client's signature left out. Every step carries the client's
    signature of those fields (protocol 3, ``convkeys.StepHeader``), so the next hop refuses it
    and names the hop that changed it; the reply equals plain greedy generation."""
    ids, expected = tiny[3], tiny[4]
    peers = await start_lying_mesh(tiny, [(0, 1), (1, 3), (1, 3), (3, 4)])
    first, liar, twin, last = peers
    real_run, changed = liar.steps.run, []

    async def run(conv, step):
        if step.x is not None and step.x.shape[1] == 1:  # decode steps
            changed.append(step.seq)
            if change == "sampling":
                step = replace(step, header=replace(step.header, sampling=SamplingParams(temperature=1.5, seed=3)))
            elif change == "want":
                step = replace(step, want="none")
            else:
                step = replace(step, csig=b"")
        await real_run(conv, step)

    liar.steps.run = run
    out, conv, banned = await generate_over(peers, (first, liar, last), ids)
    assert changed and out.token_ids == expected
    assert [d["peer"] for d in out.detections] == [liar.peer_id]
    assert "with fields the client did not sign" in out.detections[0]["reason"]
    assert liar.peer_id in banned and not {first.peer_id, last.peer_id} & banned
    assert conv.route.peer_ids == (first.peer_id, twin.peer_id, last.peer_id)


async def test_a_next_hop_showing_false_digests_cannot_frame_the_hop_before_it(tiny, monkeypatch):
    """The last hop shows the client digests of inputs it never received (its ``log`` replies).
    The spot-check found the middle hop's log and those digests differing and excluded the log's
    owner, the honest middle hop. Now the last hop must show the middle hop's signature of the
    step it claims; it cannot, and is the one excluded."""
    from meshinfer.wire.transport import Link

    ids, expected = tiny[3], tiny[4]
    peers = await start_lying_mesh(tiny, [(0, 1), (1, 3), (1, 3), (3, 4), (3, 4)])
    first, middle, middle_twin, liar, liar_twin = peers
    real_send = Link.send

    async def send(link, msg_type, **fields):
        if msg_type == "log" and "received" in fields and any(c.owner is link for c in liar.convs.values()):
            fields["received"] = bytes(len(fields["received"]))
        return await real_send(link, msg_type, **fields)

    monkeypatch.setattr(Link, "send", send)
    out, conv, banned = await generate_over(peers, (first, middle, liar), ids, spot_check_rate=1.0,
                                            spot_check_seed=0)
    assert out.token_ids == expected
    assert [d["peer"] for d in out.detections] == [liar.peer_id]
    assert "shows a digest that peer" in out.detections[0]["reason"]
    assert liar.peer_id in banned and middle.peer_id not in banned
    assert conv.route.peer_ids[-1] == liar_twin.peer_id  # (the failover may take either middle peer)


async def test_a_hop_cannot_frame_the_hop_before_it_with_plausible_evidence(tiny):
    """A hop reports that its previous hop sent implausible hidden states, and shows as evidence
    what that hop really signed and sent, whose values pass the checks. The client used to take a
    cheap check's accusation on the reporter's word; it repeats the check on signed evidence
    (``hops.weigh_evidence``), and the accuser is the one excluded. (Hidden states that really
    fail the checks are still blamed on their sender: ``test_garbage_norms_are_caught_by_the_next_hop``.)"""
    ids, expected = tiny[3], tiny[4]
    peers = await start_lying_mesh(tiny, [(0, 1), (1, 3), (3, 4), (3, 4)])
    first, middle, liar, twin = peers
    real = liar.steps.accept_from_previous_hop

    def accuse(link, conv, f, seq, start, x, digests, header):
        if real(link, conv, f, seq, start, x, digests, header):
            exc = LyingPeer(f"previous hop {conv.prev_id[:12]} sent hidden states with RMS 1e+09, outside the "
                            f"plausible band", suspect=conv.prev_id)
            conv.owner.post("error", conv=conv.conv_id, seq=seq, code=exc.code, message=str(exc), suspect=exc.suspect,
                            evidence={"start": start, "sig": f.get("sig", bytes), "hidden": f.get("hidden", dict)})
        return False

    liar.steps.accept_from_previous_hop = accuse
    out, conv, banned = await generate_over(peers, (first, middle, liar), ids)
    assert out.token_ids == expected
    assert [d["peer"] for d in out.detections] == [liar.peer_id]
    assert "the signed hidden states it shows pass the checks" in out.detections[0]["reason"]
    assert liar.peer_id in banned and middle.peer_id not in banned
    assert conv.route.peer_ids == (first.peer_id, middle.peer_id, twin.peer_id)


def made_up_steps(liar, when, frames):
    """Make ``liar`` run its steps honestly and, after each step ``when(conv, step)`` accepts,
    send its next hop the steps ``frames(conv, step)`` lists (``(seq, start, hidden, fields)``),
    each validly signed with the liar's own key: steps the client never sent."""
    real_run = liar.steps.run

    async def run(conv, step):
        await real_run(conv, step)
        if conv.next_id is not None and when(conv, step):
            nxt = await liar.conns.link_to(conv.next_id, conv.next_addrs, conv.next_relays)
            for seq, start, hidden, fields in frames(conv, step):
                await nxt.send("step", conv=conv.conv_id, seq=seq, start=start, want="none", trace=[],
                               hidden=tensors.tensor_to_wire(hidden), **fields,
                               sig=discovery.sign_step(liar.key, conv.conv_id, seq, start, tensors.row_digests(hidden)))

    liar.steps.run = run


@pytest.mark.parametrize("made_up", ["replay", "rollback"])
async def test_a_hop_cannot_frame_its_next_hop_with_steps_the_client_never_sent(tiny, made_up):
    """A hop computes, logs and signs honestly, but once sends its next hop a step of its own,
    signed, under a seq the client never used: a failover ``replay`` of position 0, or a
    ``rollback`` of the last position, with the row slightly changed. Before protocol 3 the next
    hop took it (it could not know the client's steps), and the spot-check found the hop's log
    and the next hop's digests differing; the next hop used to be blamed (found by an attack
    run), and then the made-up step's statement convicted its signer. Since protocol 3 every
    step carries the client's signature of its seq, positions and flags, so the next hop refuses
    the made-up step at once, naming the hop that sent it."""
    ids, expected = tiny[3], tiny[4]
    peers = await start_lying_mesh(tiny, [(0, 1), (1, 3), (1, 3), (3, 4), (3, 4)])
    first, liar, liar_twin, victim, victim_twin = peers
    done = []

    def when(conv, step):
        if done or step.start < (1 if made_up == "replay" else len(ids) + 1):
            return False
        done.append(step.start)
        return True

    def frames(conv, step):
        p = 0 if made_up == "replay" else step.start
        row = conv.sent.slice(p, p + 1).clone() * (1 + 1e-3)
        return [(10**9, p, row, {"replay": True} if made_up == "replay" else {"rollback": True})]

    made_up_steps(liar, when, frames)
    out, conv, banned = await generate_over(peers, (first, liar, victim), ids, spot_check_rate=1.0, spot_check_seed=0)
    assert done and out.token_ids == expected
    assert [d["peer"] for d in out.detections] == [liar.peer_id]
    assert "with fields the client did not sign" in out.detections[0]["reason"]
    assert liar.peer_id in banned and victim.peer_id not in banned


async def test_a_hop_cannot_frame_its_next_hop_with_an_old_step_of_the_client(tiny):
    """A hop re-sends its next hop the client's own first step (its seq, start and length, the
    first row changed, newly signed) as a failover replay, after later steps. Every field was
    one the client issued, so the statement passed the client's check, and the next hop, which
    took it, was blamed for showing a statement older than the client's last step there. The
    client's seqs only grow and hops pass them on in order: a hop now refuses a step from its
    previous hop whose seq is not above the last it took, naming that hop (found by an attack
    run)."""
    ids, expected = tiny[3], tiny[4]
    peers = await start_lying_mesh(tiny, [(0, 1), (1, 3), (1, 3), (3, 4), (3, 4)])
    first, liar, liar_twin, victim, victim_twin = peers
    prefill, done = [], []

    def when(conv, step):
        if step.start == 0:
            prefill.append((step.seq, step.x.shape[1]))
        if done or step.start < len(ids) + 1:
            return False
        done.append(step.seq)
        return True

    def frames(conv, step):
        seq, n = prefill[0]
        rows = conv.sent.slice(0, n).clone()
        rows[:, 0] *= 1 + 1e-3
        return [(seq, 0, rows, {"replay": True})]

    made_up_steps(liar, when, frames)
    out, conv, banned = await generate_over(peers, (first, liar, victim), ids, spot_check_rate=1.0, spot_check_seed=0)
    assert done and out.token_ids == expected
    assert [d["peer"] for d in out.detections] == [liar.peer_id] and "after step" in out.detections[0]["reason"]
    assert liar.peer_id in banned and victim.peer_id not in banned


async def test_a_hop_cannot_frame_its_next_hop_by_making_up_positions(tiny):
    """On one decode step a hop sends its next hop two positions under a made-up seq, then the
    step itself two positions on: the last hop truthfully holds two positions more than the
    conversation. The client asked the last hop for the signed statement of its own step, which
    does not cover the extra positions, and blamed it; now it asks for the newest statement
    covering the first extra position: the made-up step, signed by the hop before (found by an
    attack run)."""
    ids, expected = tiny[3], tiny[4]
    peers = await start_lying_mesh(tiny, [(0, 1), (1, 3), (1, 3), (3, 4), (3, 4)])
    first, liar, liar_twin, victim, victim_twin = peers
    real_run, done = liar.steps.run, []

    async def run(conv, step):
        if done or step.x is None or step.start < len(ids) + 2 or step.x.shape[1] != 1:
            return await real_run(conv, step)
        done.append(step.seq)
        out = await liar.scheduler.submit(conv, step.x, step.start, step.want, step.sampling, timing={})
        nxt = await liar.conns.link_to(conv.next_id, conv.next_addrs, conv.next_relays)
        for seq, start, hidden, want in ((10**9, step.start, torch.cat([out, out], 1), "none"),
                                         (step.seq, step.start + 2, out, step.want)):
            await nxt.send("step", conv=conv.conv_id, seq=seq, start=start, want=want, trace=step.trace,
                           hidden=tensors.tensor_to_wire(hidden),
                           sig=discovery.sign_step(liar.key, conv.conv_id, seq, start, tensors.row_digests(hidden)))
        conv.next_link, conv.forwarded_seq = nxt, step.seq

    liar.steps.run = run
    out, conv, banned = await generate_over(peers, (first, liar, victim), ids, spot_check_rate=0.0)
    assert done and out.token_ids == expected
    assert [d["peer"] for d in out.detections] == [liar.peer_id]
    assert liar.peer_id in banned and victim.peer_id not in banned


@pytest.mark.parametrize("probe", ["fewer", "silent"])
async def test_a_last_hop_that_contradicts_its_own_reply_is_the_one_excluded(tiny, monkeypatch, probe):
    """The last hop reports one position more than the conversation in its ``token`` reply, then
    answers the client's probe with one fewer (or not at all). "Fewer, or no answer" blamed the
    hop before it; the last hop's probe contradicting the reply it just sent now blames itself
    (found by an attack run)."""
    from meshinfer.wire.transport import Link

    ids, expected = tiny[3], tiny[4]
    peers = await start_lying_mesh(tiny, [(0, 1), (1, 3), (1, 3), (3, 4), (3, 4)])
    first, middle, middle_twin, liar, liar_twin = peers
    real_send, lied = Link.send, []

    async def send(link, msg_type, **fields):
        if any(c.owner is link for c in liar.convs.values()):
            if msg_type == "token" and not lied and fields.get("length", 0) > len(ids) + 2:
                lied.append(True)
                fields["length"] += 1
            elif msg_type == "probed" and lied:
                if probe == "silent":
                    return None
                fields["length"] -= 1
        return await real_send(link, msg_type, **fields)

    monkeypatch.setattr(Link, "send", send)
    out, conv, banned = await generate_over(peers, (first, middle, liar), ids, spot_check_rate=0.0)
    assert lied and out.token_ids == expected
    assert [d["peer"] for d in out.detections] == [liar.peer_id]
    assert liar.peer_id in banned and middle.peer_id not in banned


async def two_hops_and_a_stranger(tiny):
    """Peers a (layers 0-1) and b (2-3) of the tiny model, and c: a peer of another model (another
    weights hash, half of it) linked to them, never on their conversations' routes. Tables synced."""
    path, digest, tok, _, _ = tiny
    bundle = tok.to_bundle()
    a = await start_peer(load_shard(path, LayerRange(0, 2)), weights_hash=digest, bundle=bundle)
    b = await start_peer(load_shard(path, LayerRange(2, 4)), weights_hash=digest, bundle=bundle, bootstrap=a.addrs)
    c = await start_peer(load_shard(path, LayerRange(0, 2)), weights_hash="f" * 64, bundle=bundle, bootstrap=a.addrs)
    try:
        await wait_for_tables([a, b, c])
    except BaseException:
        for p in (a, b, c):
            await p.close()
        raise
    return a, b, c


async def test_a_peer_off_the_route_cannot_fail_over_a_conversation_by_naming_it(tiny):
    """A peer that is not on the route but holds a link to the client (a relay sees conversation
    ids in cleartext) sends ``peer_unavailable`` errors for the conversation, with no ``seq``: the
    client used to fail over on them and back off honest hops until no route was left. Only the
    route's hops speak for a conversation now."""
    path, _, tok, _, _ = tiny
    a, b, c = await two_hops_and_a_stranger(tiny)
    ids = tok.encode_chat([{"role": "user", "content": "hello"}])
    try:
        async with MeshClient(list(a.addrs)) as client:
            route = await client.plan()
            assert route.peer_ids == (a.peer_id, b.peer_id)
            await client.link(client.table[c.peer_id])
            link = next(lk for lk in c._all_links if lk.role == "client")
            conv = client.conversation(route, max_tokens_total=len(ids) + 8, speculate=False)

            async def inject():
                while True:
                    link.post("error", conv=conv.conv_id, code="peer_unavailable", message="the stranger says so")
                    await asyncio.sleep(0.005)

            injecting = asyncio.ensure_future(inject())
            try:
                out = await conv.generate(ids, max_tokens=8, eos_ids=())
            finally:
                injecting.cancel()
                await conv.close()
            assert out.token_ids == greedy_generate(load_shard(path), ids, max_tokens=8).token_ids
            assert conv.failovers == [] and client.backed_off() == set()
    finally:
        for p in (a, b, c):
            await p.close()


async def _liar_spare_and_two_next(tiny) -> tuple:
    """(liar, spare, all four peers): two peers of layers 0-1 (the first will lie, the second is
    its spare) and two honest ones of layers 2-3, all of the tiny model."""
    path, digest, tok, _, _ = tiny
    bundle = tok.to_bundle()
    liar = await start_peer(load_shard(path, LayerRange(0, 2)), weights_hash=digest, bundle=bundle)
    spare = await start_peer(load_shard(path, LayerRange(0, 2)), weights_hash=digest, bundle=bundle,
                             bootstrap=liar.addrs)
    peers = [liar, spare] + [await start_peer(load_shard(path, LayerRange(2, 4)), weights_hash=digest, bundle=bundle,
                                              bootstrap=liar.addrs) for _ in range(2)]
    return liar, spare, peers


async def test_a_hop_that_keeps_reporting_its_next_hop_gone_is_replaced_with_it(tiny):
    """A first hop that answers decode steps with ``peer_unavailable`` naming its next hop, while
    every hop answers the client's probes, cost 3 failovers a step, every step, and was chosen
    again. Its second report that no probe bears out replaces it and the hop it names (which of
    the two broke their link cannot be told); the reply is still exact."""
    path, _, tok, _, _ = tiny
    liar, spare, peers = await _liar_spare_and_two_next(tiny)
    ids = tok.encode_chat([{"role": "user", "content": "hello"}])
    honest_run, reports = liar.steps.run, []
    try:
        await wait_for_tables(peers)
        async with MeshClient(list(liar.addrs)) as client:
            client.mark_failed(spare.peer_id)  # so every route runs through the liar until it is blamed

            async def run(conv, step):
                if step.start == 0 or step.replay:
                    return await honest_run(conv, step)
                reports.append(conv.next_id)
                if len(reports) == 2:
                    client._failed.pop(spare.peer_id)  # the liar's replacement is there when it is needed
                await conv.owner.send("error", conv=conv.conv_id, seq=step.seq, code="peer_unavailable",
                                      message="my next hop is gone", peer=conv.next_id)

            liar.steps.run = run
            route = await client.plan()
            conv = client.conversation(route, max_tokens_total=len(ids) + 8, speculate=False)
            try:
                out = await conv.generate(ids, max_tokens=8, eos_ids=())
            finally:
                await conv.close()
            assert out.token_ids == greedy_generate(load_shard(path), ids, max_tokens=8).token_ids
            assert route.hops[0].peer_id == liar.peer_id and len(reports) == 2
            assert conv.unconfirmed_reports == {liar.peer_id: 2}
            assert len(conv.failovers) == 2 and conv.failovers[1]["failed"] == sorted([liar.peer_id, reports[1]])
            assert {liar.peer_id, reports[1]} <= client.backed_off()
            assert conv.route.hops[0].peer_id == spare.peer_id and reports[1] not in conv.route.peer_ids
    finally:
        for p in peers:
            await p.close()


async def test_a_hop_that_reports_its_next_hop_gone_once_per_conversation_is_blamed_by_its_second(tiny):
    """A first hop that makes one false ``peer_unavailable`` report in each new conversation: counted
    per conversation, each report was a first, so the liar was never replaced and cost each
    conversation a failover (and one honest next hop with a second report). Counted by the client,
    its report in the second conversation replaces it, and its third, after its backoff ran out,
    replaces it alone: the honest hop named that time stays."""
    path, _, tok, _, _ = tiny
    liar, spare, peers = await _liar_spare_and_two_next(tiny)
    ids = tok.encode_chat([{"role": "user", "content": "hello"}])
    expected = greedy_generate(load_shard(path), ids, max_tokens=6).token_ids
    honest_run, named = liar.steps.run, {}  # conversation id -> the next hop its one report named

    async def run(conv, step):
        if step.start == 0 or step.replay or conv.conv_id in named:
            return await honest_run(conv, step)
        named[conv.conv_id] = conv.next_id
        client._failed.pop(spare.peer_id, None)  # the liar's replacement is there if it is needed
        await conv.owner.send("error", conv=conv.conv_id, seq=step.seq, code="peer_unavailable",
                              message="my next hop is gone", peer=conv.next_id)

    try:
        await wait_for_tables(peers)
        async with MeshClient(list(liar.addrs)) as client:
            liar.steps.run = run
            convs = []
            for _ in range(3):
                client._failed.pop(liar.peer_id, None)  # its backoff ran out
                client._failed[spare.peer_id] = (math.inf, 0)  # so the route runs through the liar
                route = await client.plan()
                assert route.hops[0].peer_id == liar.peer_id
                conv = client.conversation(route, max_tokens_total=len(ids) + 6, speculate=False)
                try:
                    assert (await conv.generate(ids, max_tokens=6, eos_ids=())).token_ids == expected
                finally:
                    await conv.close()
                convs.append(conv)
                if len(convs) == 1:
                    assert conv.failovers[0]["failed"] == [] and client.backed_off() == set()
            _, second, third = (named[c.conv_id] for c in convs)
            assert [c.failovers[0]["failed"] for c in convs] == [
                [], sorted([liar.peer_id, second]), [liar.peer_id]]
            assert all(len(c.failovers) == 1 for c in convs) and client.reports.count(liar.peer_id) == 3
            assert liar.peer_id in client.backed_off() and third not in client.backed_off()
            assert convs[2].route.hops[0].peer_id == spare.peer_id
    finally:
        for p in peers:
            await p.close()


async def test_a_hop_that_withholds_its_output_cannot_get_its_next_hops_backed_off_for_free(tiny):
    """A first hop that computes each decode step but never forwards it: every hop answers the
    probes, and the next hop, holding fewer positions, looked stuck and was backed off alone, so
    the liar, never blamed, got each honest peer of the next layers backed off in turn until no
    route was left (found by an attack run). Now from the second such loss after the same hop in
    one conversation, that hop is replaced with the one after it."""
    path, digest, tok, _, _ = tiny
    bundle = tok.to_bundle()
    liar = await start_peer(load_shard(path, LayerRange(0, 2)), weights_hash=digest, bundle=bundle)
    spare = await start_peer(load_shard(path, LayerRange(0, 2)), weights_hash=digest, bundle=bundle,
                             bootstrap=liar.addrs)
    tails = [await start_peer(load_shard(path, LayerRange(2, 4)), weights_hash=digest, bundle=bundle,
                              bootstrap=liar.addrs) for _ in range(3)]
    peers = [liar, spare] + tails
    ids = tok.encode_chat([{"role": "user", "content": "hello"}])
    honest_run, real_link_to, withheld = liar.steps.run, liar.conns.link_to, []

    class Sink:
        async def send(self, *args, **fields):
            return None

    async def sink(*args, **kwargs):
        return Sink()

    async def run(conv, step):
        if step.start == 0 or step.replay:
            return await honest_run(conv, step)
        withheld.append(conv.next_id)
        if len(withheld) == 2:
            client._failed.pop(spare.peer_id)  # the liar's replacement is there when it is needed
        old, liar.conns.link_to = conv.next_link, sink
        try:
            await honest_run(conv, step)  # the liar's cache grows; its next hop never hears of it
        finally:
            liar.conns.link_to, conv.next_link = real_link_to, old

    try:
        await wait_for_tables(peers)
        async with MeshClient(list(liar.addrs)) as client:
            client.mark_failed(spare.peer_id)  # so every route runs through the liar until it is blamed
            liar.steps.run = run
            route = await client.plan()
            conv = client.conversation(route, max_tokens_total=len(ids) + 8, speculate=False, deadline_floor_s=1.0)
            try:
                out = await conv.generate(ids, max_tokens=8, eos_ids=())
            finally:
                await conv.close()
            assert route.hops[0].peer_id == liar.peer_id
            assert out.token_ids == greedy_generate(load_shard(path), ids, max_tokens=8).token_ids
            assert len(withheld) == 2 and conv.unconfirmed_reports == {liar.peer_id: 2}
            assert len(conv.failovers) == 2 and conv.failovers[1]["failed"] == sorted([liar.peer_id, withheld[1]])
            assert liar.peer_id in client.backed_off() and set(withheld) <= client.backed_off()
            assert conv.route.hops[0].peer_id == spare.peer_id and not set(withheld) & set(conv.route.peer_ids)
    finally:
        for p in peers:
            await p.close()


async def test_frames_naming_an_idle_conversation_do_not_pile_up(tiny):
    """While a conversation waits between replies (a chat REPL waiting for its user), a peer off
    its route and a hop on it sent 1 MB frames naming it (found by an attack run): the client
    queued every one for the conversation's next step (frames of 64 MiB are allowed, so
    gigabytes in seconds). Frames from off the route are dropped on arrival now, and a
    conversation keeps at most ``INBOX_BYTES`` of its hops' unread frames (the oldest go first)."""
    from meshinfer.client import conversation as conversation_module

    path, _, tok, _, _ = tiny
    a, b, c = await two_hops_and_a_stranger(tiny)
    ids = tok.encode_chat([{"role": "user", "content": "hello"}])
    big, n = "x" * (1 << 20), 24
    try:
        async with MeshClient(list(a.addrs)) as client:
            route = await client.plan()
            await client.link(client.table[c.peer_id])
            conv = client.conversation(route, max_tokens_total=len(ids) + 8, speculate=False)
            arrived, count = asyncio.Event(), {"n": 0}

            def counted(handler):
                async def on_message(link, msg_type, f):
                    await handler(link, msg_type, f)
                    count["n"] += msg_type in ("token", "error") and len(f.get("message", str, "") or f.get("pad", str, "")) > 1000
                    if count["n"] == 2 * n:
                        arrived.set()
                return on_message

            try:
                out = await conv.generate(ids, max_tokens=4, eos_ids=())
                for lk in client._links.values():
                    lk.on_message = counted(lk.on_message)
                stranger = next(lk for lk in c._all_links if lk.role == "client")
                hop = b.convs[conv.conv_id].owner
                for _ in range(n):
                    await stranger.send("error", conv=conv.conv_id, code="peer_unavailable", message=big)
                    await hop.send("token", conv=conv.conv_id, seq=10 ** 9, token=1, pad=big)
                await asyncio.wait_for(arrived.wait(), 60)
                queued = list(conv.inbox._queue)
                assert sum(item[3] for item in queued) <= conversation_module.INBOX_BYTES + len(big) + 1024
                assert queued and all(item[0].remote_id == b.peer_id for item in queued)
                more = await conv.generate(ids + out.token_ids, max_tokens=2, eos_ids=())
            finally:
                await conv.close()
            whole = greedy_generate(load_shard(path), ids, max_tokens=6).token_ids
            assert out.token_ids + more.token_ids == whole and conv.failovers == []
    finally:
        for p in (a, b, c):
            await p.close()


def test_evidence_holds_only_when_the_accused_signed_values_that_fail_the_checks():
    """``hops.weigh_evidence``: the accusation stands only for hidden states the accused signed
    (for this conversation and step) that fail ``plausible.check_values``."""
    from types import SimpleNamespace

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from meshinfer.client.hops import weigh_evidence
    from meshinfer.wire import discovery

    key, other = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    accused = SimpleNamespace(peer_id="a" * 32, peer=SimpleNamespace(public_key=discovery.public_key_hex(key)))
    accusation = LyingPeer("previous hop sent blown-up states", suspect=accused.peer_id)

    def weigh(x, *, signer=key, seq=5, start=3, hidden=None, sign_seq=None):
        sig = discovery.sign_step(signer, "conv", seq if sign_seq is None else sign_seq, start, tensors.row_digests(x))
        ev = {"start": start, "sig": sig, "hidden": tensors.tensor_to_wire(x) if hidden is None else hidden}
        return weigh_evidence(accusation, "conv", seq, accused, "r" * 32, ev)

    blown, fine = torch.full((1, 2, 8), 1e7), torch.ones(1, 2, 8)
    assert weigh(blown) is accusation
    for got, reason in ((weigh(fine), "pass the checks"), (weigh(blown, signer=other), "did not sign"),
                        (weigh(blown, sign_seq=4), "did not sign"), (weigh(blown, hidden=[1, 2]), "does not read"),
                        (weigh(blown, seq=-1, sign_seq=0), "does not read")):
        assert got is not accusation and got.suspect == "r" * 32 and reason in str(got), (reason, got)


async def test_a_new_previous_hop_cannot_get_the_kept_hop_blamed_with_an_old_client_step(tiny):
    """Found by an attack run on conversation keys: after a failover, a kept hop N gets a new
    previous hop L, which sends N an old step the client signed (a verification step rolling
    back below N's length: valid ``csig``, hidden states L computed honestly and signed) before
    the client's replay. N used to take it (its seq count restarted with the new previous hop)
    and pass it on; the hop after N, whose count did not restart, refused it naming N, and the
    client banned the honest N. Now every open and reroute carries the lowest seq the client
    will send from then on (``min_seq``, signed), and N drops a step below it without blaming
    anyone (a kept previous hop may still be finishing steps queued before the failover)."""
    path, digest, tok, _, _ = tiny
    repeat = [{"role": "user", "content": "abc abc abc abc abc abc abc abc"}]
    ids, n_tokens = tok.encode_chat(repeat), 40
    expected = greedy_generate(load_shard(path), ids, max_tokens=n_tokens).token_ids
    liar = await start_peer(load_shard(path, LayerRange(0, 2)), weights_hash=digest, bundle=tok.to_bundle())
    x, n, z, spare = [await start_peer(load_shard(path, LayerRange(a, b)), weights_hash=digest, bootstrap=liar.addrs)
                      for a, b in ((1, 2), (2, 3), (3, 4), (0, 2))]
    spare.compute_ms_per_token = 500.0  # slow: the first hop stays the liar until it is caught
    peers = [liar, x, n, z, spare]
    seen, sent_old = {}, []  # the client's steps the liar took: seq -> (start, tokens, header, csig)
    real_enqueue, real_run = liar.steps.enqueue, liar.steps.run

    def enqueue(conv, step):
        if step.x is not None:
            seen[step.seq] = (step.start, step.x[0].tolist(), step.header, step.csig)
        return real_enqueue(conv, step)

    async def run(conv, step):  # after the failover, an old step of the client to N first
        if step.replay and conv.next_id == n.peer_id and not sent_old:
            held, history = step.start + step.x.shape[1], step.x[0].tolist()
            k = max(q for q, (start, _, h, _) in seen.items() if q < step.seq and h.rollback and start < held)
            start, toks, header, csig = seen[k]
            with torch.no_grad():
                out = liar.shard(torch.tensor([history[:start] + toks]), 0, None, run=LayerRange(0, 2))
            hidden = tensors.tensor_to_wire(out[:, start:].float().contiguous())
            link = await liar.conns.link_to(n.peer_id, conv.next_addrs, conv.next_relays)
            await link.send("step", conv=conv.conv_id, seq=k, start=start, want=header.want, replay=False, trace=[],
                            hidden=hidden, rollback=True, pd=header.payload, csig=csig,
                            sig=discovery.sign_step(liar.key, conv.conv_id, k, start, tensors.wire_row_digests(hidden)))
            sent_old.append(k)
        await real_run(conv, step)

    liar.steps.enqueue, liar.steps.run = enqueue, run
    try:
        await wait_for_tables(peers)
        async with MeshClient(list(liar.addrs)) as client:
            planned = await client.plan()
            ad = {p: client.table[p.peer_id] for p in peers}
            route = Route(hops=(Hop(ad[liar], LayerRange(0, 1)), Hop(ad[x], LayerRange(1, 2)),
                                Hop(ad[n], LayerRange(2, 3)), Hop(ad[z], LayerRange(3, 4))),
                          estimated_ms_per_token=planned.estimated_ms_per_token, compat_key=planned.compat_key)
            conv = client.conversation(route, max_tokens_total=len(ids) + n_tokens, deadline_floor_s=10.0,
                                       spot_check_rate=0.0)
            conv.policy = AlwaysDraft()

            def on_token(_):
                if len(conv.cached) - len(ids) >= 12 and not x._closing:
                    asyncio.ensure_future(crash(x))

            out = await conv.generate(ids, max_tokens=n_tokens, eos_ids=(), on_token=on_token)
            await conv.close()
            backed_off = client.backed_off()
        assert sent_old and out.token_ids == expected
        assert out.detections == []  # below the floor the old step is dropped: nobody is blamed for it
        assert n.peer_id not in backed_off and z.peer_id not in backed_off
    finally:
        for p in peers:
            if not p._closing:
                await p.close()


def accuse_every_step(liar) -> None:
    """Make ``liar`` refuse every step from its previous hop, accusing it (no evidence) of
    sending it without a valid signature."""
    real = liar.steps.accept_from_previous_hop

    def accuse(link, conv, f, seq, start, x, digests, header):
        if conv.prev_id is None:
            return real(link, conv, f, seq, start, x, digests, header)
        conv.owner.post("error", conv=conv.conv_id, seq=seq, code="lying_peer", suspect=conv.prev_id,
                        message=f"previous hop {conv.prev_id[:12]} sent step {seq} without a valid signature")
        return False

    liar.steps.accept_from_previous_hop = accuse


async def test_a_hop_accusing_without_evidence_gets_honest_peers_backed_off_never_banned(tiny):
    """A lying hop refuses every step from its previous hop, saying it came without a valid
    signature: an accusation nothing can check. The client used to ban the accused on that
    word, one honest peer per accusation. Now the first accusation backs the accused off, the
    liar's second (when the new route keeps it) backs off the accused and the liar, and nobody
    is banned on one hop's word; the reply equals plain greedy generation over the honest peers
    (the counting itself: ``tests/test_reports.py``)."""
    ids, expected = tiny[3], tiny[4]
    peers = await start_lying_mesh(tiny, [(0, 1), (1, 3), (1, 3), (1, 3), (3, 4), (3, 4)])
    first, p1, p2, p3, liar, twin = peers
    accuse_every_step(liar)
    try:
        async with MeshClient(list(first.addrs)) as client:
            route = await client.plan(exclude=frozenset({p2.peer_id, p3.peer_id, twin.peer_id}))
            assert route.peer_ids == (first.peer_id, p1.peer_id, liar.peer_id)
            conv = client.conversation(route, max_tokens_total=len(ids) + N_TOKENS)
            out = await conv.generate(ids, max_tokens=N_TOKENS, eos_ids=())
            await conv.close()
            failed = dict(client._failed)
    finally:
        for p in peers:
            await p.close()
    assert out.token_ids == expected
    assert [d["peer"] for d in out.detections][0] == p1.peer_id and not any(d["proven"] for d in out.detections)
    assert p1.peer_id in failed and (len(out.detections) == 1 or liar.peer_id in failed)  # the liar at its second
    assert all(until != math.inf for until, _ in failed.values())  # nobody banned on one hop's word


async def test_an_unproven_accusation_of_a_peer_with_no_twin_replaces_the_accuser(tiny):
    """Found by an attack run: the only peer of layers 0-1 was accused, with no evidence, by a
    lying next hop; replacing the accused left no route and the conversation failed on the
    liar's first word. When nobody else serves the accused's layers, the accuser is replaced
    instead, and the reply equals plain greedy generation."""
    ids, expected = tiny[3], tiny[4]
    peers = await start_lying_mesh(tiny, [(0, 2), (2, 4), (2, 4)])
    first, liar, twin = peers
    accuse_every_step(liar)
    try:
        async with MeshClient(list(first.addrs)) as client:
            route = await client.plan(exclude=frozenset({twin.peer_id}))
            assert route.peer_ids == (first.peer_id, liar.peer_id)
            conv = client.conversation(route, max_tokens_total=len(ids) + N_TOKENS)
            out = await conv.generate(ids, max_tokens=N_TOKENS, eos_ids=())
            await conv.close()
            backed_off = client.backed_off()
    finally:
        for p in peers:
            await p.close()
    assert out.token_ids == expected and conv.route.peer_ids == (first.peer_id, twin.peer_id)
    assert liar.peer_id in backed_off and first.peer_id not in backed_off
    assert out.detections[0]["replaced"] == [liar.peer_id]


async def test_two_identities_on_one_host_accusing_a_peer_cannot_get_it_banned(tiny):
    """Two lying identities on one host (keys are free) each accuse the same honest peer, with no
    evidence, of sending unsigned steps. Distinct accusers used to ban it, so two sybils routed
    after an honest peer got it banned. Accusers on one host are one witness now: the accused
    is never banned, and each reply equals plain greedy generation (the host count itself:
    ``tests/test_reports.py``)."""
    ids, expected = tiny[3], tiny[4]
    peers = await start_lying_mesh(tiny, [(0, 1), (1, 4), (1, 4), (1, 4)],
                                   hosts=["127.0.0.1", "127.0.0.2", "127.0.0.2", "127.0.0.3"])
    first, liar_a, liar_b, honest = peers
    for liar in (liar_a, liar_b):
        accuse_every_step(liar)
    liars = {liar_a.peer_id, liar_b.peer_id}
    try:
        async with MeshClient(list(first.addrs)) as client:
            assert {client.host(p.peer_id) for p in peers} <= {"127.0.0.1", "127.0.0.2", "127.0.0.3", reports.UNKNOWN_HOST}
            for _ in range(3):  # until both liars have accused the first peer
                accused = client.accusations.accusers(first.peer_id)
                if accused == liars:
                    break
                route = await client.plan(exclude=frozenset({honest.peer_id, *accused}))
                conv = client.conversation(route, max_tokens_total=len(ids) + N_TOKENS)
                out = await conv.generate(ids, max_tokens=N_TOKENS, eos_ids=())
                await conv.close()
                assert out.token_ids == expected and not any(d["proven"] for d in out.detections)
            assert client.accusations.accusers(first.peer_id) == liars
            assert set(client.accusations.accuser_hosts(first.peer_id).values()) == {"127.0.0.2"}
            until, _ = client._failed.get(first.peer_id, (0.0, 0))
    finally:
        for p in peers:
            await p.close()
    assert until != math.inf  # two identities on one host are one witness: no ban


def test_an_unverified_hop_says_why_in_the_words_a_user_can_act_on(monkeypatch):
    """The reasons name the precision a twin must serve, and a conversation longer than one
    step frame says it cannot be checked rather than 'not checked yet' (a new user's run)."""
    from types import SimpleNamespace

    from meshinfer.client import conversation, spotcheck

    hop = SimpleNamespace(peer_id="p" * 64, layers=LayerRange(0, 12))
    conv = SimpleNamespace(
        client=SimpleNamespace(allow_ids=None, backed_off=lambda: set()),
        route=SimpleNamespace(hops=(hop,), compat_key=("w" * 64, "gguf-a16", 1, 24, "cpu")),
        audit=SimpleNamespace(mark=lambda h: 0, disputed_by=lambda p, off: [], rate=0.1),
        sampling=None, cached=[1] * 600, max_step_tokens=512)
    monkeypatch.setattr(spotcheck, "alternates", lambda client, route, h: [])
    assert conversation.Conversation.unverified_hops(conv)[0]["reason"] == (
        "no other peer serves these layers at gguf-a16 with these weights, so nothing can check them")
    monkeypatch.setattr(spotcheck, "alternates", lambda client, route, h: ["twin"])
    assert "longer than one step frame (512 positions)" in conversation.Conversation.unverified_hops(conv)[0]["reason"]
    conv.cached = [1] * 100
    assert conversation.Conversation.unverified_hops(conv)[0]["reason"] == "not checked yet"
