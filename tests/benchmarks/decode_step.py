"""Time one whole-model decode step, and the part of it spent in the projections.

    python tests/benchmarks/decode_step.py [--model PATH] [--dtype gguf-a16] [--threads 1]
                                           [--positions 1] [--steps 40]

Loads the whole model at ``--dtype``, prefills 40 tokens, then times ``--steps`` passes of
``--positions`` new positions each (1: a decode step; k + 1: a verification step), rolling the
KV cache back after each. Prints the median and lowest step time, ms, and the median time of
the same step's projections alone (every linear layer of the model called on an input of the
step's shape, one after another; at the gguf precisions the fused q/k/v and gate/up calls the
model makes). Step minus projections is the rest: attention, norms, RoPE and Python.

On a shared machine run it several times, alternating with the commit you compare against:
single runs moved by 20-30% (docs/performance.md).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def timed(fn, n: int) -> list[float]:
    """``fn()`` run ``n`` times after two warm-up calls: each call's milliseconds."""
    fn(), fn()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> None:
    from meshinfer.core.errors import MeshError
    from meshinfer.engine.generate import load_shard, new_cache
    from meshinfer.engine.models.gguf_linear import GGUFLinear, project_many
    from meshinfer.engine.weights.registry import DEFAULT_MODEL, resolve_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a GGUF file or a known model name (default: %(default)s)")
    ap.add_argument("--dtype", default="gguf-a16", help="precision (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: %(default)s)")
    ap.add_argument("--positions", type=int, default=1,
                    help="new positions per step: 1 a decode step, k + 1 a verification step (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=40, help="timed steps (default: %(default)s)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    try:
        shard = load_shard(str(resolve_model(args.model)), dtype=args.dtype)
    except MeshError as exc:
        raise SystemExit(f"error: {exc}") from None
    cache = new_cache(shard)
    shard(torch.arange(100, 140).unsqueeze(0), 0, cache)
    T = args.positions

    def step() -> None:
        start = cache.length
        shard(torch.arange(200, 200 + T).unsqueeze(0), start, cache, logits="last" if T == 1 else "all")
        cache.truncate(start)

    groups: list[tuple] = []  # the projections as the model calls them
    for block in shard.modules():
        attn, mlp = getattr(block, "self_attn", None), getattr(block, "mlp", None)
        if attn is not None and mlp is not None:
            groups += [(attn.q_proj, attn.k_proj, attn.v_proj), (attn.o_proj,),
                       (mlp.gate_proj, mlp.up_proj), (mlp.down_proj,)]
    if shard.lm_head is not None:
        groups.append((shard.lm_head,))

    def projections() -> None:
        for g in groups:
            x = torch.randn(1, T, g[0].in_features)
            if isinstance(g[0], GGUFLinear):
                project_many(x, g)
            else:
                for m in g:
                    m(x)

    steps, proj = timed(step, args.steps), timed(projections, max(5, args.steps // 4))
    print(f"{args.dtype}, {args.threads} thread(s), {T} position(s): step median {statistics.median(steps):.1f} ms "
          f"(lowest {min(steps):.1f}); projections median {statistics.median(proj):.1f} ms "
          f"({len(groups)} calls)")


if __name__ == "__main__":
    main()
