"""A decode step four ways, alternated step by step in one process, so that this machine's
minute-to-minute speed cancels out:

    python tests/benchmarks/step_paths.py [--model PATH] [--dtype gguf-a8] [--threads 2] [--steps 40]

- ``one team``: all the layers of the step as one C call, in one OpenMP parallel region
  (``kernels/layer_step.py``, ``LayerStack``), the default;
- ``one call``: each Llama-family layer as one C call (``LayerStep``), one parallel region per
  product and attention (the code before the evening of 2026-12-03);
- ``C step ops``: the layer operation by operation, with RMSNorm, RoPE, attention and SwiGLU in C
  (``kernels/step_ops.py``), as batched passes and other families run;
- ``torch ops``: operation by operation with torch's operations (the code before 2026-12-03).

Prints the median and lowest step time of each (ms), after a 40-token prompt. The four give
the same tokens (the first three the same bits; tests/test_layer_step.py). Results:
docs/performance.md, "Around the projections" and "One team per step".
"""

from __future__ import annotations

import argparse
import statistics
import time
import types

import torch


def main() -> None:
    from meshinfer.engine.generate import load_shard, new_cache
    from meshinfer.engine.kernels import native, step_ops
    from meshinfer.engine.models import llama
    from meshinfer.engine.weights.registry import DEFAULT_MODEL, resolve_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a GGUF file or a known model name (default: %(default)s)")
    ap.add_argument("--dtype", default="gguf-a8", help="precision (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=40, help="timed steps of each path (default: %(default)s)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shard = load_shard(str(resolve_model(args.model)), dtype=args.dtype)
    cache = new_cache(shard)
    shard(torch.arange(100, 140).unsqueeze(0), 0, cache)
    one_call, no_library = llama.Block._one_call, types.SimpleNamespace(library=lambda: None)
    one_team = llama.layers_in_one_call

    def use(path: str) -> None:
        llama.layers_in_one_call = one_team if path == "one team" else (lambda *a: None)
        llama.Block._one_call = one_call if path in ("one team", "one call") else (lambda self, *a: None)
        step_ops.native = no_library if path == "torch ops" else native

    def step() -> float:
        start = cache.length
        t0 = time.perf_counter()
        shard(torch.tensor([[200]]), start, cache, logits="last")
        ms = (time.perf_counter() - t0) * 1e3
        cache.truncate(start)
        return ms

    paths = ("one team", "one call", "C step ops", "torch ops")
    times: dict[str, list[float]] = {p: [] for p in paths}
    for i in range(args.steps + 3):
        for p in paths:
            use(p)
            ms = step()
            if i >= 3:  # warm-up
                times[p].append(ms)
    use("one team")
    for p in paths:
        print(f"{args.dtype}, {args.threads} thread(s), {p}: step median {statistics.median(times[p]):.1f} ms "
              f"(lowest {min(times[p]):.1f})")


if __name__ == "__main__":
    main()
