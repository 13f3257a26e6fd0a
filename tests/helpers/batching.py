"""Batched against single decode: the comparison of a shard chain and the alone-then-together run
through a mesh (tests/test_batching.py, tests/test_gpu.py, tests/test_moe_mesh.py)."""

from __future__ import annotations

import asyncio
import copy
import threading

import torch

from helpers.meshkit import generate_through
from meshinfer.engine.generate import new_cache  # on the shard's device (a CUDA test once made them on the CPU)
from meshinfer.peer.node import ClientLimits

#: Largest relative difference (max |a - b| / max |b|) allowed between batched and single
#: outputs. Measured on the default model: 5e-7 (the BLAS kernel for N rows rounds
#: differently from the one for 1 row); 1e-5 leaves room for other CPUs.
REL_TOL = 1e-5
#: Client limits high enough that a test's many fast conversations from 127.0.0.1 are not throttled.
UNLIMITED = ClientLimits(conversations=64, steps_per_s=1e6, bytes_per_s=1e12, frames_per_s=1e9)
PROMPTS = ["hi", "what is a mesh?", "add two numbers in python", "x", "tell me about layers and caches",
           "why", "count to five", "a much longer prompt that makes this conversation's cache longer than the rest",
           "ok", "name three colours", "sum", "the end of the list of prompts, also quite long"]


#: Step deadline floor of the concurrency tests: many conversations of the real model share two
#: peers, and on a loaded 2-core machine one step can queue behind tens of seconds of passes; a
#: missed deadline would fail over (from a peer that is only busy) and test nothing.
CONCURRENT_DEADLINE_FLOOR_S = 300.0


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def compare_batched_with_single(shards: list, prompts: list[list[int]], steps: int, *, step_tokens=None) -> int:
    """Run ``prompts`` through the chain ``shards`` one sequence at a time and batched; assert
    every hop's output agrees within REL_TOL and every chosen token is the same. Each sequence
    decodes its own single-path argmax (free-running), ``step_tokens(i, step)`` tokens a step
    (the chosen token repeated: any ids do for a comparison). Returns tokens compared."""
    runs = [s.range for s in shards]
    single = [[new_cache(s, s.range) for s in shards] for _ in prompts]
    nxt = []
    for p, cs in zip(prompts, single):
        x = torch.tensor([p])
        for shard, c in zip(shards, cs):
            x = shard(x, 0, c)
        nxt.append(int(x[0, -1].argmax()))
    batch = copy.deepcopy(single)  # the same prefilled caches, computed once
    compared = 0
    for step in range(steps):
        widths = [step_tokens(i, step) if step_tokens else 1 for i in range(len(prompts))]
        xs_single = [torch.tensor([[t] * w]) for t, w in zip(nxt, widths)]
        xs_batch = list(xs_single)
        for h, shard in enumerate(shards):
            starts = [c[h].length for c in single]
            assert starts == [c[h].length for c in batch]
            outs1 = [shard(x, s, c[h]) for x, s, c in zip(xs_single, starts, single)]
            outsb = shard.forward_batch(xs_batch, starts, [c[h] for c in batch], run=runs[h])
            for o1, ob in zip(outs1, outsb):
                assert o1.shape == ob.shape
                assert rel_err(ob, o1) <= REL_TOL, (h, step, rel_err(ob, o1))
            xs_single, xs_batch = outs1, outsb
        tokens_single = [int(o[0, -1].argmax()) for o in xs_single]
        assert [int(o[0, -1].argmax()) for o in xs_batch] == tokens_single, step
        compared += len(tokens_single)
        nxt = tokens_single
    return compared


async def alone_then_together(peers, tok, prompts: list[str], *, max_tokens: int, stagger_s: float,
                              hold_devices_s: float = 0.0):
    """Each prompt through the mesh alone, then all at once (started ``stagger_s`` apart).

    With ``hold_devices_s`` > 0, every peer's device thread is held that long while the
    conversations start, so their first steps queue together however loaded the machine is (on a
    loaded core, one conversation's whole reply can otherwise finish before the next arrives).
    Returns (alone ids, together ids, batched passes per peer during the together run).
    """
    alone = []
    for p in prompts:
        _, _, out = await generate_through(peers, tok, [{"role": "user", "content": p}], max_tokens=max_tokens,
                                         max_tokens_total=200, deadline_floor_s=CONCURRENT_DEADLINE_FLOOR_S)
        alone.append(out.token_ids)
    before = [p.batch_stats.batched_passes for p in peers]

    async def later(i, p):
        await asyncio.sleep(i * stagger_s)
        _, _, out = await generate_through(peers, tok, [{"role": "user", "content": p}], max_tokens=max_tokens,
                                         max_tokens_total=200, deadline_floor_s=CONCURRENT_DEADLINE_FLOOR_S)
        return out.token_ids

    gates = [threading.Event() for _ in peers] if hold_devices_s > 0 else []
    for peer, gate in zip(peers, gates):
        peer.executor.submit(gate.wait, hold_devices_s + 60)
    running = asyncio.gather(*(later(i, p) for i, p in enumerate(prompts)))
    if gates:
        await asyncio.sleep(hold_devices_s)
        for gate in gates:
            gate.set()
    together = await running
    return alone, list(together), [p.batch_stats.batched_passes - b for p, b in zip(peers, before)]
