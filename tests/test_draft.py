"""A draft model at the client: exact output, refused when it cannot work, failover, spot-checks,
and a per-conversation cache that is freed.

The tiny mesh drafts with the tiny model itself (drafts nearly always accepted) and with another
random tiny model of the same vocabulary (drafts mostly rejected); output must equal plain greedy
decoding either way.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from helpers.meshkit import AlwaysDraft, crash, mesh, split, start_peer, wait_for_tables
from meshinfer.core.config import LayerRange
from meshinfer.client.draft import DraftModel, ModelDrafter, load_draft_model
from meshinfer.core.errors import IncompatibleDraft, ModelNotFound, WeightsError
from meshinfer.engine.generate import greedy_generate, load_shard
from meshinfer.app.reply import plan_for
from meshinfer.client.mesh import MeshClient
from helpers.tiny import random_weights, tiny_config, write_gguf

STORY = [{"role": "user", "content": "tell me a long story about meshes and hops"}]
N_TOKENS = 40


@pytest.fixture(scope="module")
def drafts(tiny, tmp_path_factory):
    """{"same": the mesh's own model, "other": another random model, same vocabulary}."""
    other = tmp_path_factory.mktemp("other") / "other.gguf"
    cfg = tiny_config("qwen2", context=256)
    write_gguf(other, cfg, random_weights(cfg, seed=11))
    models = {"same": load_draft_model(tiny[0], dtype="f32"), "other": load_draft_model(other, dtype="f32")}
    yield models
    for m in models.values():
        m.close()


async def _generate(client, route, ids, *, max_tokens=N_TOKENS, **options):
    conv = client.conversation(route, max_tokens_total=len(ids) + max_tokens, **options)
    conv.policy = AlwaysDraft()
    try:
        return await conv.generate(ids, max_tokens=max_tokens, eos_ids=())
    finally:
        await conv.close()


async def test_draft_model_output_equals_plain_greedy_on_the_tiny_model(tiny, drafts):
    path, digest, tok, whole = tiny
    ids = tok.encode_chat(STORY)
    expected = greedy_generate(whole, ids, max_tokens=N_TOKENS).token_ids
    async with mesh(split(lambda r: load_shard(path, r), [0, 2, 4]), weights_hash=digest,
                    bundle=tok.to_bundle()) as peers:
        async with MeshClient(list(peers[0].addrs)) as client:
            route = await client.plan()
            plain = await _generate(client, route, ids, speculate=False)
            same = await _generate(client, route, ids, draft_model=drafts["same"])
            other = await _generate(client, route, ids, draft_model=drafts["other"])
    assert plain.token_ids == expected and same.token_ids == expected and other.token_ids == expected
    assert same.speculative["drafter"] == "model:tiny" and same.speculative["steps"] > 0
    assert same.speculative["acceptance"] > 0.9, same.speculative
    assert same.speculative["steps"] + same.speculative["plain_steps"] < N_TOKENS // 2
    assert other.speculative["proposed"] > other.speculative["accepted"], other.speculative


async def test_a_draft_model_with_another_vocabulary_is_refused_before_any_conversation(tiny, tmp_path):
    path, digest, tok, _ = tiny
    cfg = tiny_config("qwen2", context=256)
    wrong = load_draft_model(write_gguf(tmp_path / "wrong.gguf", cfg, random_weights(cfg), merged=("l", "o")),
                             dtype="f32")
    try:
        async with mesh(split(lambda r: load_shard(path, r), [0, 2, 4]), weights_hash=digest,
                        bundle=tok.to_bundle()) as peers:
            async with MeshClient(list(peers[0].addrs), draft_model=wrong) as client:
                with pytest.raises(IncompatibleDraft) as caught:
                    await plan_for(client)
                route = await client.plan()
                conv = client.conversation(route, max_tokens_total=64)
                with pytest.raises(IncompatibleDraft):  # a conversation checks before it opens
                    await conv.generate(tok.encode_chat(STORY), max_tokens=4)
            assert all(not p.convs for p in peers)  # no hop ever held the conversation
    finally:
        wrong.close()
    assert str(caught.value) == (
        "draft model wrong has a vocabulary of 260 tokens, the mesh model 260; they differ from id 256 on "
        "('lo' against 'he'): a draft model must use the mesh model's tokenizer (a smaller model of the "
        "same family)")


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_a_corrupt_draft_file_is_refused(tiny, tmp_path, damage):
    data = tiny[0].read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model at all" * 100 if damage == "garbage" else data[:len(data) * 2 // 3])
    with pytest.raises(WeightsError, match=f"^draft model {bad}: cannot load it: "):
        load_draft_model(bad, dtype="f32")


async def test_the_draft_model_keeps_its_own_weights_when_its_file_is_written_over(tmp_path):
    """The draft model computes from its own copy of the file's blocks (as a peer does), so a
    file written over or truncated after loading changes no draft (and cannot SIGBUS the client)."""
    import gguf

    path = tmp_path / "draft.gguf"
    cfg = tiny_config("qwen2", context=256)
    write_gguf(path, cfg, random_weights(cfg, seed=5),
               quantize=lambda name: gguf.GGMLQuantizationType.Q8_0 if name.endswith("proj.weight") else None)
    model = load_draft_model(path, dtype="gguf")
    history = [4, 8, 15, 16, 23, 42]

    async def drafts() -> list[int]:
        d = model.drafter()
        try:
            return await d.propose(history, 6)
        finally:
            await d.close()

    def zero_all_but_4k(f) -> None:
        f.seek(4096)
        f.write(bytes(path.stat().st_size - 4096))

    try:
        before = await drafts()
        for damage in (zero_all_but_4k, lambda f: f.truncate(4096)):  # in place: the same inode
            with open(path, "r+b") as f:
                damage(f)
            assert await drafts() == before
    finally:
        model.close()


def test_a_missing_draft_file_is_refused(tmp_path):
    with pytest.raises(ModelNotFound, match="^draft model: model .*nope.gguf' is not a known model name"):
        load_draft_model(tmp_path / "nope.gguf")


async def test_a_hop_killed_during_a_draft_verification_step_fails_over_with_identical_output(tiny, drafts):
    path, digest, tok, whole = tiny
    ids = tok.encode_chat(STORY)
    expected = greedy_generate(whole, ids, max_tokens=N_TOKENS).token_ids
    first = await start_peer(load_shard(path, LayerRange(0, 1)), weights_hash=digest, bundle=tok.to_bundle())
    rest = [await start_peer(load_shard(path, r), weights_hash=digest, bootstrap=first.addrs)
            for r in (LayerRange(1, 3), LayerRange(1, 3), LayerRange(3, 4))]
    killed_in: list[int] = []  # positions of the verification step the hop died in
    try:
        await wait_for_tables([first, *rest])
        async with MeshClient(list(first.addrs), draft_model=drafts["same"]) as client:
            route = await client.plan()
            mid = next(p for p in rest[:2] if p.peer_id == route.hops[1].peer_id)
            conv = client.conversation(route, max_tokens_total=len(ids) + N_TOKENS, deadline_floor_s=1.0)
            conv.policy = AlwaysDraft()
            send = conv._send

            async def send_then_crash(tokens, start, *, want, replay=False):
                seq = await send(tokens, start, want=want, replay=replay)
                if want == "tokens" and start >= len(ids) + 8 and not killed_in:
                    killed_in.append(len(tokens))
                    await crash(mid)  # the step is on its way through the hop that dies
                return seq

            conv._send = send_then_crash
            out = await conv.generate(ids, max_tokens=N_TOKENS, eos_ids=())
            await conv.close()
    finally:
        for p in (first, *rest):
            await p.close()
    assert killed_in and killed_in[0] > 1
    assert out.token_ids == expected
    assert [f["failed"] for f in out.failovers] == [[mid.peer_id]]
    assert out.speculative["accepted"] > 0


async def test_spot_checks_of_draft_verification_steps_catch_a_lying_hop(tiny, drafts):
    """Every step spot-checked; the liar adds noise from the 3rd generated position on, inside
    the verification steps the draft model makes."""
    from helpers.lying import LyingShard, noise

    path, digest, tok, whole = tiny
    ids = tok.encode_chat(STORY)
    expected = greedy_generate(whole, ids, max_tokens=N_TOKENS).token_ids
    first = await start_peer(load_shard(path, LayerRange(0, 1)), weights_hash=digest, bundle=tok.to_bundle())
    peers = [first] + [await start_peer(load_shard(path, LayerRange(a, b)), weights_hash=digest,
                                        bootstrap=first.addrs) for a, b in ((1, 3), (1, 3), (1, 3), (3, 4))]
    twins, liar = peers[1:3], peers[3]  # two honest twins: a dispute needs a third opinion
    liar.shard = LyingShard(liar.shard, noise(1.0, from_position=len(ids) + 3))
    try:
        await wait_for_tables(peers)
        async with MeshClient(list(first.addrs), draft_model=drafts["same"]) as client:
            route = await client.plan(exclude=frozenset(t.peer_id for t in twins))
            conv = client.conversation(route, max_tokens_total=len(ids) + N_TOKENS, spot_check_rate=1.0,
                                       spot_check_seed=3)
            conv.policy = AlwaysDraft()
            out = await conv.generate(ids, max_tokens=N_TOKENS, eos_ids=())
            await conv.close()
    finally:
        for p in peers:
            await p.close()
    assert out.token_ids == expected
    assert [d["peer"] for d in out.detections] == [liar.peer_id] and "spot-check" in out.detections[0]["reason"]
    assert out.speculative["steps"] > 0 and liar.peer_id not in conv.route.peer_ids


async def test_the_draft_cache_is_freed_when_each_conversation_ends(tiny, drafts):
    path, digest, tok, _ = tiny
    model: DraftModel = drafts["same"]
    ids = tok.encode_chat(STORY)
    seen: list[int] = []  # the draft cache's bytes while each conversation ran
    real = ModelDrafter._propose

    def watched(self, history, k, *args):
        out = real(self, history, k, *args)
        seen.append(model.cache_bytes)
        return out

    async with mesh(split(lambda r: load_shard(path, r), [0, 2, 4]), weights_hash=digest,
                    bundle=tok.to_bundle()) as peers:
        async with MeshClient(list(peers[0].addrs), draft_model=model) as client:
            route = await client.plan()
            assert model.cache_bytes == 0 and not model.live
            ModelDrafter._propose = watched
            try:
                for i in range(5):
                    out = await _generate(client, route, ids + [40 + i], max_tokens=12)
                    assert out.speculative["steps"] > 0
                    assert (model.cache_bytes, len(model.live)) == (0, 0), i
            finally:
                ModelDrafter._propose = real
    assert len(seen) >= 5 and min(seen) > 0


async def test_a_conversation_cancelled_while_drafting_frees_its_draft_cache(tiny, drafts):
    path, digest, tok, _ = tiny
    model = drafts["same"]
    ids = tok.encode_chat(STORY)
    async with mesh(split(lambda r: load_shard(path, r), [0, 2, 4]), weights_hash=digest,
                    bundle=tok.to_bundle()) as peers:
        async with MeshClient(list(peers[0].addrs), draft_model=model) as client:
            route = await client.plan()
            conv = client.conversation(route, max_tokens_total=len(ids) + 150)
            conv.policy = AlwaysDraft()
            task = asyncio.ensure_future(conv.generate(ids, max_tokens=150, eos_ids=()))
            async with asyncio.timeout(30):
                while not model.cache_bytes and not task.done():
                    await asyncio.sleep(0.01)
            assert not task.done(), task.result()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await conv.close()
            assert (model.cache_bytes, len(model.live)) == (0, 0)


async def test_conversations_on_a_route_share_the_draft_policy_of_their_drafter(tiny, drafts):
    """A new conversation starts from the step times, draft cost and acceptance earlier ones
    measured on the same route with the same kind of drafter; another drafter has its own."""
    path, digest, tok, whole = tiny
    ids = tok.encode_chat(STORY)
    async with mesh(split(lambda r: load_shard(path, r), [0, 2, 4]), weights_hash=digest,
                    bundle=tok.to_bundle()) as peers:
        async with MeshClient(list(peers[0].addrs), draft_model=drafts["same"]) as client:
            route = await client.plan()
            convs = [client.conversation(route, max_tokens_total=len(ids) + 8, **opts)
                     for opts in ({}, {}, {"draft_model": None}, {"draft_ahead": not client.draft_ahead})]
            steps = []  # decode steps of each conversation
            for conv in convs:
                out = await conv.generate(ids, max_tokens=8, eos_ids=())
                await conv.close()
                assert out.token_ids == greedy_generate(whole, ids, max_tokens=8).token_ids
                steps.append(out.speculative["steps"] + out.speculative["plain_steps"])
    assert convs[0].policy is convs[1].policy is client.draft_policy(route, ModelDrafter(drafts["same"]),
                                                                      ahead=client.draft_ahead)
    assert convs[3].policy is not convs[0].policy  # drafting ahead or not: other step times
    assert convs[2].policy is not convs[0].policy and convs[2].policy.prior_acceptance == 0.5
    assert convs[0].policy.steps_recorded == steps[0] + steps[1] and convs[2].policy.steps_recorded == steps[2]


async def test_decode_steps_do_not_wait_for_the_drafters_prefill(tiny):
    """Plain steps run while the drafter still reads the prompt; drafting starts once it has."""
    from meshinfer.client.draft import PromptLookup

    class SlowLookup(PromptLookup):
        def __init__(self) -> None:
            self.gate = asyncio.Event()

        async def prefill(self, history) -> None:
            await self.gate.wait()

    path, digest, tok, whole = tiny
    ids = tok.encode_chat([{"role": "user", "content": "abc abc abc abc abc abc abc abc"}])
    async with mesh(split(lambda r: load_shard(path, r), [0, 2, 4]), weights_hash=digest,
                    bundle=tok.to_bundle()) as peers:
        async with MeshClient(list(peers[0].addrs)) as client:
            conv = client.conversation(await client.plan(), max_tokens_total=len(ids) + N_TOKENS)
            conv.drafter, conv.policy = SlowLookup(), AlwaysDraft()
            seen: list[int] = []

            def on_token(token):
                seen.append(token)
                if len(seen) == 10:
                    conv.drafter.gate.set()

            async with asyncio.timeout(60):  # a decode that waited for the prefill would never end
                out = await conv.generate(ids, max_tokens=N_TOKENS, eos_ids=(), on_token=on_token)
            await conv.close()
    assert out.token_ids == greedy_generate(whole, ids, max_tokens=N_TOKENS).token_ids
    assert out.speculative["plain_steps"] >= 9 and out.speculative["steps"] > 0, out.speculative


async def test_drafts_on_the_remembered_line_cost_nothing_and_equal_fresh_ones(drafts):
    """Greedy drafting is deterministic: after drafting k tokens, a history that took j of them
    gets the other k - j without a pass; a history off the line is drafted afresh, as a new
    drafter would."""
    model = drafts["other"]
    history = [5, 9, 13, 2, 7, 11]
    d, fresh = model.drafter(), model.drafter()
    try:
        line = await d.propose(history, 6)
        assert len(line) == 6 and d.last_cost_ms > 0
        assert await d.propose(history + line[:2], 4) == line[2:6] and d.last_cost_ms == 0.0
        off = history + [(line[0] + 1) % 64]
        assert await d.propose(off, 3) == await fresh.propose(off, 3) and d.last_cost_ms > 0
        assert await d.propose(history, 2) == await fresh.propose(history, 2)  # back on an older line
    finally:
        await d.close()
        await fresh.close()
    assert (model.cache_bytes, len(model.live)) == (0, 0)


async def test_drafting_ahead_extends_the_line_in_the_background_and_stops_when_asked(drafts):
    model = drafts["other"]
    history = [3, 1, 4, 1, 5, 9, 2, 6]
    d, fresh = model.drafter(), model.drafter()
    try:
        first = await d.propose(history, 2)
        assert d.draft_ahead(history + first, 12) is not None
        assert d.draft_ahead(history + first, 12) is None  # one at a time
        await asyncio.wait_for(asyncio.shield(d._ahead), 30)
        await d.stop_ahead()
        expected = await fresh.propose(history, 14)
        assert await d.propose(history + first, 12) == expected[2:] and d.last_cost_ms == 0.0
        d.draft_ahead(history + expected, 31)
        await d.stop_ahead()  # halts after the pass it is in: the line is whatever it reached
        assert d._ahead is None and d.known(history + expected) == (await fresh.propose(
            history + expected, len(d.known(history + expected))) if d.known(history + expected) else [])
    finally:
        await d.close()
        await fresh.close()
    assert (model.cache_bytes, len(model.live)) == (0, 0)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["same", "other"])
