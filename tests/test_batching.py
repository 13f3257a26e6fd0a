"""Batched decode across conversations: the same tokens as each conversation alone (f32).

Three levels: ``Shard.forward_batch`` against one ``forward`` per sequence (tiny and the real
default model); concurrent conversations through a real 2-peer mesh against the same
conversations run one at a time; a bad step inside a batch failing only its conversation.
"""

from __future__ import annotations

import asyncio
import copy
import random
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from helpers.convauth import conv_id, name_of
from helpers.meshkit import file_hash, mesh, split
from meshinfer.core.config import LayerRange
from meshinfer.engine.generate import load_shard
from meshinfer.engine.kernels.step_ops import ATTENTION_MAX_QUERIES
from meshinfer.peer.scheduler import BATCH_STEP_TOKENS, StepScheduler
from meshinfer.text.tokenizer import Tokenizer
from helpers.realmodels import DEFAULT, first_near_tie, load_cases, shard_of
from helpers.batching import (PROMPTS, REL_TOL, UNLIMITED, alone_then_together, compare_batched_with_single,
                              new_cache, rel_err)
from helpers.hostile import Raw, f32, hidden_after, last_token, rogue_advert


# --------------------------------------------------------------------------- model level
@pytest.mark.parametrize("bounds", [[0, 4], [0, 2, 4], [0, 1, 3, 4]], ids=["whole", "2-shards", "3-shards"])
def test_forward_batch_equals_single_forwards_tiny(tiny, bounds):
    path = tiny[0]
    shards = split(lambda r: load_shard(path, r), bounds)
    rng = random.Random(1)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (1, 3, 17, 40, 9, 64, 2, 30)]
    assert compare_batched_with_single(shards, prompts, steps=6) == 6 * len(prompts)


def test_forward_batch_with_ragged_step_lengths_tiny(tiny):
    """Steps of 1..BATCH_STEP_TOKENS tokens (speculative verification) in one pass."""
    shards = split(lambda r: load_shard(tiny[0], r), [0, 2, 4])
    prompts = [[7] * n for n in (5, 11, 2, 33)]
    widths = lambda i, step: 1 + (i * 3 + step) % BATCH_STEP_TOKENS  # noqa: E731
    assert compare_batched_with_single(shards, prompts, steps=4, step_tokens=widths) == 16


def test_forward_batch_gives_each_sequence_the_logits_it_asks_for_tiny(tiny):
    """A speculative verification step (all positions) and plain decode steps (last) in one pass."""
    shard = tiny[3]
    prompts = [[5, 6, 7], [9] * 12, [1, 2], [40, 41, 42, 43, 44]]
    steps = [[3, 4, 5, 6], [8], [11, 12], [2]]
    modes = ["all", "last", "all", "last"]
    single = [new_cache(shard, shard.range) for _ in prompts]
    for p, c in zip(prompts, single):
        shard(torch.tensor([p]), 0, c)
    batch = copy.deepcopy(single)
    want = [shard(torch.tensor([x]), c.length, c, logits=m) for x, c, m in zip(steps, single, modes)]
    got = shard.forward_batch([torch.tensor([x]) for x in steps], [c.length for c in batch], batch, logits=modes)
    assert [tuple(g.shape) for g in got] == [(1, 4, 260), (1, 1, 260), (1, 2, 260), (1, 1, 260)]
    for g, w in zip(got, want):
        assert rel_err(g, w) <= REL_TOL
    with pytest.raises(ValueError, match="as many inputs, starts, caches and logits modes"):
        shard.forward_batch([torch.tensor([[1]])] * 2, [c.length for c in batch[:2]], batch[:2], logits=["all"])
    with pytest.raises(ValueError, match=r"logits must be 'last' or 'all', got \['first'\]"):
        shard.forward_batch([torch.tensor([[1]])], [batch[0].length], batch[:1], logits=["first"])


