"""Exact speculative decoding: prompt-lookup drafting, verification in one step, implicit rollback.

Speculative output must equal plain greedy decoding token for token: on the tiny model and on
the real default model through 2-3 peer meshes, when drafts are mostly accepted (a code edit)
and mostly rejected, when EOS or max_tokens lands inside an accepted draft, and across a
failover.
"""

from __future__ import annotations


import pytest

from helpers.convauth import conv_id
from helpers.meshkit import AlwaysDraft, generate_through_a_middle_crash, mesh, split
from helpers.hostile import Raw, last_token, serving
from meshinfer.wire import protocol
from meshinfer.client import speculative
from meshinfer.app.bench import CODE_EDIT_MESSAGES
from meshinfer.core.config import LayerRange
from meshinfer.core.errors import InvalidInput, ProtocolError
from meshinfer.engine.generate import greedy_generate, load_shard
from meshinfer.client.mesh import MeshClient
from meshinfer.client.speculative import DraftPolicy, accept, expected_tokens, propose

REPEAT = [{"role": "user", "content": "abc abc abc abc abc abc abc abc"}]
PLAIN = [{"role": "user", "content": "hello there, tiny model"}]


# --------------------------------------------------------------------------- pure
def test_propose_prefers_the_longest_ngram_and_its_most_recent_occurrence():
    #          0  1  2  3  4  5  6  7  8  9
    history = [1, 2, 3, 4, 9, 2, 3, 5, 6, 2, 3]
    assert propose(history, 3) == [5, 6, 2]  # 2-gram (2, 3): most recent earlier occurrence at 5
    assert propose([7, 1, 2, 3, 8, 9, 0, 2, 3, 1, 2, 3], 2) == [8, 9]  # 3-gram (1, 2, 3) wins over (2, 3)
    assert propose([5, 6, 7, 5], 4) == [6, 7, 5]  # 1-gram; drafts stop at the end of history


def test_propose_gives_nothing_without_a_recurring_ngram_or_room():
    assert propose([1, 2, 3, 4], 5) == []
    assert propose([1, 2, 1, 2], 0) == []
    assert propose([], 4) == [] and propose([3], 4) == []
    assert propose([1, 2, 1, 2], 8, max_ngram=2, min_ngram=2) == [1, 2]


