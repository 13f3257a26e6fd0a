"""One decode step alone against a batched pass of B decode steps, whole default model, one process.

What batching can gain at most on this machine, before any network or scheduling: the time
of ``Shard.forward`` for one conversation's decode step against ``Shard.forward_batch`` for B
conversations' steps (each with its own KV cache holding the same 41-token prefix), and the
ratio ``B * t_one / t_batch`` (how much more work per second the batched pass does).

    python tests/benchmarks/batched_pass.py [--dtype f32] [--batch 4,16] [--threads 2] [--steps 8]
"""

from __future__ import annotations

import argparse
import time

import torch

from meshinfer.engine.generate import load_shard
from meshinfer.engine.kv_cache import KVCache
from meshinfer.engine.weights.registry import resolve_model

PREFIX_TOKENS = 41


def timed(fn, steps: int) -> float:
    """Mean seconds of ``fn()`` over ``steps`` calls, after two untimed ones."""
    for _ in range(2):
        fn()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct-q4_k_m")
    ap.add_argument("--dtype", default="f32")
    ap.add_argument("--batch", default="4,16", help="batch sizes B to measure")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8, help="timed passes per measurement")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shard = load_shard(str(resolve_model(args.model)), dtype=args.dtype)
    cfg = shard.cfg
    prefix = torch.randint(0, 1000, (1, PREFIX_TOKENS), generator=torch.Generator().manual_seed(0))
    step = torch.tensor([[5]])

    def caches(n: int) -> list[KVCache]:
        out = [KVCache(shard.range, cfg.num_key_value_heads, cfg.head_dim, dtype=shard.dtype) for _ in range(n)]
        for c in out:
            shard(prefix, 0, c)
        return out

    def rewind(cs: list[KVCache]) -> None:  # every pass decodes at the same position
        for c in cs:
            c.truncate(PREFIX_TOKENS)

    with torch.inference_mode():
        [one] = caches(1)
        t_one = timed(lambda: (rewind([one]), shard(step, PREFIX_TOKENS, one)), args.steps)
        print(f"model {args.model}, {args.dtype}, {args.threads} threads, decode at position {PREFIX_TOKENS}\n")
        print("| B | one step ms | batched pass ms | work per second vs one step |\n|---:|---:|---:|---:|")
        for b in (int(x) for x in args.batch.split(",")):
            cs = caches(b)
            t_b = timed(lambda: (rewind(cs), shard.forward_batch([step] * b, [PREFIX_TOKENS] * b, cs)), args.steps)
            print(f"| {b} | {t_one * 1e3:.1f} | {t_b * 1e3:.1f} | {b * t_one / t_b:.2f}x |")


if __name__ == "__main__":
    main()