def test_forward_batch_checks_every_input_before_touching_a_cache(tiny):
    shard = tiny[3]
    caches = [new_cache(shard, shard.range) for _ in range(3)]
    shard(torch.tensor([[1, 2, 3]]), 0, caches[1])
    with pytest.raises(Exception, match="step starts at position 0 but the cache holds 3 tokens"):
        shard.forward_batch([torch.tensor([[5]])] * 3, [0, 0, 0], caches)
    assert [c.length for c in caches] == [0, 3, 0]
    with pytest.raises(Exception, match=r"token id 999 is outside the vocabulary \[0, 260\)"):
        shard.forward_batch([torch.tensor([[5]]), torch.tensor([[999]])], [0, 3], caches[:2])
    with pytest.raises(ValueError, match="each sequence needs its own cache"):
        shard.forward_batch([torch.tensor([[5]])] * 2, [0, 0], [caches[0], caches[0]])
    assert [c.length for c in caches] == [0, 3, 0]


async def test_a_pass_of_a_conversation_that_ends_stops_at_the_next_layer(tiny):
    """A client that leaves during a long prefill chunk: the peer drops the conversation and its
    pass stops before the next layer instead of running every layer of the chunk (about 25 s at
    20k tokens of context on the benchmark CPU) for nobody."""
    from meshinfer.client.mesh import MeshClient

    path, digest, tok, _ = tiny
    async with mesh([load_shard(path)], weights_hash=digest, bundle=tok.to_bundle()) as peers:
        peer, ran = peers[0], []
        for name, block in peer.shard.layers.items():
            def slow(*args, _real=block.forward, _name=name, **kwargs):
                ran.append(_name)
                time.sleep(0.5)
                return _real(*args, **kwargs)
            block.forward = slow
        prompt = tok.encode("a long prompt " * 16)
        assert len(prompt) > ATTENTION_MAX_QUERIES  # longer than one call of all layers takes: layer by layer
        async with MeshClient(list(peer.addrs)) as client:
            conv = client.conversation(await client.plan(), max_tokens_total=len(prompt) + 8)
            task = asyncio.create_task(conv.generate(prompt, max_tokens=4, eos_ids=()))
            while not ran:
                await asyncio.sleep(0.005)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await conv.close()
            for _ in range(200):
                if not peer.convs:
                    break
                await asyncio.sleep(0.02)
            assert not peer.convs
            await peer.executor.run(lambda: None)  # the pass, if still running, has ended
        assert ran == ["0"], ran  # without the check: all 4 layers
        assert peer.kv_bytes_used == 0


@pytest.mark.realmodel
def test_forward_batch_equals_single_forwards_default_model():
    """The reference prompts and prefixes of them: 6 sequences of 12..41 tokens, 2 hops."""
    cases = load_cases(DEFAULT)
    prompts = [c["prompt_ids"] for c in cases.values()]
    prompts += [p[:n] for p, n in zip(prompts, (12, 25, 19))]
    shards = [shard_of(DEFAULT, 0, 12), shard_of(DEFAULT, 12, 24)]
    assert compare_batched_with_single(shards, prompts, steps=4) == 4 * len(prompts)


@pytest.mark.realmodel
def test_forward_batch_picks_the_reference_tokens_default_model():
    """Teacher-forced batched decode of the reference cases picks their greedy tokens up to the first near-tie."""
    cases = list(load_cases(DEFAULT).values())
    shard = shard_of(DEFAULT, 0, 24)
    caches = [new_cache(shard, shard.range) for _ in cases]
    for c, cache in zip(cases, caches):
        first = int(shard(torch.tensor([c["prompt_ids"]]), 0, cache)[0, -1].argmax())
        assert first == c["greedy_ids"][0]
    ties = [first_near_tie(c) for c in cases]  # positions from there on may fairly differ
    compared = 0
    for j in range(min(12, max(ties) - 1)):
        live = [i for i, tie in enumerate(ties) if j + 1 < tie]
        outs = shard.forward_batch([torch.tensor([[cases[i]["greedy_ids"][j]]]) for i in live],
                                   [caches[i].length for i in live], [caches[i] for i in live])
        assert [int(o[0, -1].argmax()) for o in outs] == [cases[i]["greedy_ids"][j + 1] for i in live], j
        compared += len(live)
    assert compared >= 15, compared