def test_accept_keeps_the_matching_prefix_and_one_greedy_token():
    assert accept([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted + bonus
    assert accept([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # the first mismatch is corrected, the rest dropped
    assert accept([5, 6, 7], [4, 6, 7, 8]) == [4]  # nothing accepted: plain decoding's token
    assert accept([], [3]) == [3]
    with pytest.raises(ValueError, match="a step with 2 drafts needs 3 argmaxes, got 2"):
        accept([1, 2], [1, 2])


def test_expected_tokens_follows_the_geometric_formula():
    assert expected_tokens(0.0, 5) == 1.0 and expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)  # 1 + 0.5 + 0.25
    assert expected_tokens(0.9, 0) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="got acceptance 1.5, k 2"):
        expected_tokens(1.5, 2)


def _policy(step_ms: dict, *, accepted: int, proposed: int, steps: int = 6, draft_ms: float = 0.0) -> DraftPolicy:
    """A policy that measured ``steps`` rounds of each step length in ``step_ms`` and
    ``accepted`` of ``proposed`` drafts in runs of 4."""
    p = DraftPolicy(prior_base_ms=100.0, prior_slope_ms=10.0, prior_draft_ms=draft_ms)
    for _ in range(steps):
        for t, ms in step_ms.items():
            p.record_step(t, ms)
    for i in range(0, proposed, 4):
        p.record_drafts(min(4, proposed - i), min(4, max(0, accepted - i)))
    p.record_draft_cost(4, 4 * draft_ms)
    return p


def test_policy_drafts_long_when_drafts_are_accepted_and_the_round_trip_is_long():
    # a WAN step: 400 ms whatever its length (+2 ms per position); nearly every draft accepted
    p = _policy({1: 400.0, 5: 408.0}, accepted=39, proposed=40)
    assert p.step_line() == pytest.approx((400.0, 2.0))
    assert p.acceptance > 0.9 and p.choose(8) == 8
    assert p.choose(3) == 3  # never past the limit


def test_policy_chooses_plain_steps_when_nothing_pays():
    # loopback: each extra position costs half a step, drafts mostly rejected
    p = _policy({1: 100.0, 3: 200.0}, accepted=1, proposed=20)
    assert p.choose(8) == 0
    # drafting that costs more than the step it saves
    p = _policy({1: 100.0, 5: 104.0}, accepted=40, proposed=40, draft_ms=150.0)
    assert p.choose(8) == 0


def test_policy_weighs_draft_cost_against_the_round_trip():
    cheap = _policy({1: 300.0, 5: 320.0}, accepted=36, proposed=40, draft_ms=5.0)
    dear = _policy({1: 300.0, 5: 320.0}, accepted=36, proposed=40, draft_ms=60.0)
    assert cheap.choose(16) > dear.choose(16) > 0


def test_policy_forgets_old_acceptance_so_it_tries_drafting_again():
    p = _policy({1: 100.0, 3: 150.0}, accepted=0, proposed=12)
    assert p.choose(8) == 0
    for _ in range(60):  # plain steps only: the estimate drifts back to the prior
        p.record_step(1, 100.0)
    assert p.acceptance > 0.45 and p.choose(8) > 0
    # the 3-position steps are forgotten too: the prior slope is back, and so is the probe limit
    assert p.step_line() == pytest.approx((100.0, 10.0)) and p.choose(8) == speculative.FIRST_PROBE_DRAFTS


def test_policy_stops_drafting_when_drafted_steps_realize_less_than_plain_ones_and_retries_later():
    # the model says drafting pays (cheap extra positions, good acceptance) ...
    p = _policy({1: 100.0, 5: 110.0}, accepted=30, proposed=40)
    assert p.choose(8) > 0 and p.realized_rates() == (None, None)
    # ... but drafted steps took 400 ms for 3 tokens (the draft slowed the hops), plain 100 ms for 1
    for _ in range(3):
        p.record_yield(True, 3, 400.0)
        p.record_yield(False, 1, 100.0)
    drafted, plain = p.realized_rates()
    assert drafted == pytest.approx(3 / 400) and plain == pytest.approx(1 / 100)
    assert p.choose(8) == 0
    steps = 0
    while p.choose(8) == 0 and steps < 100:  # plain steps only: the drafted measurements fade, then a probe
        p.record_step(1, 100.0)
        p.record_yield(False, 1, 100.0)
        steps += 1
    assert 3 <= steps <= 20, steps
    # drafted steps that do yield more keep drafting on
    good = _policy({1: 100.0, 5: 110.0}, accepted=30, proposed=40)
    for _ in range(3):
        good.record_yield(True, 3, 130.0)
        good.record_yield(False, 1, 100.0)
    assert good.choose(8) > 0


def test_policy_waits_longer_and_longer_after_drafts_that_are_never_accepted():
    """Found by a new-user run: a draft model whose drafts are never accepted was tried every 4-5
    steps (the acceptance estimate and the realized-rate check fade within a few plain steps),
    and decoding ran up to 25% slower than plain. Each drafted step that yields no accepted
    draft while drafted steps realize less than plain ones now doubles the plain steps the
    policy waits before drafting again; an accepted draft ends the wait."""
    def run(policy, steps: int, accepted) -> list[int]:
        ks = []
        for _ in range(steps):
            k = policy.choose(8)
            ks.append(k)
            policy.record_draft_cost(k, 40.0 * k)
            policy.record_step(k + 1, 255.0 + 20.0 * k)
            m = accepted(k)
            if k:
                policy.record_drafts(k, m)
            policy.record_yield(bool(k), m + 1, 255.0 + 60.0 * k)
        return ks

    p = DraftPolicy(prior_base_ms=255.0, prior_slope_ms=20.0, prior_acceptance=0.8, prior_draft_ms=40.0)
    ks = run(p, 400, lambda k: 0)
    drafted = [i for i, k in enumerate(ks) if k]
    assert len(drafted) <= 20, drafted  # 95 of 400 before
    gaps = [b - a for a, b in zip(drafted, drafted[1:])]
    assert gaps[-1] >= speculative.MAX_PROBE_GAP and gaps[-1] >= max(gaps[:-1])  # waits grow, to the cap
    # drafts that start being accepted end the wait at the next probe
    ks = run(p, 2 * speculative.MAX_PROBE_GAP, lambda k: k)
    assert sum(1 for k in ks[-20:] if k) >= 15
    # and a new generation (another prompt) carries no wait over from the last one's drafts
    run(p, 60, lambda k: 0)
    assert p._waited < p._gap  # waiting after fruitless drafts
    p.new_text()
    assert p._gap == p._waited == 0


def test_policy_starts_from_the_priors():
    p = DraftPolicy(prior_base_ms=300.0, prior_slope_ms=0.0, prior_acceptance=0.5)
    assert p.step_line() == (300.0, 0.0) and p.acceptance == 0.5
    assert p.choose(8) == speculative.FIRST_PROBE_DRAFTS == 2  # until a longer step is timed
    p.record_step(3, 300.0)
    assert p.choose(8) == 8  # a free extra position: any acceptance pays
    with pytest.raises(ValueError, match="accepted 5 of 4 drafts"):
        p.record_drafts(4, 5)


def test_draft_limit_fits_the_verification_limit_of_a_step():
    assert speculative.MAX_DRAFT_TOKENS + 1 == protocol.MAX_VERIFY_TOKENS
    assert 1 <= speculative.DEFAULT_DRAFT_TOKENS <= speculative.MAX_DRAFT_TOKENS


# --------------------------------------------------------------------------- tiny mesh
def _watch_steps(conv) -> list[list[int]]:
    """Record the ids every decode step of ``conv`` returns."""
    steps: list[list[int]] = []
    real = conv._decode_step

    async def watched(*args):
        ids, trace = await real(*args)
        steps.append(list(ids))
        return ids, trace

    conv._decode_step = watched
    return steps


async def _generate(client, route, ids, *, max_tokens, eos_ids=(), **options):
    conv = client.conversation(route, max_tokens_total=len(ids) + max_tokens, **options)
    conv.policy = AlwaysDraft()  # these tests check exact verification, not when drafting pays
    steps = _watch_steps(conv)
    try:
        return await conv.generate(ids, max_tokens=max_tokens, eos_ids=eos_ids), steps
    finally:
        await conv.close()


@pytest.mark.parametrize("bounds", [[0, 2, 4], [0, 1, 3, 4]], ids=["2-peers", "3-peers"])
async def test_speculative_equals_plain_greedy_on_the_tiny_model(tiny, bounds):
    path, digest, tok, whole = tiny
    async with mesh(split(lambda r: load_shard(path, r), bounds), weights_hash=digest,
                    bundle=tok.to_bundle()) as peers:
        async with MeshClient(list(peers[0].addrs)) as client:
            route = await client.plan()
            for messages in (REPEAT, PLAIN):
                ids = tok.encode_chat(messages)
                expected = greedy_generate(whole, ids, max_tokens=60).token_ids
                plain, _ = await _generate(client, route, ids, max_tokens=60, speculate=False)
                spec, steps = await _generate(client, route, ids, max_tokens=60, draft_tokens=6)
                assert plain.token_ids == expected and spec.token_ids == expected, messages
                assert plain.speculative == {} and spec.speculative["steps"] > 0
                assert spec.speculative["accepted"] <= spec.speculative["proposed"]
                assert len(steps) < 59 and max(map(len, steps)) > 1  # fewer steps than tokens
                assert spec.decode_tokens_per_s > 0


async def test_spot_checks_of_verification_steps_find_no_liar(tiny):
    """Every decode step spot-checked (rate 1) on a peer that also holds every layer: accepted
    positions are checked, rejected ones are not, and honest hops are never blamed."""
    path, digest, tok, whole = tiny
    shards = [load_shard(path, LayerRange(0, 2)), load_shard(path, LayerRange(2, 4)), load_shard(path)]
    async with mesh(shards, weights_hash=digest, bundle=tok.to_bundle()) as peers:
        async with MeshClient(list(peers[0].addrs)) as client:
            route = await client.plan(exclude=frozenset({peers[2].peer_id}))
            ids = tok.encode_chat(REPEAT)
            conv = client.conversation(route, max_tokens_total=len(ids) + 50, spot_check_rate=1.0, spot_check_seed=3)
            conv.policy = AlwaysDraft()
            out = await conv.generate(ids, max_tokens=50)
            await conv.close()
    assert out.token_ids == greedy_generate(whole, ids, max_tokens=50).token_ids
    assert out.detections == [] and conv.audit.checks > 5 and out.speculative["accepted"] > 0


async def test_sampled_generation_does_not_speculate_and_is_reproducible(tiny):
    """Drafts are verified against argmax, so a sampled conversation decodes one token per step."""
    from meshinfer.core.sampling_params import SamplingParams

    path, digest, tok, _ = tiny
    async with mesh(split(lambda r: load_shard(path, r), [0, 2, 4]), weights_hash=digest,
                    bundle=tok.to_bundle()) as peers:
        async with MeshClient(list(peers[0].addrs)) as client:
            route = await client.plan()
            ids = tok.encode_chat(REPEAT)
            runs = []
            for speculate in (True, False):
                conv = client.conversation(route, max_tokens_total=len(ids) + 30, speculate=speculate)
                steps = _watch_steps(conv)
                out = await conv.generate(ids, max_tokens=30, sampling=SamplingParams(temperature=0.8, seed=5))
                await conv.close()
                runs.append(out.token_ids)
                assert out.speculative == {} and all(len(s) == 1 for s in steps)
    assert runs[0] == runs[1] and len(runs[0]) == 30


async def test_eos_and_max_tokens_inside_an_accepted_draft_end_as_plain_decoding_does(tiny):
    """A prompt ending inside the tiny model's own output loop, so drafts are accepted from the
    first decode step on; every stop position near the start must end as plain decoding does."""
    path, digest, tok, whole = tiny
    chat = tok.encode_chat(REPEAT)
    ids = chat + greedy_generate(whole, chat, max_tokens=45).token_ids  # ends in a loop
    free = greedy_generate(whole, ids, max_tokens=12).token_ids
    inside = {"eos": 0, "length": 0}
    async with mesh(split(lambda r: load_shard(path, r), [0, 2, 4]), weights_hash=digest,
                    bundle=tok.to_bundle()) as peers:
        async with MeshClient(list(peers[0].addrs)) as client:
            route = await client.plan()
            for j in range(1, 9):
                first = free.index(free[j])  # plain decoding stops at the first occurrence
                for kind, opts in (("eos", dict(max_tokens=12, eos_ids=(free[j],))), ("length", dict(max_tokens=j))):
                    want = greedy_generate(whole, ids, **opts)
                    got, steps = await _generate(client, route, ids, **opts)
                    assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason), (kind, j)
                    assert len(got.token_ids) == (first if kind == "eos" else j)
                    returned = 1 + sum(map(len, steps))  # ids the hops chose, past the stop too
                    if kind == "eos":  # EOS was an accepted draft and later ids were dropped
                        inside[kind] += returned - 1 > first and bool(steps) and len(steps[-1]) > 1
                    else:  # drafts were clipped to the budget: the last step filled it exactly
                        assert returned == j
                        inside[kind] += bool(steps) and len(steps[-1]) > 1
    assert inside["eos"] > 0 and inside["length"] > 0, inside


async def test_a_hop_that_predates_speculation_makes_the_client_decode_plainly(tiny):
    path, digest, tok, whole = tiny
    async with mesh(split(lambda r: load_shard(path, r), [0, 2, 4]), weights_hash=digest,
                    bundle=tok.to_bundle()) as peers:
        old, refused = peers[1]._on_step, []

        async def old_on_step(link, f):  # a hop that does not verify drafts (protocol 1 before speculation)
            if f.d.get("want") == "tokens":
                refused.append(f.d["seq"])
                raise ProtocolError(f"step {f.d['seq']}: want 'tokens' is not token or none")
            await old(link, f)

        peers[1]._on_step = old_on_step
        async with MeshClient(list(peers[0].addrs)) as client:
            ids = tok.encode_chat(REPEAT)
            out, steps = await _generate(client, await client.plan(), ids, max_tokens=40)
    assert out.token_ids == greedy_generate(whole, ids, max_tokens=40).token_ids
    assert len(refused) == 1 and all(len(s) == 1 for s in steps)


async def test_verification_returns_every_position_and_rollback_drops_rejected_positions(tiny):
    async with serving(tiny) as peers:
        peer = peers[0]
        raw = await Raw.connect(peer)
        try:
            await raw.request("open", conv="c", layers=[0, 4], max_tokens=64)
            await raw.send("step", conv="c", seq=1, start=0, tokens=[1, 2, 3, 4], want="tokens")
            reply = await raw.recv()
            want = [last_token(tiny, [1, 2, 3, 4][:i + 1]) for i in range(4)]
            assert (reply["t"], reply["seq"], reply["tokens"], reply["token"]) == ("token", 1, want, want[-1])
            assert await raw.error("step", conv="c", seq=2, start=2, tokens=[7, 8], want="tokens") == (
                "bad_positions", f"step 2 starts at position 2; conversation {conv_id('c')} expects position 4")
            await raw.send("step", conv="c", seq=3, start=2, tokens=[7, 8], want="tokens", rollback=True)
            reply = await raw.recv()
            assert reply["tokens"] == [last_token(tiny, [1, 2, 7]), last_token(tiny, [1, 2, 7, 8])]
            assert peer.convs[conv_id("c")].cache.length == 4
            assert await raw.error("step", conv="c", seq=4, start=4, tokens=[5] * 33, want="tokens") == (
                "invalid_input", "step 4: want=tokens allows at most 32 tokens per step, got 33")
            await raw.send("step", conv="c", seq=5, start=4, tokens=[9], want="token")
            reply = await raw.recv()
            assert (reply["token"], "tokens" in reply) == (last_token(tiny, [1, 2, 7, 8, 9]), False)
        finally:
            await raw.close()


def test_draft_tokens_out_of_range_is_refused_with_the_limit():
    client = MeshClient(["ws://127.0.0.1:1"])
    with pytest.raises(InvalidInput, match="draft_tokens must be 1-31, got 32"):
        client.conversation(None, max_tokens_total=8, draft_tokens=32)


async def test_failover_with_speculation_replays_and_matches_plain_greedy(tiny):
    path, digest, tok, whole = tiny
    ids = tok.encode_chat(REPEAT)
    out, mid = await generate_through_a_middle_crash(path, digest, tok.to_bundle(), ids, 50, policy=AlwaysDraft())
    assert out.token_ids == greedy_generate(whole, ids, max_tokens=50).token_ids
    assert [f["failed"] for f in out.failovers] == [[mid.peer_id]]
    assert out.speculative["accepted"] > 0


async def test_a_stuck_hop_still_holding_rejected_drafts_is_found():
    """A hop that never got a step may hold more positions than the step leaves (rejected drafts
    of the step before): failover must still name it."""
    from types import SimpleNamespace

    from meshinfer.client.conversation import Conversation

    hops = [SimpleNamespace(peer_id=p) for p in ("a", "b", "c")]
    conv = Conversation(MeshClient(["ws://127.0.0.1:1"]), SimpleNamespace(hops=hops), max_tokens_total=64)
    lengths = {"a": 10, "b": 14, "c": 14}

    async def probe(hop):
        return lengths[hop.peer_id]

    conv._probe = probe
    assert await conv._find_failed(in_flight=10) == {"b"}
    lengths["b"] = 10
    assert await conv._find_failed(in_flight=10) == {"c"}


async def test_reports_of_a_circuit_cut_blame_the_relay_before_the_hops():
    """Every hop answers its probe; hop "b" reports that its circuit to "c" through relay "r"
    closed. The first report names the relay only; while "r" is backed off, reports naming it
    count against "b", and the second of those replaces "b" and "c" (a relay that cut the circuit
    twice used to get both hops backed off)."""
    from types import SimpleNamespace

    from meshinfer.client.conversation import Conversation
    from meshinfer.core.errors import PeerUnavailable

    hops = [SimpleNamespace(peer_id=p) for p in ("a", "b", "c")]
    client = MeshClient(["ws://127.0.0.1:1"])
    conv = Conversation(client, SimpleNamespace(hops=hops, peer_ids=("a", "b", "c")), max_tokens_total=64)

    async def probe(hop):
        return 10

    conv._probe = probe

    def report():
        exc = PeerUnavailable("circuit closed", peer="c", relay="r")
        exc.reporter = "b"
        return exc

    assert await conv._find_failed(10, report()) == {"r"}
    client.mark_failed("r")  # what the failover does with it
    assert await conv._find_failed(10, report()) == {"r"} and conv.unconfirmed_reports == {"b": 1}
    assert await conv._find_failed(10, report()) == {"b", "c", "r"}


async def test_a_report_without_a_peer_counts_once_against_its_reporter():
    """Hop "a" reports ``peer_unavailable`` naming no peer; every hop answers, "a" finished the
    step and "b" never got it. The report and the lost step are one event: "a" is counted once
    (the stuck "b" is replaced), and only its second such report replaces "a" too."""
    from types import SimpleNamespace

    from meshinfer.client.conversation import Conversation
    from meshinfer.core.errors import PeerUnavailable

    hops = [SimpleNamespace(peer_id=p) for p in ("a", "b", "c")]
    conv = Conversation(MeshClient(["ws://127.0.0.1:1"]), SimpleNamespace(hops=hops, peer_ids=("a", "b", "c")),
                        max_tokens_total=64)
    lengths = {"a": 10, "b": 8, "c": 8}

    async def probe(hop):
        return lengths[hop.peer_id]

    conv._probe = probe

    def report():
        exc = PeerUnavailable("cannot reach my next hop")
        exc.reporter = "a"
        return exc

    assert await conv._find_failed(10, report()) == {"b"} and conv.unconfirmed_reports == {"a": 1}
    assert await conv._find_failed(10, report()) == {"a", "b"}


# --------------------------------------------------------------------------- real model
@pytest.mark.realmodel
async def test_speculative_equals_plain_greedy_on_the_default_model():
    """Code edit (drafts mostly accepted; max_tokens and EOS inside a draft) on 2 peers, and a
    reference case (drafts mostly rejected) on 3 peers."""
    from helpers.realmodels import model_path
    from helpers.meshkit import file_hash
    from meshinfer.text.tokenizer import Tokenizer
    from helpers.realmodels import DEFAULT, first_near_tie, load_cases, shard_of

    path = model_path(DEFAULT)
    tok = Tokenizer.from_gguf(path)
    ids = tok.encode_chat(CODE_EDIT_MESSAGES)
    shards = [shard_of(DEFAULT, 0, 12), shard_of(DEFAULT, 12, 24)]
    async with mesh(shards, weights_hash=file_hash(path), bundle=tok.to_bundle()) as peers:
        async with MeshClient(list(peers[0].addrs)) as client:
            route = await client.plan()
            plain, _ = await _generate(client, route, ids, max_tokens=40, speculate=False)
            spec, steps = await _generate(client, route, ids, max_tokens=40)
            assert spec.token_ids == plain.token_ids and len(plain.token_ids) == 40
            assert spec.speculative["accepted"] >= 0.7 * spec.speculative["proposed"] > 0, spec.speculative
            assert len(steps) < 20
            cut, _ = await _generate(client, route, ids, max_tokens=21)
            assert cut.token_ids == plain.token_ids[:21] and cut.finish_reason == "length"
            stop = plain.token_ids[30]
            ended, _ = await _generate(client, route, ids, max_tokens=40, eos_ids=(stop,))
            assert ended.token_ids == plain.token_ids[:plain.token_ids.index(stop)]
            assert ended.finish_reason == "stop"
    case = load_cases(DEFAULT)["prime"]
    shards = [shard_of(DEFAULT, 0, 8), shard_of(DEFAULT, 8, 16), shard_of(DEFAULT, 16, 24)]
    async with mesh(shards, weights_hash=file_hash(path), bundle=tok.to_bundle()) as peers:
        async with MeshClient(list(peers[0].addrs)) as client:
            n = first_near_tie(case)
            spec, _ = await _generate(client, await client.plan(), case["prompt_ids"], max_tokens=n)
            assert spec.token_ids == case["greedy_ids"][:n]
            assert spec.speculative["steps"] > 0
