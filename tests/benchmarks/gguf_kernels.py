"""Time the gguf kernels per tensor type and activation mode, against torch's float32 product.

    python tests/benchmarks/gguf_kernels.py [--model PATH] [--threads 1] [--rows 1,9]

For one tensor of each type in the model (default: the default model), it prints the milliseconds
of ``x @ W.T`` for ``--rows`` input rows: the block kernel at float32 (gguf), int16 (gguf-a16)
and int8 (gguf-a8) activations, and torch's float32 product of the dequantized weight (f32).
Bytes/s is the file's bytes of that tensor over the time. Results: docs/performance.md.
"""

from __future__ import annotations

import argparse
import time

import torch


def best_ms(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return min(times)


def main() -> None:
    from meshinfer.engine.kernels import blocks as kb
    from meshinfer.engine.models.common import linear
    from meshinfer.engine.weights.gguf_file import GGUFFile
    from meshinfer.engine.weights.registry import DEFAULT_MODEL, resolve_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,9")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    f = GGUFFile(resolve_model(args.model))
    seen: dict[str, str] = {}
    for name in f.tensor_names():
        t = f.tensor_type(name)
        if t in kb.KERNEL_TYPES and t != "F32" and name.endswith(".weight") and t not in seen:
            seen[t] = name
    if "output.weight" in f.tensor_names():
        seen["head " + f.tensor_type("output.weight")] = "output.weight"
    print(f"{args.threads} thread(s); ms per product (GB/s of the file's bytes)")
    print("| tensor | type | shape | rows | gguf | gguf-a16 | gguf-a8 | f32 (torch) |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for label, name in seen.items():
        raw = f._blocks(name)
        if raw is None:
            continue
        w = kb.blocks_from_file(raw, f.tensor_type(name), f._tensor(name).dims[0])
        dense = kb.dequantize(w)
        N, K = w.shape
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, K)
            cells = []
            for bits in (32, 16, 8):
                ms = best_ms(lambda: kb.matmul(x, w, act_bits=bits))
                cells.append(f"{ms:.2f} ({w.data.numel() / ms / 1e6:.1f})")
            ms = best_ms(lambda: linear(x, dense))
            cells.append(f"{ms:.2f}")
            print(f"| {name} | {label} | {N}x{K} | {m} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