# --------------------------------------------------------------------------- scheduler policy
def test_the_oldest_step_runs_next_and_a_prefill_runs_alone():
    sched = StepScheduler(None, None, finish=None, logits_mode=lambda w: "last", spawn=None, max_batch=3)
    loop = asyncio.new_event_loop()
    try:
        def job(tokens, run=(0, 4)):
            conv = SimpleNamespace(run=LayerRange(*run))
            sched._pending.append(SimpleNamespace(conv=conv, tokens=tokens, want="token",
                                                  future=loop.create_future()))
            return sched._pending[-1]

        a, b, p, c, d, other, e = job(1), job(2), job(200), job(1), job(1), job(1, (0, 2)), job(1)
        assert sched._take() == [a, b, c]  # small steps join the oldest, up to max_batch
        assert sched._take() == [p]  # the prefill is now oldest: it runs alone, not after every decode
        e.future.cancel()  # a cancelled worker's step is dropped
        assert sched._take() == [d]
        assert sched._take() == [other]  # other layers never share a pass
        assert sched._take() == []
    finally:
        loop.close()


def test_a_decode_step_waits_for_at_most_one_prefill_however_many_are_queued():
    """One client's many prefill chunks, queued first, do not hold another conversation's
    decode step behind all of them: prefills and decode passes alternate."""
    sched = StepScheduler(None, None, finish=None, logits_mode=lambda w: "last", spawn=None)
    loop = asyncio.new_event_loop()
    try:
        def job(tokens):
            conv = SimpleNamespace(run=LayerRange(0, 4))
            sched._pending.append(SimpleNamespace(conv=conv, tokens=tokens, want="token",
                                                  future=loop.create_future()))
            return sched._pending[-1]

        p1, p2, p3, d1 = job(512), job(512), job(BATCH_STEP_TOKENS + 1), job(1)
        assert sched._take() == [p1]
        assert sched._take() == [d1]  # not after p2 and p3
        p4, d2, d3 = job(512), job(1), job(BATCH_STEP_TOKENS)
        assert sched._take() == [p2]
        assert sched._take() == [d2, d3]
        assert sched._take() == [p3]  # prefills keep their order and never starve
        assert sched._take() == [p4]
        assert sched._take() == []
    finally:
        loop.close()


class SlowDevice:
    """A device executor whose every pass takes ``pass_s`` on its own thread, after queueing
    ``queue_s`` behind other work there, and a shard that records pass sizes."""

    def __init__(self, pass_s: float, queue_s: float = 0.0) -> None:
        self.pass_s, self.queue_s, self.passes = pass_s, queue_s, []
        self.device = "cpu"

    async def run(self, fn, *args):
        await asyncio.sleep(self.queue_s)
        return await asyncio.to_thread(fn, *args)

    def check_step(self, *args) -> None:
        pass

    def __call__(self, x, *args, **kwargs):
        time.sleep(self.pass_s)
        self.passes.append(1)
        return x

    def forward_batch(self, xs, *args, **kwargs):
        time.sleep(self.pass_s)
        self.passes.append(len(xs))
        return list(xs)


def scheduler_on(device: SlowDevice, **options) -> StepScheduler:
    tasks = []

    def spawn(coro, name):
        tasks.append(asyncio.ensure_future(coro))
        return tasks[-1]

    return StepScheduler(device, lambda: device, finish=lambda conv, *rest: conv.name,
                         logits_mode=lambda want: "last", spawn=spawn, **options)


