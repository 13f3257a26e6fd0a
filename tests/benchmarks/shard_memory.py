"""Peak resident memory and load time of whole-model and half-model shards, loaded and then
serving.

Each shard loads in a fresh Python process, so one load's pages and allocator state cannot
inflate the next one's numbers. Peak RSS is ``resource.getrusage(RUSAGE_SELF).ru_maxrss``
(KiB on Linux), which includes the pages of the memory-mapped GGUF file the load touched.
After the load, with ``--serve``, the shard serves what a peer's busiest conversation asks of
it: a 1,000-position prefill in :data:`~meshinfer.engine.generate.PREFILL_CHUNK` chunks (token
ids on the first shard, random hidden states on the others), then 32 one-position decode
steps; the table then has the peak after serving too. ``peak - imports`` is the memory the
shard itself added to a process that had Python, torch and meshinfer imported (the
interpreter and torch alone hold about 220 MiB here, whatever the model).

Usage::

    python tests/benchmarks/shard_memory.py [--model NAME_OR_PATH] [--dtype gguf-a8] [--serve]

Prints a markdown table. Not collected by pytest (``norecursedirs`` holds tests/benchmarks).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct-q4_k_m"


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB on Linux


def child(path: str, start: int, stop: int, dtype: str, serve: bool) -> dict:
    """Load layers ``[start, stop)`` of ``path`` at precision ``dtype`` in this process (and
    serve a long prompt when ``serve``); return the measurements."""
    import torch

    from meshinfer.core.config import LayerRange
    from meshinfer.engine.generate import PREFILL_CHUNK, load_shard, new_cache
    from meshinfer.engine.weights import open_weights

    torch.set_num_threads(1)
    baseline = _rss_mib()  # interpreter + torch + meshinfer imported, nothing loaded
    t0 = time.perf_counter()
    src = open_weights(path)
    layers = LayerRange(start, stop)
    shard = load_shard(src, layers, dtype=dtype)
    load_s = time.perf_counter() - t0
    weights = sum(t.numel() * t.element_size() for t in (*shard.parameters(), *shard.buffers()))
    out = {"layers": layers.cli(), "half_open": f"[{layers.start}, {layers.stop})",
           "baseline_mib": baseline, "peak_mib": _rss_mib(), "load_s": load_s, "weights_mib": weights / 2 ** 20}
    if serve:
        with torch.inference_mode():
            cache, n = new_cache(shard), 1000
            gen = torch.Generator().manual_seed(0)

            def step_input(count: int) -> torch.Tensor:
                if shard.is_first:  # token ids (1, T)
                    return torch.randint(0, shard.cfg.vocab_size, (1, count), generator=gen)
                return torch.randn(1, count, shard.cfg.hidden_size, generator=gen)  # (1, T, C)

            for s in range(0, n, PREFILL_CHUNK):
                shard(step_input(min(PREFILL_CHUNK, n - s)), s, cache)
            for s in range(n, n + 32):
                shard(step_input(1), s, cache)
        out["served_peak_mib"] = _rss_mib()
    return out
def measure(path: str, start: int, stop: int, dtype: str, serve: bool) -> dict:
    """Run :func:`child` in a fresh interpreter and return its result."""
    cmd = [sys.executable, __file__, "--child", path, str(start), str(stop), dtype, str(int(serve))]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="f32", help="precision (default: %(default)s)")
    parser.add_argument("--serve", action="store_true",
                        help="after loading, prefill 1,000 positions and decode 32, and report that peak too")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        path, start, stop, dtype, serve = args.child
        print(json.dumps(child(path, int(start), int(stop), dtype, serve == "1")))
        return

    from meshinfer.core.config import LayerRange
    from meshinfer.engine.weights.gguf_file import GGUFFile
    from meshinfer.engine.weights.registry import resolve_model

    path = os.fspath(resolve_model(args.model, pull_missing=False, progress=False))
    n_layers = GGUFFile(path).config.num_hidden_layers
    half = n_layers // 2
    ranges = [LayerRange(0, n_layers), LayerRange(0, half), LayerRange(half, n_layers)]
    size = os.path.getsize(path) / 2 ** 20
    print(f"model: {args.model} ({size:.0f} MiB file, {n_layers} layers), {args.dtype}\n")
    served = " | peak RSS serving MiB | serving peak - imports MiB | (serving peak - imports) / file" if args.serve else ""
    print("| layers (CLI) | half-open | weights MiB | RSS after imports MiB | peak RSS MiB "
          f"| peak - imports MiB | load s{served} |")
    print("|---|---|---:|---:|---:|---:|---:" + ("|---:|---:|---:" if args.serve else "") + "|")
    for r in ranges:
        m = measure(path, r.start, r.stop, args.dtype, args.serve)
        row = (f"| {m['layers']} | {m['half_open']} | {m['weights_mib']:.0f} | {m['baseline_mib']:.0f} "
               f"| {m['peak_mib']:.0f} | {m['peak_mib'] - m['baseline_mib']:.0f} | {m['load_s']:.1f}")
        if args.serve:
            added = m["served_peak_mib"] - m["baseline_mib"]
            row += f" | {m['served_peak_mib']:.0f} | {added:.0f} | {added / size:.2f}x"
        print(row + " |", flush=True)

if __name__ == "__main__":
    main()