async def test_drafting_ahead_during_steps_keeps_output_identical_and_uses_the_line(tiny, drafts, which):
    """With ``draft_ahead`` on, the drafter works while each step is in flight; with the mesh's
    own model as the draft, most steps then find their drafts already drafted."""
    path, digest, tok, whole = tiny
    ids = tok.encode_chat(STORY)
    expected = greedy_generate(whole, ids, max_tokens=N_TOKENS).token_ids
    known: list[int] = []  # per proposal: how many of its drafts the line already held
    real = ModelDrafter.propose

    async def watched(self, history, k):
        await self.stop_ahead()
        known.append(min(k, len(self.known(history))))
        return await real(self, history, k)

    async with mesh(split(lambda r: load_shard(path, r), [0, 2, 4]), weights_hash=digest,
                    bundle=tok.to_bundle()) as peers:
        peers[1].shard = SlowShard(peers[1].shard, 1.0)  # a step takes a (long) WAN round trip's time
        async with MeshClient(list(peers[0].addrs), draft_model=drafts[which], draft_ahead=True) as client:
            ModelDrafter.propose = watched
            try:
                out = await _generate(client, await client.plan(), ids)
            finally:
                ModelDrafter.propose = real
    assert out.token_ids == expected
    assert (drafts[which].cache_bytes, len(drafts[which].live)) == (0, 0)
    if which == "same":  # every draft accepted and the next token guessed: the line holds the next drafts
        assert len(known) >= 3 and sum(n > 0 for n in known[1:]) >= len(known) // 2, known


