"""Peak resident memory and load time of whole-model and half-model shards.

Each shard loads in a fresh Python process, so one load's pages and allocator state cannot
inflate the next one's numbers. Peak RSS is ``resource.getrusage(RUSAGE_SELF).ru_maxrss``
(KiB on Linux), which includes the pages of the memory-mapped GGUF file the load touched.

Usage::

    python tests/benchmarks/shard_memory.py [--model NAME_OR_PATH]

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


def child(path: str, start: int, stop: int) -> dict:
    """Load layers ``[start, stop)`` of ``path`` in this process; return the measurements."""
    import torch

    from meshinfer.core.config import LayerRange
    from meshinfer.engine.generate import load_shard
    from meshinfer.engine.weights import open_weights

    torch.set_num_threads(1)
    baseline = _rss_mib()  # interpreter + torch + meshinfer imported, nothing loaded
    t0 = time.perf_counter()
    src = open_weights(path)
    layers = LayerRange(start, stop)
    shard = load_shard(src, layers)
    load_s = time.perf_counter() - t0
    weights = sum(p.numel() * p.element_size() for p in shard.parameters())
    return {"layers": layers.cli(), "half_open": f"[{layers.start}, {layers.stop})",
            "baseline_mib": baseline, "peak_mib": _rss_mib(), "load_s": load_s,
            "weights_mib": weights / 2 ** 20}


def measure(path: str, start: int, stop: int) -> dict:
    """Run :func:`child` in a fresh interpreter and return its result."""
    cmd = [sys.executable, __file__, "--child", path, str(start), str(stop)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--child", nargs=3, metavar=("PATH", "START", "STOP"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        path, start, stop = args.child
        print(json.dumps(child(path, int(start), int(stop))))
        return

    from meshinfer.core.config import LayerRange
    from meshinfer.engine.weights.gguf_file import GGUFFile
    from meshinfer.engine.weights.registry import resolve_model

    path = os.fspath(resolve_model(args.model, pull_missing=False, progress=False))
    n_layers = GGUFFile(path).config.num_hidden_layers
    half = n_layers // 2
    ranges = [LayerRange(0, n_layers), LayerRange(0, half), LayerRange(half, n_layers)]
    print(f"model: {args.model} ({os.path.getsize(path) / 2 ** 20:.0f} MiB file, {n_layers} layers)\n")
    print("| layers (CLI) | half-open | f32 weights MiB | RSS after imports MiB | peak RSS MiB "
          "| peak - imports MiB | load s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in ranges:
        m = measure(path, r.start, r.stop)
        print(f"| {m['layers']} | {m['half_open']} | {m['weights_mib']:.0f} | {m['baseline_mib']:.0f} "
              f"| {m['peak_mib']:.0f} | {m['peak_mib'] - m['baseline_mib']:.0f} | {m['load_s']:.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