async def steps_at(sched: StepScheduler, convs, delays_s) -> list:
    """One decode step of each conversation, submitted ``delays_s`` after now."""
    async def one(conv, delay):
        await asyncio.sleep(delay)
        return await sched.submit(conv, torch.zeros(1, 1, dtype=torch.int64), 0, "token")

    return await asyncio.gather(*(one(c, d) for c, d in zip(convs, delays_s)))


def decode_convs(n: int) -> list:
    return [SimpleNamespace(name=f"c{i}", run=LayerRange(0, 4), cache=None) for i in range(n)]


async def after_one_pass(n: int, *, pass_s: float, queue_s: float = 0.0, max_hold_s: float = 1.0):
    """(device, scheduler, conversations): ``n`` conversations that ran one pass together, so
    the scheduler counts every one of them as coming."""
    device = SlowDevice(pass_s=pass_s, queue_s=queue_s)
    sched = scheduler_on(device, max_hold_s=max_hold_s)
    convs = decode_convs(n)
    assert await steps_at(sched, convs, [0] * n) == [c.name for c in convs]
    return device, sched, convs


@pytest.mark.slow
async def test_a_pass_waits_for_conversations_that_are_coming():
    """Steps of the conversations of the last pass arriving 250 ms apart share one pass; without
    the wait, the first runs alone and the rest wait for the pass after it."""
    for hold_s, sizes in ((5.0, [3, 3]), (0.0, [3, 1, 2])):
        # the wait may last up to 1.5 s (half a pass). Steps 250 ms apart: on a machine so loaded
        # that the event loop stalls for tens of ms, the first step still starts its pass (no
        # wait) before the second arrives, and the last arrives well within the wait (with it)
        device, sched, convs = await after_one_pass(3, pass_s=3.0, max_hold_s=hold_s)
        assert await steps_at(sched, convs, [0, 0.25, 0.5]) == ["c0", "c1", "c2"]
        assert device.passes == sizes, hold_s
        assert (sched.stats.holds == 1) == (hold_s > 0)
        assert 0.4 < sched.stats.hold_s < 1.5 or hold_s == 0
        sched._loop_task.cancel()


@pytest.mark.slow
async def test_a_conversation_that_stops_costs_one_wait_and_a_lone_one_none():
    device, sched, convs = await after_one_pass(3, pass_s=1.0, max_hold_s=5.0)
    await steps_at(sched, convs[:2], [0, 0])  # c2 stopped: the pass waits half a pass for it, not max_hold_s
    assert sched.stats.holds == 1 and 0.45 < sched.stats.hold_s < 2.5
    await steps_at(sched, convs[:2], [0, 0])  # no longer counted as coming
    sched.forget(convs[1])  # an ended conversation is never waited for
    for _ in range(3):
        await steps_at(sched, convs[:1], [0])
    assert sched.stats.holds == 1
    assert device.passes == [3, 2, 2, 1, 1, 1]
    sched._loop_task.cancel()


async def test_work_queued_ahead_of_a_pass_does_not_lengthen_the_wait():
    """The wait is sized by the time passes take on the device, not by the time they queued
    behind other work there (a verify, a cache free): else one slow verify would let every
    stopped conversation cost the others max_hold_s."""
    device, sched, convs = await after_one_pass(2, pass_s=0.1, queue_s=2.0, max_hold_s=5.0)
    device.queue_s = 0.0
    await steps_at(sched, convs[:1], [0])  # c1 stopped: a wait of about half of 0.1 s, not of 2.1 s
    assert sched.stats.holds == 1 and sched.stats.hold_s < 0.5  # not 1.05: half of 2.1 s
    sched._loop_task.cancel()