class NeverDraft(AlwaysDraft):
    """A draft policy that chooses plain steps only."""

    def choose(self, limit: int) -> int:
        return 0


@pytest.mark.parametrize("policy", [NeverDraft, AlwaysDraft])
async def test_no_drafting_ahead_during_plain_steps(tiny, drafts, policy):
    """Drafting ahead runs only after steps that carry drafts: while the policy decodes plainly,
    background drafting would be wasted and (on a machine shared with hops) slow the plain steps
    it is compared with; it measured 0.92x plain at 100 ms on the benchmark machine."""
    path, digest, tok, whole = tiny
    ids = tok.encode_chat(STORY)
    expected = greedy_generate(whole, ids, max_tokens=12).token_ids
    started = []
    real = ModelDrafter.draft_ahead

    def watched(self, history, k):
        started.append(len(history))
        return real(self, history, k)

    async with mesh(split(lambda r: load_shard(path, r), [0, 2, 4]), weights_hash=digest,
                    bundle=tok.to_bundle()) as peers:
        async with MeshClient(list(peers[0].addrs), draft_model=drafts["same"], draft_ahead=True) as client:
            conv = client.conversation(await client.plan(), max_tokens_total=len(ids) + 12)
            conv.policy = policy()
            ModelDrafter.draft_ahead = watched
            try:
                out = await conv.generate(ids, max_tokens=12, eos_ids=())
            finally:
                ModelDrafter.draft_ahead = real
                await conv.close()
    assert out.token_ids == expected
    assert (len(started) == 0) == (policy is NeverDraft), started


