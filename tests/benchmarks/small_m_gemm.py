"""Float32 products of a few rows: torch's ``F.linear`` (``x @ W.T``) against the transposed form
``(W @ x.T).T`` that ``meshinfer.engine.models.common.linear`` uses from two rows on.

For the default model's projection shapes and the output head, and M = 1, 2, 3, 5, 9, 16, 64,
512 rows (a decode step, verification steps of 1-15 drafts, a batch, a prefill chunk), it prints
the best of ``--runs`` calls of each form and whether the results are bitwise equal.

    python tests/benchmarks/small_m_gemm.py --threads 2
"""

from __future__ import annotations

import argparse

import torch
from torch.nn import functional as F

from quant_kernels import SHAPES, best_ms  # this folder is on sys.path when the script runs

ROWS = (1, 2, 3, 5, 9, 16, 64, 512)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.threads} thread(s), best of {args.runs} (ms)\n")
    print("| shape | rows | F.linear | (W @ x.T).T | ratio | bitwise equal |")
    print("|---|---:|---:|---:|---:|---|")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k)
        for m in ROWS:
            x = torch.randn(m, k)
            a = best_ms(lambda: F.linear(x, w), args.runs)
            b = best_ms(lambda: (w @ x.T).T.contiguous(), args.runs)
            same = torch.equal(F.linear(x, w), (w @ x.T).T)
            print(f"| {name} {n}x{k} | {m} | {a:.2f} | {b:.2f} | {a / b:.2f} | {same} |")


if __name__ == "__main__":
    main()
