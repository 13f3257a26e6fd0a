"""How close an f32 decode step comes to this machine's memory read bound:

    python tests/benchmarks/f32_bound.py [--model PATH] [--threads 2] [--steps 30]

Alternates, in one process, a whole-model f32 decode step (after a 40-token prompt) with
``torch.sum`` over a buffer as large as the step's weights (1.976 GB for the default model: each
weight is read once per token), and prints both medians and their ratio: the share of the read
bound the step reaches (issue 13's target: at least 80%). Alternating cancels this machine's
minute-to-minute speed, which moved by 20-30% between runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    from meshinfer.engine.generate import load_shard, new_cache
    from meshinfer.engine.weights.registry import DEFAULT_MODEL, resolve_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a GGUF file or a known model name (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=30, help="timed steps (default: %(default)s)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shard = load_shard(str(resolve_model(args.model)), dtype="f32")
    nbytes = sum(m.weight.numel() * m.weight.element_size() for m in shard.modules() if isinstance(m, torch.nn.Linear))
    cache = new_cache(shard)
    shard(torch.arange(100, 140).unsqueeze(0), 0, cache)
    buffer = torch.ones(nbytes // 4)
    step_s, sum_s = [], []
    for i in range(args.steps + 3):
        start = cache.length
        t0 = time.perf_counter()
        shard(torch.tensor([[200]]), start, cache)
        t1 = time.perf_counter()
        cache.truncate(start)
        buffer.sum()
        t2 = time.perf_counter()
        if i >= 3:  # warm-up
            step_s.append(t1 - t0)
            sum_s.append(t2 - t1)
    st, sm = statistics.median(step_s), statistics.median(sum_s)
    print(f"f32 weights {nbytes / 1e9:.3f} GB, {args.threads} thread(s): step median {st * 1e3:.1f} ms "
          f"({nbytes / st / 1e9:.1f} GB/s), torch.sum median {sm * 1e3:.1f} ms ({nbytes / sm / 1e9:.1f} GB/s): "
          f"the step reaches {sm / st:.0%} of the read bound")


if __name__ == "__main__":
    main()