class SlowShard:
    """A shard whose every pass first sleeps ``delay_s`` on the peer's device thread."""

    def __init__(self, shard, delay_s: float) -> None:
        self._shard, self._delay_s = shard, delay_s

    def __getattr__(self, name):
        return getattr(self._shard, name)

    def __call__(self, *args, **kwargs):
        time.sleep(self._delay_s)
        return self._shard(*args, **kwargs)


async def test_auto_drafts_ahead_only_when_the_round_trip_holds_a_draft_pass(tiny, drafts):
    from dataclasses import replace

    path, digest, tok, _ = tiny
    model = drafts["same"]
    async with mesh(split(lambda r: load_shard(path, r), [0, 2, 4]), weights_hash=digest,
                    bundle=tok.to_bundle()) as peers:
        async with MeshClient(list(peers[0].addrs), draft_model=model, draft_ahead="auto") as client:
            route = await client.plan()
            compute = sum(h.peer.compute_ms_per_token * len(h.layers) / len(h.peer.layers) for h in route.hops)
            wan = replace(route, estimated_ms_per_token=compute + 150.0)  # a 100 ms RTT route
            assert client.conversation(wan, max_tokens_total=8)._ahead_pays()
            assert not client.conversation(replace(route, estimated_ms_per_token=compute + 2.0),
                                           max_tokens_total=8)._ahead_pays()
            assert not client.conversation(wan, max_tokens_total=8, draft_model=None)._ahead_pays()
            assert not client.conversation(wan, max_tokens_total=8, draft_ahead=False)._ahead_pays()
            with pytest.raises(Exception, match="draft_ahead"):
                client.conversation(wan, max_tokens_total=8, draft_ahead="sometimes")


