"""Prefill-size quantized matmuls: the int8 kernel against the dense bf16 path.

For the default model's largest projection shapes it times ``Int8Linear`` on ``M`` rows both
ways: through the kernel (``torch._weight_int8pack_mm``) and through the dense path the module
takes from ``meshinfer.engine.models.quant.DENSE_MIN_ROWS`` rows on (weight dequantized to bf16, one bf16
matmul, or one f32 matmul of the same values on a CPU without bf16 hardware:
``quant.native_bf16_matmul``). Best of ``--runs`` calls each; prints a markdown table.

    python tests/benchmarks/prefill_kernels.py --threads 2 --rows 32,64,128,256,512
"""

from __future__ import annotations

import argparse

import torch

from meshinfer.engine.models import quant
from quant_kernels import best_ms  # this folder is on sys.path when the script runs

SHAPES = {"gate/up 4864x896": (4864, 896), "down 896x4864": (896, 4864), "q/o 896x896": (896, 896)}


def timed(module, x: torch.Tensor, dense: bool, runs: int) -> float:
    """ms of ``module(x)`` with the dense path forced on or off."""
    saved = quant.DENSE_MIN_ROWS
    quant.DENSE_MIN_ROWS = 1 if dense else 1 << 30
    try:
        return best_ms(lambda: module(x), runs)
    finally:
        quant.DENSE_MIN_ROWS = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--rows", default="32,64,128,256,512")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.threads} threads, best of {args.runs}; DENSE_MIN_ROWS = {quant.DENSE_MIN_ROWS}\n")
    print("| shape | rows | int8 kernel ms | int8 dense ms |")
    print("|---|---:|---:|---:|")
    with torch.inference_mode():
        for name, (N, K) in SHAPES.items():
            w = torch.randn(N, K, generator=torch.Generator().manual_seed(0)) * 0.02
            m8 = quant.Int8Linear(K, N, False)
            m8.set_float_weight(w)
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, K)
                t = [timed(m8, x, dense, args.runs) for dense in (False, True)]
                print(f"| {name} | {rows} | " + " | ".join(f"{v:.1f}" for v in t) + " |")


if __name__ == "__main__":
    main()
