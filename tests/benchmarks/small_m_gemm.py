"""Float32 products of a few rows: torch's ``F.linear`` (``x @ W.T``), the transposed form
``(W @ x.T).T``, and the C kernel ``mi_matmul_f32`` (``meshinfer.engine.kernels.blocks.matmul_f32``)
that ``meshinfer.engine.models.common.linear`` uses for up to ``F32_KERNEL_MAX_ROWS`` rows.

For the default model's projection shapes and the output head, and M = 1, 2, 3, 5, 9, 16, 64,
512 rows (a decode step, verification steps of 1-15 drafts, a batch, a prefill chunk), it prints
the best of ``--runs`` calls of each form, whether the transposed form is bitwise equal to
``F.linear``, and the kernel's largest relative difference from it ("-": rows past the kernel's).

    python tests/benchmarks/small_m_gemm.py --threads 2
"""

from __future__ import annotations

import argparse

import torch
from torch.nn import functional as F

from meshinfer.engine.kernels.blocks import matmul_f32

from quant_kernels import SHAPES, best_ms  # this folder is on sys.path when the script runs

ROWS = (1, 2, 3, 5, 9, 16, 64, 512)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.threads} thread(s), best of {args.runs} (ms)\n")
    print("| shape | rows | F.linear | (W @ x.T).T | C kernel | best vs F.linear | transposed bitwise equal | kernel rel. diff |")
    print("|---|---:|---:|---:|---:|---:|---|---:|")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k)
        for m in ROWS:
            x = torch.randn(m, k)
            a = best_ms(lambda: F.linear(x, w), args.runs)
            b = best_ms(lambda: (w @ x.T).T.contiguous(), args.runs)
            same = torch.equal(F.linear(x, w), (w @ x.T).T)
            ref, y = F.linear(x, w), matmul_f32(x, w)
            if y is None:
                c, diff = float("nan"), "-"
            else:
                c = best_ms(lambda: matmul_f32(x, w), args.runs)
                diff = f"{((y - ref).abs().max() / ref.abs().max()).item():.1e}"
            best = min(b, c) if y is not None else b
            print(f"| {name} {n}x{k} | {m} | {a:.2f} | {b:.2f} | {c:.2f} | {a / best:.2f} | {same} | {diff} |")


if __name__ == "__main__":
    main()