async def test_a_conversation_that_ends_while_awaited_releases_the_pass_at_once():
    device, sched, convs = await after_one_pass(2, pass_s=2.0, max_hold_s=5.0)

    async def end_soon():
        await asyncio.sleep(0.02)
        sched.forget(convs[1])  # closed while the pass waits for it (the wait may last 1 s)

    await asyncio.gather(steps_at(sched, convs[:1], [0]), end_soon())
    assert sched.stats.holds == 1 and sched.stats.hold_s < 0.5
    assert device.passes == [2, 1]
    sched._loop_task.cancel()


async def test_a_prefill_never_waits():
    device, sched, convs = await after_one_pass(2, pass_s=0.1)
    await sched.submit(convs[0], torch.zeros(1, BATCH_STEP_TOKENS + 1, dtype=torch.int64), 0, "token")
    assert sched.stats.holds == 0 and device.passes == [2, 1]
    sched._loop_task.cancel()


def test_scheduler_options_are_checked():
    with pytest.raises(ValueError, match="max_hold_s must be 0 or more seconds, got -1"):
        StepScheduler(None, None, finish=None, logits_mode=None, spawn=None, max_hold_s=-1)
    with pytest.raises(ValueError, match="max_batch must be at least 1, got 0"):
        StepScheduler(None, None, finish=None, logits_mode=None, spawn=None, max_batch=0)


# --------------------------------------------------------------------------- mesh level


async def test_concurrent_conversations_give_the_tokens_each_gives_alone_tiny(tiny):
    path, digest, tok, _ = tiny
    shards = split(lambda r: load_shard(path, r), [0, 2, 4])
    async with mesh(shards, weights_hash=digest, bundle=tok.to_bundle(), client_limits=UNLIMITED) as peers:
        alone, together, batched = await alone_then_together(peers, tok, PROMPTS, max_tokens=12, stagger_s=0.005)
        assert together == alone
        assert all(len(t) == 12 for t in alone)
        assert all(b > 0 for b in batched), batched  # both hops really ran batched passes
        assert all(p.batch_stats.largest_batch > 1 for p in peers)
        assert all(p.batch_stats.fallbacks == 0 for p in peers)
        await asyncio.sleep(0.1)
        assert [p.kv_bytes_used for p in peers] == [0, 0]


async def test_max_batch_1_runs_every_step_alone(tiny):
    path, digest, tok, _ = tiny
    async with mesh([load_shard(path)], weights_hash=digest, bundle=tok.to_bundle(), client_limits=UNLIMITED,
                    max_batch=1) as peers:
        alone, together, batched = await alone_then_together(peers, tok, PROMPTS[:6], max_tokens=6, stagger_s=0)
        assert together == alone
        assert batched == [0] and peers[0].batch_stats.largest_batch == 1


@pytest.mark.realmodel
async def test_concurrent_conversations_give_the_tokens_each_gives_alone_default_model():
    from helpers.realmodels import model_path

    path = model_path(DEFAULT)
    bundle = Tokenizer.from_gguf(path).to_bundle()
    tok = Tokenizer.from_bundle(bundle)
    prompts = [c["messages"][-1]["content"] for c in load_cases(DEFAULT).values()]
    prompts += ["Write a haiku about caches.", "What is 17 times 3?", "Name a sorting algorithm.",
                "Explain recursion in one sentence.", "Reverse a string in Python."]
    shards = [shard_of(DEFAULT, 0, 12), shard_of(DEFAULT, 12, 24)]
    async with mesh(shards, weights_hash=file_hash(path), bundle=bundle, client_limits=UNLIMITED) as peers:
        alone, together, batched = await alone_then_together(peers, tok, prompts, max_tokens=8, stagger_s=0.2,
                                                             hold_devices_s=len(prompts) * 0.2 + 2.0)
        assert together == alone
        assert all(b > 0 for b in batched), batched
        assert all(p.batch_stats.largest_batch > 1 for p in peers)