# --------------------------------------------------------------------------- real models
@pytest.mark.realmodel
@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b-instruct-q4_k_m", "smollm2-135m-instruct-q4_1"])
async def test_draft_model_output_equals_plain_on_the_real_models_over_2_peers(name):
    """Each model drafts for itself at its default precision, ``auto`` = gguf-a16 here (no smaller
    same-vocabulary sibling is here), for an f32 mesh of 2 peers: a general chat and an
    arithmetic one. gguf-a16 computes the f32 model up to int16 rounding of activations, so
    nearly every draft is accepted."""
    from helpers.realmodels import model_path
    from helpers.meshkit import file_hash
    from meshinfer.app.bench import GENERAL_PROMPTS
    from meshinfer.text.tokenizer import Tokenizer
    from helpers.realmodels import full_tensors, shard_of

    path = model_path(name)
    tok = Tokenizer.from_gguf(path)
    n_layers = full_tensors(name)[0].num_hidden_layers
    shards = [shard_of(name, 0, n_layers // 2), shard_of(name, n_layers // 2, n_layers)]
    draft = load_draft_model(path)
    from meshinfer.engine.models.gguf_linear import GGUFLinear
    assert isinstance(draft.shard.layers["0"].mlp.up_proj, GGUFLinear)  # auto chose the gguf kernels
    try:
        async with mesh(shards, weights_hash=file_hash(path), bundle=tok.to_bundle()) as peers:
            async with MeshClient(list(peers[0].addrs), draft_model=draft) as client:
                route, _ = await plan_for(client)
                for messages in (GENERAL_PROMPTS[0], GENERAL_PROMPTS[1]):
                    ids = tok.encode_chat(messages)
                    plain = await _generate(client, route, ids, max_tokens=32, speculate=False)
                    drafted = await _generate(client, route, ids, max_tokens=32)
                    assert drafted.token_ids == plain.token_ids, (messages, tok.decode(plain.token_ids))
                    assert drafted.speculative["drafter"] == f"model:{name}"
                    assert drafted.speculative["acceptance"] > 0.9, drafted.speculative
                    assert drafted.speculative["steps"] < 20
    finally:
        draft.close()