# --------------------------------------------------------------------------- error isolation
async def steps_in_one_batch(peer, raw, hidden: dict[str, torch.Tensor]) -> dict[str, dict]:
    """Send one step per conversation while the device thread is held, so they queue and run as
    one pass (after the first, which the scheduler has already taken); each conversation's reply."""
    gate = threading.Event()
    peer.executor.submit(gate.wait, 30)
    try:
        for conv, h in hidden.items():
            await raw.send("step", conv=conv, seq=1, start=0, hidden=f32(h), want="token")
        await asyncio.sleep(0.2)
    finally:
        gate.set()
    replies = {}
    while len(replies) < len(hidden):
        reply = await raw.recv(10)
        replies[name_of(reply["conv"])] = reply
    return replies


def open_hidden_conversations(tiny, n: int, bad: int | None = None):
    """A rogue previous hop holding ``n`` conversations over layers 2-3 of a whole-model peer."""
    ids = [[3 + i, 1, 4, 1, 5][: 2 + i % 4] for i in range(n)]
    hidden = {}
    for i, x in enumerate(ids):
        h = hidden_after(tiny, x, 2).clone()
        if i == bad:
            h[0, -1, 3] = float("nan")
        hidden[f"c{i}"] = h
    return ids, hidden


async def test_a_bad_step_in_a_batch_fails_only_its_conversation(tiny):
    path, digest, tok, _ = tiny
    async with mesh([load_shard(path)], weights_hash=digest, bundle=tok.to_bundle()) as peers:
        peer = peers[0]
        ad = rogue_advert(digest)
        raw = await Raw.connect(peer, role="peer", advert=ad)
        try:
            ids, hidden = open_hidden_conversations(tiny, 6, bad=5)  # last: never in the first pass
            for conv in hidden:
                await raw.request("open", conv=conv, layers=[2, 4], max_tokens=16, prev=ad["peer_id"])
            replies = await steps_in_one_batch(peer, raw, hidden)
            assert peer.batch_stats.largest_batch >= 4  # the bad step was inside a batched pass
            for i, x in enumerate(ids):
                r = replies[f"c{i}"]
                if i == 5:
                    assert (r["t"], r["code"], r["seq"]) == ("error", "invalid_input", 1)
                    assert r["message"] == f"layers 2-3 produced NaN or inf at positions 0..{len(x) - 1}"
                else:
                    assert (r["t"], r["token"]) == ("token", last_token(tiny, x)), i
            assert peer.convs[conv_id("c5")].cache.length == 0 and peer.convs[conv_id("c0")].cache.length == len(ids[0])
            await raw.send("step", conv="c5", seq=2, start=0, hidden=f32(hidden_after(tiny, ids[5], 2)), want="token")
            r = await raw.recv()
            assert (r["t"], r["seq"], r["token"]) == ("token", 2, last_token(tiny, ids[5]))
            assert peer.batch_stats.fallbacks == 0
        finally:
            await raw.close()


async def test_a_failing_batched_pass_reruns_its_steps_one_by_one(tiny, monkeypatch):
    path, digest, tok, _ = tiny
    async with mesh([load_shard(path)], weights_hash=digest, bundle=tok.to_bundle()) as peers:
        peer = peers[0]

        def broken(*args, **kwargs):
            raise RuntimeError("simulated kernel failure")

        monkeypatch.setattr(peer.shard, "forward_batch", broken)
        ad = rogue_advert(digest)
        raw = await Raw.connect(peer, role="peer", advert=ad)
        try:
            ids, hidden = open_hidden_conversations(tiny, 5)
            for conv in hidden:
                await raw.request("open", conv=conv, layers=[2, 4], max_tokens=16, prev=ad["peer_id"])
            replies = await steps_in_one_batch(peer, raw, hidden)
            assert [replies[f"c{i}"].get("token") for i in range(5)] == [last_token(tiny, x) for x in ids]
            assert peer.batch_stats.fallbacks == 1
            assert [peer.convs[conv_id(f"c{i}")].cache.length for i in range(5)] == [len(x) for x in ids]
        finally:
            await raw.close()
